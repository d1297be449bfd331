"""A transformers model folder -> a refdec Transformer and its tokenizer.

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
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer, sinusoidal_positions
from ..tokenizer import Tokenizer
from .common import HFError, first_line, is_hf_folder, read_json, read_weights
from .layout import half_split, hf_names, permute_state

M2M100, PEGASUS = "M2M100ForConditionalGeneration", "PegasusForConditionalGeneration"
MODEL_TYPES = {"m2m_100": M2M100, "pegasus": PEGASUS}

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
        raise HFError(f"{folder}/config.json: {first_line(e, 200)}") from None


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
        raise HFError(f"cannot load tokenizer {path}: {first_line(e, 200)}") from None


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
        forced = read_json(gen).get("forced_bos_token_id")
    return enc, ((forced,) if forced is not None else ())


def load_folder(folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                src_lang: str | None = None, tgt_lang: str | None = None) -> tuple[Transformer, Tokenizer, dict]:
    """A transformers model folder -> (refdec model in eval mode, tokenizer, a checkpoint-like dict)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"model folder {folder} not found")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder} has no config.json (not a transformers model folder)")
    config = read_json(folder / "config.json")
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
        raise HFError(f"{folder}: weights do not fit config.json: {first_line(e, 200)}") from None
    model.to(device=device, dtype=dtype).eval()
    return model, tokenizer, {"format": "transformers", "task": None, "step": None, "architecture": arch,
                              "model_config": cfg.to_dict(), "meta": {"folder": str(folder)}}

