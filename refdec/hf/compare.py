"""transformers' model, inputs, generate and logits beside refdec's, on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer
from .common import HFError, first_line, require_transformers


def hf_from_pretrained(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Stock transformers' model for a folder (eval mode), as any user would load it."""
    transformers = require_transformers()
    try:
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype=dtype).eval()
    except Exception as e:
        raise HFError(f"transformers cannot load {folder}: {type(e).__name__}: {first_line(e, 200)}") from None
    # refdec's decoders stop after max_len tokens without writing </s>; transformers' forced_eos_token_id
    # (BART's and Marian's configs set it) would make </s> the last of max_new_tokens: cleared, so that
    # both stop alike at the length limit and differ nowhere else
    model.generation_config.forced_eos_token_id = None
    return model


def hf_inputs(cfg: ModelConfig, src_ids: list[int], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, decoder_input_ids) for transformers: the forced tokens refdec's model inserts itself
    written out (source language, ids, eos; start token, target language)."""
    enc = torch.tensor([list(cfg.encoder_prefix) + list(src_ids) + [cfg.eos_id]], device=device)
    dec = torch.tensor([[cfg.bos_id] + list(cfg.decoder_prefix)], device=device)
    return enc, dec


@torch.inference_mode()
def hf_generate(hf_model, cfg: ModelConfig, src_ids: list[int], max_len: int, **generate_args) -> torch.Tensor:
    """transformers' generate, greedy (plus `generate_args`: assistant_model, prompt_lookup_num_tokens), on one
    source -> the output tokens as refdec's decoders return them (no start, forced or eos token)."""
    transformers = require_transformers()
    enc, dec = hf_inputs(cfg, src_ids, hf_model.device)
    gen = transformers.GenerationConfig(
        max_new_tokens=max_len,
        do_sample=False,
        num_beams=1,
        decoder_start_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id,
    )
    out = hf_model.generate(
        input_ids=enc,
        attention_mask=torch.ones_like(enc),
        decoder_input_ids=dec,
        generation_config=gen,
        **generate_args,
    )[0, dec.shape[1] :].tolist()
    if cfg.eos_id in out:
        out = out[: out.index(cfg.eos_id)]
    return torch.tensor(out, dtype=torch.long)


@torch.inference_mode()
def hf_logits(hf_model, cfg: ModelConfig, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) at the start token's position and after each of `tgt_ids`."""
    enc, dec = hf_inputs(cfg, src_ids, hf_model.device)
    dec = torch.cat([dec, torch.tensor([tgt_ids], dtype=torch.long, device=dec.device)], dim=1)
    logits = hf_model(input_ids=enc, attention_mask=torch.ones_like(enc), decoder_input_ids=dec).logits[0]
    return logits[len(cfg.decoder_prefix) :]


@torch.inference_mode()
def refdec_logits(model: Transformer, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
    """refdec's logits (T, V), the same positions as hf_logits, through the KV cache."""
    cfg = model.cfg
    src = torch.tensor([list(src_ids) + [cfg.eos_id]])
    memory = model.encode(src)
    cache = model.new_cache(1, capacity=len(tgt_ids) + 1)
    return model.decode(torch.tensor([[cfg.bos_id] + list(tgt_ids)]), memory, cache)[0]


def compare_with_folder(model: Transformer, folder: str | Path, sources: list[list[int]], max_len: int = 32) -> dict:
    """refdec's model (a float64 copy) beside transformers' model of `folder` (loaded in float64) on
    each of `sources`: the largest logit difference along refdec's greedy output, and whether
    transformers' greedy output is the same. Logits refdec holds at -inf (tokens the folder's
    generation_config.json forbids, which transformers forbids in generate, not in its forward pass) are
    left out of the difference. `said`: both in words."""
    from ..decoding import decode_greedy

    ref = Transformer(model.cfg)
    ref.load_state_dict(model.state_dict())
    ref.double().eval()
    hf = hf_from_pretrained(folder, torch.float64)
    diff, same, tokens = 0.0, True, 0
    for src_ids in sources:
        ours = decode_greedy(ref, torch.tensor([list(src_ids) + [model.cfg.eos_id]]), max_len=max_len).tokens[0]
        mine = refdec_logits(ref, src_ids, ours.tolist())
        theirs = hf_logits(hf, model.cfg, src_ids, ours.tolist())
        kept = ~torch.isneginf(mine)
        diff = max(diff, float((mine[kept] - theirs[kept]).abs().max()))
        same = same and torch.equal(ours, hf_generate(hf, model.cfg, src_ids, max_len))
        tokens += len(ours)
    said = f"logits differ by {diff:.3g}, greedy outputs {'agree' if same else 'differ'}"
    return {"max_logit_difference": diff, "same_greedy": same, "greedy_tokens": tokens, "said": said}
