"""Hugging Face transformers interoperability: import a model folder, export a checkpoint, audit.

Everything that touches transformers lives here, and transformers is imported only inside the
functions that need it: the rest of refdec imports and runs without it.

    python -m refdec.hf export CKPT OUT_DIR          a folder stock transformers loads (no remote code)
    python -m refdec.hf audit --task T --model M [--small S] --limit N --threads T --report FILE
    decode.py --model HF_FOLDER [--src-lang L --tgt-lang L]   (greedy, beam, iad: one-model algorithms)

Import. An `M2M100ForConditionalGeneration` folder (M2M100, NLLB: config.json, model.safetensors or
pytorch_model.bin, sharded or not, and tokenizer.json) is refdec's pre-norm Transformer: pre-norm
layers, biased q/k/v/out projections, a ReLU feed-forward, final encoder and decoder LayerNorms,
embeddings scaled by sqrt(d_model) and tied. Only its position table differs, and ModelConfig's
positions="m2m100" builds that table exactly as transformers does (refdec.model.m2m100_positions:
[sin | cos] halves, its frequencies, float32 arithmetic, position p at row p + pad_id + 1). Its
special ids are kept as they are (ModelConfig's pad/bos/eos ids, Tokenizer.foreign); the decoder's
start token is its decoder_start_token_id. Language codes are forced tokens: the source language's
before every source (encoder_prefix), the target language's after the start token (decoder_prefix,
NLLB's forced_bos_token_id); the model inserts them, so every decoder honours them unchanged.

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

Audit. refdec greedy, refdec IAD (GEC tasks) and speculative decoding (with --small), transformers'
greedy generate, assisted generation (the small model as assistant_model) and prompt-lookup
decoding, on the same weights and inputs, in one process, interleaved sentence by sentence after a
warm-up: seconds, ms per output token, and how many outputs equal refdec greedy's, each differing
line with its first divergent position and refdec's top-1/top-2 logit margin there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_model
from .config import ModelConfig
from .model import Transformer, sinusoidal_positions
from .tokenizer import Tokenizer

M2M100, PEGASUS = "M2M100ForConditionalGeneration", "PegasusForConditionalGeneration"
MODEL_TYPES = {"m2m_100": M2M100, "pegasus": PEGASUS}
LOGIT_TOLERANCE = 1e-12  # float64 logits of refdec and transformers on the same weights
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class HFError(CheckpointError):
    """A folder or checkpoint refdec cannot import or export: one line."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFError("this needs the transformers package (pip install -r requirements.txt)") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _safetensors_torch():
    try:
        import safetensors.torch
    except ImportError:
        raise HFError("reading and writing model.safetensors needs the safetensors package "
                      "(it comes with transformers: pip install -r requirements.txt)") from None
    return safetensors.torch


# -- names and layout -----------------------------------------------------------------------------
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "out_proj"}
_ENC = {**{f"attn.{a}": f"self_attn.{b}" for a, b in _ATTN.items()},
        "ff.w1": "fc1", "ff.w2": "fc2", "sub1.norm": "self_attn_layer_norm", "sub2.norm": "final_layer_norm"}
_DEC = {**{f"self_attn.{a}": f"self_attn.{b}" for a, b in _ATTN.items()},
        **{f"cross_attn.{a}": f"encoder_attn.{b}" for a, b in _ATTN.items()},
        "ff.w1": "fc1", "ff.w2": "fc2", "sub1.norm": "self_attn_layer_norm", "sub2.norm": "encoder_attn_layer_norm",
        "sub3.norm": "final_layer_norm"}
_READS = ("wq", "wk", "wv", "w1")  # linear maps whose input is the residual stream (d_model columns)
_WRITES = ("wo", "w2")  # linear maps whose output is the residual stream (d_model rows)


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """refdec state-dict key -> the transformers key (without the "model." prefix) of the same tensor."""
    names = {"tgt_embed.weight": "shared.weight", "enc_norm.weight": "encoder.layer_norm.weight",
             "enc_norm.bias": "encoder.layer_norm.bias", "dec_norm.weight": "decoder.layer_norm.weight",
             "dec_norm.bias": "decoder.layer_norm.bias"}
    for side, n, table in (("encoder", cfg.enc_layers, _ENC), ("decoder", cfg.dec_layers, _DEC)):
        for i in range(n):
            for ours, theirs in table.items():
                for p in ("weight", "bias"):
                    names[f"{side}.{i}.{ours}.{p}"] = f"{side}.layers.{i}.{theirs}.{p}"
    return names


def half_split(d: int) -> torch.Tensor:
    """The permutation of the model dimension that turns refdec's interleaved table into [sin | cos]:
    dims 0, 2, 4, .. then 1, 3, 5, .. (new dim j holds old dim perm[j])."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_state(state: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every residual-stream dimension of a refdec state dict reordered by `perm` (see the docstring)."""
    out = {}
    for key, t in state.items():
        parts = key.split(".")
        if key.endswith("embed.weight"):
            t = t[:, perm]
        elif parts[-2] in ("norm", "enc_norm", "dec_norm"):  # LayerNorm gains and biases
            t = t[perm]
        elif parts[-2] in _READS and parts[-1] == "weight":
            t = t[:, perm]
        elif parts[-2] in _WRITES:
            t = t[perm]
        out[key] = t.contiguous()
    return out


# -- import ---------------------------------------------------------------------------------------
def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path}: {str(e).splitlines()[0][:200]}") from None


def architecture(config: dict, folder: Path) -> str:
    arch = MODEL_TYPES.get(config.get("model_type"))
    if arch is None or (config.get("architectures") and arch not in config["architectures"]):
        got = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        raise HFError(f"{folder}: unsupported architecture {got}; refdec imports {M2M100} (M2M100, NLLB) "
                      f"and the {PEGASUS} folders `python -m refdec.hf export` writes")
    return arch


def model_config(config: dict, arch: str, folder: Path, encoder_prefix=(), decoder_prefix=()) -> ModelConfig:
    """refdec's ModelConfig for a transformers config.json, or one line on what does not fit."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise HFError(f"{folder}: {what}; refdec's Transformer cannot hold this model")
    need(config.get("activation_function", "relu") == "relu", f"activation {config.get('activation_function')!r}, not relu")
    need(config.get("scale_embedding", False), "embeddings not scaled by sqrt(d_model) (scale_embedding false)")
    need(config.get("tie_word_embeddings", True), "untied input and output embeddings")
    need(config["encoder_attention_heads"] == config["decoder_attention_heads"], "different encoder and decoder head counts")
    need(config["encoder_ffn_dim"] == config["decoder_ffn_dim"], "different encoder and decoder feed-forward widths")
    need(config.get("encoder_layers", 0) >= 1, "no encoder layers")
    start = config.get("decoder_start_token_id")
    need(start is not None, "no decoder_start_token_id")
    try:
        return ModelConfig(
            vocab_size=config["vocab_size"], d_model=config["d_model"], n_heads=config["encoder_attention_heads"],
            d_ff=config["encoder_ffn_dim"], enc_layers=config["encoder_layers"], dec_layers=config["decoder_layers"],
            dropout=config.get("dropout", 0.1), norm_first=True, tie_embeddings=True,
            max_positions=config["max_position_embeddings"], pad_id=config["pad_token_id"], bos_id=start,
            eos_id=config["eos_token_id"], positions="m2m100" if arch == M2M100 else "sinusoidal",
            encoder_prefix=tuple(encoder_prefix), decoder_prefix=tuple(decoder_prefix))
    except KeyError as e:
        raise HFError(f"{folder}/config.json has no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"{folder}/config.json: {str(e).splitlines()[0][:200]}") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors (safetensors preferred; .bin files load with weights_only=True), keys
    without the "model." prefix."""
    found = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if found is None:
        raise HFError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    files = [found]
    if found.name.endswith(".index.json"):
        files = [folder / f for f in sorted(set(_read_json(found).get("weight_map", {}).values()))]
        if not files or not all(f.is_file() for f in files):
            raise HFError(f"{found} names shards that are not in {folder}")
    state = {}
    for f in files:
        try:
            if f.name.endswith(".safetensors"):
                part = _safetensors_torch().load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except HFError:
            raise
        except Exception as e:
            raise HFError(f"cannot load {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        state.update({k.removeprefix("model."): v for k, v in part.items()})
    return state


def _embedding(weights: dict[str, torch.Tensor], folder: Path) -> torch.Tensor:
    names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    present = [weights[n] for n in names if n in weights]
    if not present:
        raise HFError(f"{folder}: no embedding matrix (shared.weight) in the weights")
    if any(not torch.equal(p, present[0]) for p in present[1:]):
        raise HFError(f"{folder}: the input and output embeddings differ; refdec ties them")
    return present[0]


def load_tokenizer(folder: Path, config: dict) -> Tokenizer:
    """tokenizer.json of the folder: refdec's own kind when it is one (an exported refdec model),
    else wrapped with the config's special ids."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise HFError(f"{folder} has no tokenizer.json")
    text = path.read_text(encoding="utf-8")
    cfg_ids = (config.get("pad_token_id"), config.get("decoder_start_token_id"), config.get("eos_token_id"))
    try:
        tok = Tokenizer.load(path)
        if cfg_ids == (tok.pad_id, tok.bos_id, tok.eos_id):
            return tok
    except Exception:  # not refdec's kind: wrapped below, or one line on why it cannot be
        pass
    try:
        return Tokenizer.foreign(text, pad_id=cfg_ids[0], bos_id=cfg_ids[1], eos_id=cfg_ids[2])
    except Exception as e:
        raise HFError(f"cannot load tokenizer {path}: {str(e).splitlines()[0][:200]}") from None


def language_ids(tokenizer: Tokenizer, folder: Path, config: dict, src_lang: str | None, tgt_lang: str | None):
    """(encoder_prefix, decoder_prefix): the language-code tokens named, the target's defaulting to
    the folder's forced_bos_token_id (config.json or generation_config.json)."""
    def token(name: str, what: str) -> int:
        i = tokenizer._tok.token_to_id(name)
        if i is None:
            raise HFError(f"{what} {name!r} is not a token of {folder}/tokenizer.json")
        return i
    enc = (token(src_lang, "--src-lang"),) if src_lang else ()
    if tgt_lang:
        return enc, (token(tgt_lang, "--tgt-lang"),)
    gen = folder / "generation_config.json"
    forced = config.get("forced_bos_token_id")
    if forced is None and gen.is_file():
        forced = _read_json(gen).get("forced_bos_token_id")
    return enc, ((forced,) if forced is not None else ())


def load_folder(folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                src_lang: str | None = None, tgt_lang: str | None = None) -> tuple[Transformer, Tokenizer, dict]:
    """A transformers model folder -> (refdec model in eval mode, tokenizer, a checkpoint-like dict)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"model folder {folder} not found")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder} has no config.json (not a transformers model folder)")
    config = _read_json(folder / "config.json")
    arch = architecture(config, folder)
    model_config(config, arch, folder)  # what does not fit is told before the tokenizer is read
    tokenizer = load_tokenizer(folder, config)
    enc, dec = language_ids(tokenizer, folder, config, src_lang, tgt_lang)
    cfg = model_config(config, arch, folder, enc, dec)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise HFError(f"{folder}/tokenizer.json has {tokenizer.vocab_size} tokens but the model {cfg.vocab_size} embeddings")
    weights = read_weights(folder)
    names = hf_names(cfg)
    missing = sorted(theirs for ours, theirs in names.items() if theirs != "shared.weight" and theirs not in weights)
    if missing:
        raise HFError(f"{folder}: {len(missing)} weight(s) missing from the files, e.g. {missing[0]}")
    state = {ours: (_embedding(weights, folder) if theirs == "shared.weight" else weights[theirs]).float()
             for ours, theirs in names.items()}
    if arch == PEGASUS:  # refdec's own export: undo its permutation and check the table it carries
        perm = half_split(cfg.d_model)
        state = permute_state(state, torch.argsort(perm))
        table = sinusoidal_positions(cfg.max_positions, cfg.d_model)[:, perm]
        for side in ("encoder", "decoder"):
            stored = weights.get(f"{side}.embed_positions.weight")
            if stored is None or stored.shape != table.shape or not torch.equal(stored, table.to(stored.dtype)):
                raise HFError(f"{folder}: the {side}'s position table is not refdec's sinusoidal table; refdec imports "
                              f"Pegasus folders that `python -m refdec.hf export` wrote")
    state["src_embed.weight"] = state["tgt_embed.weight"]
    model = Transformer(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise HFError(f"{folder}: weights do not fit config.json: {str(e).splitlines()[0][:200]}") from None
    model.to(device=device, dtype=dtype).eval()
    return model, tokenizer, {"format": "transformers", "task": None, "step": None, "architecture": arch,
                              "model_config": cfg.to_dict(), "meta": {"folder": str(folder)}}


# -- export ---------------------------------------------------------------------------------------
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
        "architectures": [arch], "model_type": {v: k for k, v in MODEL_TYPES.items()}[arch],
        "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "encoder_layers": cfg.enc_layers,
        "decoder_layers": cfg.dec_layers, "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "max_position_embeddings": cfg.max_positions,
        "activation_function": "relu", "scale_embedding": True, "tie_word_embeddings": True,
        "dropout": cfg.dropout, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "is_encoder_decoder": True,
        "pad_token_id": cfg.pad_id, "eos_token_id": cfg.eos_id, "bos_token_id": cfg.bos_id,
        "decoder_start_token_id": cfg.bos_id, "forced_eos_token_id": None, "forced_bos_token_id": None,
    }
    return arch, fields, out


def write_folder(model: Transformer, tokenizer: Tokenizer, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Weights in `dtype`; the position table (Pegasus) in float64."""
    transformers = _transformers()
    arch, fields, tensors = hf_state(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = transformers.PegasusConfig if arch == PEGASUS else transformers.M2M100Config
    config = config_cls(**{k: v for k, v in fields.items() if k != "model_type"})
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    transformers.GenerationConfig(
        decoder_start_token_id=model.cfg.bos_id, bos_token_id=model.cfg.bos_id, eos_token_id=model.cfg.eos_id,
        pad_token_id=model.cfg.pad_id, do_sample=False, num_beams=1).save_pretrained(out)
    tensors = {k: (v if k.endswith("embed_positions.weight") else v.to(dtype)).contiguous() for k, v in tensors.items()}
    (out / "model.safetensors").write_bytes(_safetensors_torch().save(tensors, metadata={"format": "pt"}))
    tokenizer.save(out / "tokenizer.json")
    specials = {}
    for name, i in (("pad_token", tokenizer.pad_id), ("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                    ("unk_token", tokenizer.unk_id), ("mask_token", tokenizer.mask_id)):
        if i is not None:
            specials[name] = tokenizer.tokens([i])[0]
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **specials}, indent=2) + "\n", encoding="utf-8")
    return out


def hf_from_pretrained(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Stock transformers' model for a folder (eval mode), as any user would load it."""
    transformers = _transformers()
    try:
        return transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype=dtype).eval()
    except Exception as e:
        raise HFError(f"transformers cannot load {folder}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


def hf_inputs(cfg: ModelConfig, src_ids: list[int], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, decoder_input_ids) for transformers: the forced tokens refdec's model inserts itself
    written out (source language, ids, eos; start token, target language)."""
    enc = torch.tensor([list(cfg.encoder_prefix) + list(src_ids) + [cfg.eos_id]], device=device)
    dec = torch.tensor([[cfg.bos_id] + list(cfg.decoder_prefix)], device=device)
    return enc, dec


@torch.inference_mode()
def hf_generate(hf_model, cfg: ModelConfig, src_ids: list[int], max_len: int, **extra) -> torch.Tensor:
    """transformers' generate, greedy (plus `extra`: assistant_model, prompt_lookup_num_tokens), on one
    source -> the output tokens as refdec's decoders return them (no start, forced or eos token)."""
    transformers = _transformers()
    enc, dec = hf_inputs(cfg, src_ids, hf_model.device)
    gen = transformers.GenerationConfig(
        max_new_tokens=max_len, do_sample=False, num_beams=1, decoder_start_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id)
    out = hf_model.generate(input_ids=enc, attention_mask=torch.ones_like(enc), decoder_input_ids=dec,
                            generation_config=gen, **extra)[0, dec.shape[1]:].tolist()
    if cfg.eos_id in out:
        out = out[:out.index(cfg.eos_id)]
    return torch.tensor(out, dtype=torch.long)


@torch.inference_mode()
def hf_logits(hf_model, cfg: ModelConfig, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) at the start token's position and after each of `tgt_ids`."""
    enc, dec = hf_inputs(cfg, src_ids, hf_model.device)
    dec = torch.cat([dec, torch.tensor([tgt_ids], dtype=torch.long, device=dec.device)], dim=1)
    logits = hf_model(input_ids=enc, attention_mask=torch.ones_like(enc), decoder_input_ids=dec).logits[0]
    return logits[len(cfg.decoder_prefix):]


@torch.inference_mode()
def refdec_logits(model: Transformer, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
    """refdec's logits (T, V), the same positions as hf_logits, through the KV cache."""
    cfg = model.cfg
    src = torch.tensor([list(src_ids) + [cfg.eos_id]])
    memory = model.encode(src)
    cache = model.new_cache(1, capacity=len(tgt_ids) + 1)
    return model.decode(torch.tensor([[cfg.bos_id] + list(tgt_ids)]), memory, cache)[0]


def check_export(model: Transformer, folder: Path, src_ids: list[int], max_len: int = 32) -> dict:
    """Load `folder` with transformers in float64 and compare it with refdec's model (in float64) on
    one source: the logits along refdec's greedy output, and the greedy output itself."""
    from .decoding import decode_greedy
    ref = Transformer(model.cfg)
    ref.load_state_dict(model.state_dict())
    ref.double().eval()
    hf = hf_from_pretrained(folder, torch.float64)
    ours = decode_greedy(ref, torch.tensor([list(src_ids) + [model.cfg.eos_id]]), max_len=max_len).tokens[0]
    diff = float((refdec_logits(ref, src_ids, ours.tolist()) - hf_logits(hf, model.cfg, src_ids, ours.tolist())).abs().max())
    theirs = hf_generate(hf, model.cfg, src_ids, max_len)
    if diff > LOGIT_TOLERANCE or not torch.equal(ours, theirs):
        raise HFError(f"the exported folder {folder} does not reproduce the model: logits differ by {diff:.3g}, "
                      f"greedy outputs {'agree' if torch.equal(ours, theirs) else 'differ'}")
    return {"max_logit_difference": diff, "greedy_tokens": len(ours)}


def export(ckpt: str | Path, out_dir: str | Path, probe: str = "A short sentence to check the export.") -> dict:
    """A refdec checkpoint -> a transformers folder, checked by loading it back with transformers."""
    model, tokenizer, _ = load_model(ckpt)
    folder = write_folder(model, tokenizer, out_dir)
    return {"folder": str(folder), "architecture": export_route(model.cfg), **check_export(model, folder, tokenizer.encode(probe))}


# -- audit ----------------------------------------------------------------------------------------
def _load_pair(path: str, *, task: str, src_lang, tgt_lang, workdir: Path, name: str):
    """(refdec model, tokenizer, transformers model) for a refdec checkpoint (exported to `workdir`
    and loaded from there with transformers) or a transformers folder, in float32."""
    if is_hf_folder(path):
        model, tok, _ = load_folder(path, src_lang=src_lang, tgt_lang=tgt_lang)
        return model, tok, hf_from_pretrained(path)
    model, tok, _ = load_model(path, task=task)
    return model, tok, hf_from_pretrained(write_folder(model, tok, workdir / name))


def audit(args) -> dict:
    from .data import DATA_DIR, read_lines

    torch.set_num_threads(args.threads)
    src_path = DATA_DIR / args.task / "test.src.gz"
    if not src_path.is_file():
        raise HFError(f"{src_path} not found (an unknown task, or data/build.py not run)")
    lines = [line for line in read_lines(src_path) if line.strip()][: args.limit]
    tmp = Path(tempfile.mkdtemp(prefix="refdec-hf-"))
    try:  # exported folders live while their transformers models do
        return _audit(args, lines, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _audit(args, lines: list[str], tmp: Path) -> dict:
    from . import exactness, inputs
    from .data import TASKS
    from .decoding import decode_iad, decode_speculative
    from .decoding.greedy import decode_greedy

    model, tok, hf = _load_pair(args.model, task=args.task, src_lang=args.src_lang, tgt_lang=args.tgt_lang,
                                workdir=tmp, name="model")
    small = hf_small = None
    if args.small:
        small, small_tok, hf_small = _load_pair(args.small, task=args.task, src_lang=args.src_lang,
                                                tgt_lang=args.tgt_lang, workdir=tmp, name="small")
        if small_tok.sha256 != tok.sha256 or small.cfg.encoder_prefix != model.cfg.encoder_prefix \
                or small.cfg.decoder_prefix != model.cfg.decoder_prefix:
            raise HFError(f"{args.small} does not share the vocabulary and forced tokens of {args.model}")
    cfg = model.cfg
    limit = cfg.max_positions - max(len(cfg.encoder_prefix), len(cfg.decoder_prefix))
    ids = inputs.source_ids(tok, lines, limit)

    def src_of(s):
        return torch.tensor([s + [cfg.eos_id]])
    methods = {"refdec-greedy": lambda s, n: decode_greedy(model, src_of(s), max_len=n).tokens[0]}
    if TASKS.get(args.task) == "gec":
        methods["refdec-iad"] = lambda s, n: decode_iad(model, src_of(s), max_len=n).tokens[0]
    if small is not None:
        methods["refdec-speculative"] = lambda s, n: decode_speculative(model, small, src_of(s), max_len=n,
                                                                 gamma=args.gamma).tokens[0]
    methods["hf-greedy"] = lambda s, n: hf_generate(hf, cfg, s, n)
    if hf_small is not None:
        methods["hf-assisted"] = lambda s, n: hf_generate(hf, cfg, s, n, assistant_model=hf_small)
    methods["hf-prompt-lookup"] = lambda s, n: hf_generate(hf, cfg, s, n, prompt_lookup_num_tokens=args.prompt_lookup)

    for s in ids[: args.warmup]:  # untimed: first-call allocations and kernel choices
        for run in methods.values():
            run(s, inputs.max_len_for([s], None, limit))
    outputs = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    errors = {name: [] for name in methods}  # a method that fails on a line (its output None) goes on with the next
    for i, s in enumerate(ids):  # interleaved: every method decodes a sentence before the next sentence
        budget = inputs.max_len_for([s], None, limit)
        for name, run in methods.items():
            t0 = time.perf_counter()
            try:
                outputs[name].append(run(s, budget))
            except Exception as e:
                if name == "refdec-greedy":
                    raise
                outputs[name].append(None)
                errors[name].append({"line": i + 1, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            seconds[name] += time.perf_counter() - t0
    greedy_out = outputs["refdec-greedy"]
    rows = []
    for name in methods:
        tokens = sum(len(o) + 1 for o in outputs[name] if o is not None)  # eos included, as refdec counts them
        same = sum(b is not None and torch.equal(a, b) for a, b in zip(greedy_out, outputs[name]))
        rows.append({"method": name, "seconds": seconds[name], "tokens": tokens,
                     "ms_per_token": 1000 * seconds[name] / max(tokens, 1), "identical": same / max(len(ids), 1),
                     "differing": [] if name == "refdec-greedy" else
                     exactness.divergences(model, ids, greedy_out, outputs[name], "cpu"), "errors": errors[name]})
    import transformers
    return {"task": args.task, "model": args.model, "small": args.small, "lines": len(ids), "warmup": args.warmup,
            "threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__,
            "gamma": args.gamma, "prompt_lookup_num_tokens": args.prompt_lookup, "methods": rows}


def audit_table(report: dict) -> str:
    head = f"{'method':<20} {'seconds':>9} {'ms/token':>9} {'tokens':>7} {'identical':>9}"
    out = [f"{report['task']}: {report['lines']} lines, {report['threads']} thread(s), warm-up {report['warmup']}", head]
    for r in report["methods"]:
        out.append(f"{r['method']:<20} {r['seconds']:>9.2f} {r['ms_per_token']:>9.2f} {r['tokens']:>7} "
                   f"{100 * r['identical']:>8.1f}%")
    for r in report["methods"]:
        for d in r["differing"]:
            out.append(f"{r['method']}: line {d['line']} differs from refdec greedy at position {d['position']} "
                       f"(refdec's top-1/top-2 margin there {d['margin_top1_top2']:.3g})")
        for d in r["errors"]:
            out.append(f"{r['method']}: line {d['line']} failed: {d['error']}")
    return "\n".join(out)


# -- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refdec.hf", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a transformers folder for a refdec checkpoint (and check it)")
    e.add_argument("ckpt", help="a refdec model.pt")
    e.add_argument("out_dir", help="the folder to write (created)")
    a = sub.add_parser("audit", help="refdec's and transformers' decoders on the same weights and inputs")
    a.add_argument("--task", required=True, help="its data/<task>/test.src.gz is decoded")
    a.add_argument("--model", required=True, help="a refdec model.pt or a transformers folder")
    a.add_argument("--small", help="a small model on the same vocabulary: speculative and assisted generation")
    a.add_argument("--limit", type=int, default=100, help="sentences decoded (default 100)")
    a.add_argument("--warmup", type=int, default=2, help="untimed warm-up sentences (default 2)")
    a.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    a.add_argument("--gamma", type=int, default=3, help="refdec speculative decoding's draft window (default 3)")
    a.add_argument("--prompt-lookup", type=int, default=10, metavar="N",
                   help="transformers' prompt_lookup_num_tokens (default 10)")
    a.add_argument("--src-lang", help="a transformers folder's source-language token (NLLB: eng_Latn)")
    a.add_argument("--tgt-lang", help="a transformers folder's target-language token (NLLB: deu_Latn)")
    a.add_argument("--report", help="write the figures as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            if Path(args.out_dir).exists() and any(Path(args.out_dir).iterdir()):
                raise HFError(f"{args.out_dir} exists and is not empty")
            result = export(args.ckpt, args.out_dir)
            print(f"wrote {result['folder']} ({result['architecture']}); transformers' float64 logits within "
                  f"{result['max_logit_difference']:.2g} of refdec's, the same greedy output")
            return 0
        for name in ("limit", "threads", "gamma", "prompt_lookup"):
            if getattr(args, name) < 1:
                raise HFError(f"--{name.replace('_', '-')} must be at least 1")
        if args.warmup < 0:
            raise HFError("--warmup must be at least 0")
        if not is_hf_folder(args.model) and (args.src_lang or args.tgt_lang):
            raise HFError("--src-lang and --tgt-lang choose the language tokens of a transformers folder's model")
        if args.report:
            from .inputs import check_writable
            check_writable(args.report, "--report")
        report = audit(args)
        print(audit_table(report))
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return 0
    except Exception as e:
        if os.environ.get("REFDEC_DEBUG"):
            raise
        from .errors import UsageError
        known = isinstance(e, (CheckpointError, UsageError))
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}" if known else f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2 if known else 1


if __name__ == "__main__":
    sys.exit(main())
