"""How far a decoder's outputs are from greedy decoding's: the identical rate, and for each line that
differs the first divergent position with the model's top-1/top-2 margin there (a near-tie between
two kernels' roundings, or a decoding error).
"""

from __future__ import annotations

from dataclasses import is_dataclass, replace

import torch

from .. import data as data_mod


def identical_rate(a: list, b: list) -> float:
    """The fraction of lines whose outputs are token-for-token equal (lines either side failed left out)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(torch.equal(x, y) for x, y in pairs) / len(pairs) if pairs else 1.0


def same_model(a, b) -> bool:
    """Whether two runs' models are one model: the same object, or two objects of the same kind on the
    same kernels with the same shape (dropout aside) and equal parameters. Two loads of one set of
    weights are one model: proposal heads stored alone on a frozen base (decode.py --compare
    blockwise@HEADS) decode with the weights of the base's own file, which greedy reads from that file."""
    if a is b:
        return True
    if type(a) is not type(b) or not hasattr(a, "parameters"):
        return False
    if getattr(a, "kernels", None) != getattr(b, "kernels", None):  # a route's kernels (int8, row-invariant ...)
        return False
    shape = [replace(m.cfg, dropout=0.0) if is_dataclass(m.cfg) else m.cfg for m in (a, b)]
    if shape[0] != shape[1]:
        return False
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y) for x, y in zip(pa, pb)
    )


@torch.inference_mode()
def divergences(model, ids: list[list[int] | None], greedy_out: list, other_out: list, device) -> list[dict]:
    """Every line where `other_out` differs from `greedy_out` (greedy decoding of `model`): the first
    divergent position, the two tokens there, and the model's top-1 minus top-2 logit at that position,
    recomputed the way greedy computes it (one token per call over the greedy prefix). A margin near
    zero is a numerical near-tie between two kernels' roundings, not a decoding error."""
    eos = model.cfg.eos_id
    out = []
    for i, (src, g, o) in enumerate(zip(ids, greedy_out, other_out)):
        if src is None or g is None or o is None or torch.equal(g, o):
            continue
        g_l, o_l = g.tolist() + [eos], o.tolist() + [eos]
        pos = next(p for p in range(min(len(g_l), len(o_l))) if g_l[p] != o_l[p])
        memory = model.encode(data_mod.source_tensor([src], eos, model.cfg.pad_id).to(device))
        cache = model.new_cache(1, capacity=pos + 2)
        prefix = [model.cfg.bos_id] + g_l[:pos]
        for t in prefix:
            logits = model.decode(torch.tensor([[t]], device=device), memory, cache)[0, -1]
        top = logits.float().topk(2)
        out.append(
            {
                "line": i + 1,
                "position": pos,
                "greedy_token": g_l[pos],
                "other_token": o_l[pos],
                "margin_top1_top2": float(top.values[0] - top.values[1]),
                "gap_greedy_vs_other": float(logits[g_l[pos]] - logits[o_l[pos]]),
            }
        )
    return out
