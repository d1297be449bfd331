"""Greedy decoding with a KV cache: the baseline every lossless decoder must reproduce exactly.

    memory = encode(x); y_0 = bos
    for t = 1 .. max_len:
        y_t = argmax_v p(v | y_<t, x)      # one decoder call over one new token, cache appended
        stop when every row has produced eos

Batched: finished rows are dropped from the batch (their cache rows and memory rows with them), so
a batch costs what its longest unfinished sentence costs, and rows never influence each other.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..trace import Step
from .result import DecodeResult, DecodeStats, check_eval, result_of


@torch.inference_mode()
def decode_greedy(model: Transformer, src: torch.Tensor, *, max_len: int, trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> the argmax continuation of each row.

    max_len counts output tokens, eos included."""
    check_eval(model)
    cfg = model.cfg
    B = src.shape[0]
    memory = model.encode(src)
    cache = model.new_cache(B, capacity=max_len + 1)
    outs: list[list[int]] = [[] for _ in range(B)]
    steps: list[list[Step]] | None = [[] for _ in range(B)] if trace else None
    stats = DecodeStats(sentences=B, encoder_calls=1)
    alive = torch.arange(B, device=src.device)  # original row index of each row still decoding
    last = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=src.device)
    for _ in range(max_len):
        logits = model.decode(last, memory, cache)  # (b, 1, V)
        stats.verifier_calls += 1
        next_tok = logits[:, -1].argmax(dim=-1)  # (b,)
        finished = next_tok.eq(cfg.eos_id)
        for row, tok in zip(alive.tolist(), next_tok.tolist()):
            outs[row].append(tok)
            stats.committed.append(1)
            if steps is not None:
                steps[row].append(Step(own=tok))
        if finished.all():
            break
        if finished.any():  # drop finished rows: memory and cache keep only the rows still decoding
            keep = (~finished).nonzero().squeeze(1)
            alive, memory = alive[keep], memory.select(keep)
            cache.select(keep)
            next_tok = next_tok[keep]
        last = next_tok[:, None]
    return result_of(outs, cfg.eos_id, stats, steps, src.device)

