"""Greedy decoding with a KV cache: the baseline every lossless decoder must reproduce exactly.

    memory = encode(x); y_0 = bos
    for t = 1 .. max_len:
        y_t = argmax_v p(v | y_<t, x)      # one decoder call over one new token, cache appended
        stop when every row has produced eos

Batched: rows never influence each other, and finished rows are dropped from the batch (their cache
rows and memory rows with them), so a batch costs what its longest unfinished sentence costs. Dropping
copies every remaining row of the cache and the memory, so it waits until a quarter of the batch has
finished (COMPACT): until then a finished row is carried along, its tokens computed and ignored,
which costs less than a copy of the whole cache each time one row finishes. Each step writes every
row's token into one (B, max_len) tensor with one indexed write; the rows' outputs are read from it
once, at the end, cut at their first eos.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..trace import Step
from .result import DecodeResult, DecodeStats, check_eval, result_of

COMPACT = 4  # finished rows leave the batch once they are at least 1/COMPACT of it


@torch.inference_mode()
def decode_greedy(model: Transformer, src: torch.Tensor, *, max_len: int, trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> the argmax continuation of each row.

    max_len counts output tokens, eos included."""
    check_eval(model)
    cfg = model.cfg
    B = src.shape[0]
    memory = model.encode(src)
    cache = model.new_cache(B, capacity=max_len + 1)
    stats = DecodeStats(sentences=B, encoder_calls=1)
    written = torch.full((B, max_len), cfg.eos_id, dtype=torch.long, device=src.device)  # y_1 .. per source row
    alive = torch.arange(B, device=src.device)  # original row index of each row in the batch
    carried = torch.zeros(B, dtype=torch.bool, device=src.device)  # rows in the batch that have finished
    last = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=src.device)
    for t in range(max_len):
        logits = model.decode(last, memory, cache)  # (b, 1, V)
        stats.verifier_calls += 1  # = t + 1
        next_tok = logits[:, -1].argmax(dim=-1)  # (b,)
        written[alive, t] = next_tok  # a carried row writes after its eos: cut below
        carried |= next_tok.eq(cfg.eos_id)
        if carried.all():
            break
        if int(carried.sum()) * COMPACT >= len(carried):  # drop finished rows: memory and cache keep the others
            keep = (~carried).nonzero().squeeze(1)
            alive, memory, carried = alive[keep], memory.select(keep), carried[keep]
            cache.select(keep)
            next_tok = next_tok[keep]
        last = next_tok[:, None]
    outs = [cut_at_eos(row, cfg.eos_id) for row in written[:, :stats.verifier_calls].tolist()]  # the steps run
    stats.committed.extend([1] * sum(map(len, outs)))  # one token per call and row
    steps = [[Step(own=tok) for tok in out] for out in outs] if trace else None
    return result_of(outs, cfg.eos_id, stats, steps, src.device)


def cut_at_eos(row: list[int], eos_id: int) -> list[int]:
    """A row's tokens up to and including its first eos (all of them without one: it reached max_len)."""
    return row[:row.index(eos_id) + 1] if eos_id in row else row
