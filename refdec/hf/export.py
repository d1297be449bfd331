"""A refdec checkpoint -> a folder stock transformers loads, checked against refdec.

Export route: PegasusForConditionalGeneration, the dimensions permuted. Three stock architectures
hold refdec's layers; they differ in the position table:
  * M2M100 computes its table at load time (a buffer that is never saved) with other frequencies
    than refdec's: a refdec model exported as M2M100 would run on another table. Not exact.
  * Marian and Pegasus keep the table as a saved weight, loaded from the folder as written, laid
    out [sin | cos] at refdec's own frequencies 10000^(-2i/d). Marian is post-norm (no final
    norms); Pegasus is pre-norm with final encoder and decoder LayerNorms: refdec's pre-norm models
    (norm_first=True, every shipped one) are Pegasus models.
refdec interleaves sin (even dims) and cos (odd dims). A fixed permutation of the model dimension,
even dims first, then odd ones, applied to every weight that reads or writes the residual stream
(embedding columns, q/k/v and fc1 input columns, out-projection and fc2 output rows and biases,
LayerNorm gains and biases), turns refdec's table into Pegasus's layout and leaves the function
unchanged: LayerNorm and every dot product over the model dimension only see their terms in another
order. The table is written as refdec's own values (float64, whatever the weights' dtype), so a
float64 load holds refdec's float64 table bit for bit, and a float32 load the same rounding refdec
makes; a load that recomputed the table would get the same sinusoid. Import undoes the permutation,
so refdec -> HF -> refdec gives back every weight bit for bit, and bitwise-equal logits. A model
with the M2M100 table (an imported one) exports as M2M100, whose table transformers computes as
refdec does for it. Post-norm models and models with forced language tokens are not exported.
`export` loads the written folder with transformers and checks it before returning: float64 logits
within 1e-12 of refdec's and the same greedy output on a probe sentence.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..checkpoint import load_model
from ..config import ModelConfig
from ..model import Transformer, sinusoidal_positions
from ..tokenizer import Tokenizer
from .common import LOGIT_TOLERANCE, HFError, require_safetensors, require_transformers
from .compare import compare_with_folder
from .importing import M2M100, MODEL_TYPES, PEGASUS
from .layout import half_split, hf_names, permute_state


def export_route(cfg: ModelConfig) -> str:
    """The stock architecture that holds `cfg` exactly (module docstring), or one line on why none does."""
    if not cfg.norm_first:
        raise HFError("post-norm models (norm_first false) are not exported: no stock pre-norm architecture holds them")
    if not cfg.tie_embeddings or not cfg.enc_layers or cfg.d_memory:
        raise HFError("only a plain model with its own encoder and tied embeddings is exported")
    if cfg.encoder_prefix or cfg.decoder_prefix:
        raise HFError("a model with forced language tokens is not exported (transformers chooses them per call)")
    if cfg.positions == "sinusoidal" and cfg.d_model % 2:
        raise HFError("an odd d_model has no [sin | cos] layout")
    return M2M100 if cfg.positions == "m2m100" else PEGASUS


def hf_state(model: Transformer) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(architecture, config.json fields, tensors under their transformers names) for a refdec model."""
    cfg = model.cfg
    arch = export_route(cfg)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "src_embed.weight"}
    if arch == PEGASUS:
        perm = half_split(cfg.d_model)
        state = permute_state(state, perm)
    names = hf_names(cfg)
    out = {f"model.{names[k]}": v.contiguous() for k, v in state.items()}
    if arch == PEGASUS:
        table = sinusoidal_positions(cfg.max_positions, cfg.d_model)[:, perm].contiguous()  # float64, see docstring
        out["model.encoder.embed_positions.weight"] = table
        out["model.decoder.embed_positions.weight"] = table.clone()
        out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size, dtype=state["tgt_embed.weight"].dtype)
    fields = {
        "architectures": [arch],
        "model_type": {v: k for k, v in MODEL_TYPES.items()}[arch],
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.enc_layers,
        "decoder_layers": cfg.dec_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "max_position_embeddings": cfg.max_positions,
        "activation_function": "relu",
        "scale_embedding": True,
        "tie_word_embeddings": True,
        "dropout": cfg.dropout,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "is_encoder_decoder": True,
        "pad_token_id": cfg.pad_id,
        "eos_token_id": cfg.eos_id,
        "bos_token_id": cfg.bos_id,
        "decoder_start_token_id": cfg.bos_id,
        "forced_eos_token_id": None,
        "forced_bos_token_id": None,
    }
    return arch, fields, out


def write_folder(
    model: Transformer, tokenizer: Tokenizer, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Weights in `dtype`; the position table (Pegasus) in float64."""
    transformers = require_transformers()
    arch, fields, tensors = hf_state(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = transformers.PegasusConfig if arch == PEGASUS else transformers.M2M100Config
    config = config_cls(**{k: v for k, v in fields.items() if k != "model_type"})
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    transformers.GenerationConfig(
        decoder_start_token_id=model.cfg.bos_id,
        bos_token_id=model.cfg.bos_id,
        eos_token_id=model.cfg.eos_id,
        pad_token_id=model.cfg.pad_id,
        do_sample=False,
        num_beams=1,
    ).save_pretrained(out)
    tensors = {k: (v if k.endswith("embed_positions.weight") else v.to(dtype)).contiguous() for k, v in tensors.items()}
    (out / "model.safetensors").write_bytes(require_safetensors().save(tensors, metadata={"format": "pt"}))
    tokenizer.save(out / "tokenizer.json")
    specials = {}
    for name, i in (
        ("pad_token", tokenizer.pad_id),
        ("bos_token", tokenizer.bos_id),
        ("eos_token", tokenizer.eos_id),
        ("unk_token", tokenizer.unk_id),
        ("mask_token", tokenizer.mask_id),
    ):
        if i is not None:
            specials[name] = tokenizer.tokens([i])[0]
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **specials}, indent=2) + "\n", encoding="utf-8"
    )
    return out


def check_export(model: Transformer, folder: Path, src_ids: list[int], max_len: int = 32) -> dict:
    """Load `folder` with transformers in float64 and compare it with refdec's model (in float64) on
    one source: the logits along refdec's greedy output, and the greedy output itself."""
    result = compare_with_folder(model, folder, [src_ids], max_len)
    if result["max_logit_difference"] > LOGIT_TOLERANCE or not result["same_greedy"]:
        raise HFError(f"the exported folder {folder} does not reproduce the model: {result['said']}")
    return {"max_logit_difference": result["max_logit_difference"], "greedy_tokens": result["greedy_tokens"]}


def check_heads(ckpt: str | Path, stored: dict, without_heads: bool) -> None:
    """A checkpoint with blockwise proposal heads (refdec.proposal) has no transformers equivalent:
    no stock architecture holds heads beside the model, nor decodes blockwise. Refused unless
    `without_heads` says to export the model they sit on alone."""
    if "proposal" not in stored or without_heads:
        return
    base = stored.get("frozen_base")
    instead = (
        f"export its frozen base {os.path.normpath(Path(ckpt).parent / base['path'])} instead, or " if base else ""
    )
    raise HFError(
        f"{ckpt} carries {stored['proposal']['config']['k'] - 1} blockwise proposal heads, which no "
        f"transformers architecture holds: {instead}pass --without-heads to export the model without them "
        f"(blockwise decoding needs the refdec checkpoint)"
    )


def export(
    ckpt: str | Path,
    out_dir: str | Path,
    probe: str = "A short sentence to check the export.",
    *,
    without_heads: bool = False,
) -> dict:
    """A refdec checkpoint -> a transformers folder, checked by loading it back with transformers.
    A checkpoint with proposal heads is refused unless `without_heads` (check_heads)."""
    model, tokenizer, stored = load_model(ckpt)
    check_heads(ckpt, stored, without_heads)
    print(
        f"exporting to {out_dir}, then loading it back with transformers to check it (several seconds)",
        file=sys.stderr,
        flush=True,
    )
    folder = write_folder(model, tokenizer, out_dir)
    return {
        "folder": str(folder),
        "architecture": export_route(model.cfg),
        "heads_left_out": "proposal" in stored,
        **check_export(model, folder, tokenizer.encode(probe)),
    }
