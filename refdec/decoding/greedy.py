"""Greedy decoding with a KV cache: the baseline every lossless decoder must reproduce exactly. No
paper numbers it (Stern et al. 2018, section 2, give it in prose); the line numbers are this
docstring's own, which the comments below point at:

    1: memory = encode(x); y_0 = bos
    2: for t = 1 .. max_len:
    3:     y_t = argmax_v p(v | y_<t, x)      # one decoder call over one new token, cache appended
    4:     stop when every row has produced eos

Batched: rows never influence each other, and finished rows leave the batch (their cache rows and
memory rows with them), so a batch costs what its longest unfinished sentence costs. When they
leave, and how each row's tokens are kept, is GreedyRows' bookkeeping (rows.py).
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..trace import Step
from .result import DecodeResult, DecodeStats, check_eval, result_of
from .rows import GreedyRows
from .ties import argmax


@torch.inference_mode()
def decode_greedy(model: Transformer, src: torch.Tensor, *, max_len: int, trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> the argmax continuation of each row.

    max_len counts output tokens, eos included."""
    check_eval(model)
    cfg = model.cfg
    B = src.shape[0]
    cache = model.new_cache(B, capacity=max_len + 1)
    rows = GreedyRows(model.encode(src), cache, B, max_len, cfg.eos_id)
    stats = DecodeStats(sentences=B, encoder_calls=1)
    last = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=src.device)
    for _ in range(max_len):  # line 2
        logits = model.decode(last, rows.memory, cache)  # (b, 1, V); line 3
        stats.verifier_calls += 1
        next_tok = argmax(logits[:, -1])  # (b,) the lowest id among equal maxima (refdec.decoding.ties)
        if rows.write(next_tok):  # line 4: every row has written eos
            break
        last = rows.compact(next_tok)[:, None]
    outs = rows.outputs()
    stats.committed.extend([1] * sum(map(len, outs)))  # one token per call and row
    steps = [[Step(own=tok) for tok in out] for out in outs] if trace else None
    return result_of(outs, cfg.eos_id, stats, steps, src.device)
