"""Blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018, sections 3-5) with the combined
scoring and proposal model (section 4, figure 2): one model call per iteration. Section 3 lists
the three substeps unnumbered; the line numbers are this docstring's own, which the comments below
point at:

     1: y^ <- (), j <- 0
     2: repeat until the output ends (eos, max_len):
     3:     predict   y^_(j+i) = argmax p_i(. | y^_<=j, x),  i = 1 .. k      (proposal heads, refdec.proposal)
     4:     verify    the largest k^ with y^_(j+i) = argmax p_1(. | y^_<=j+i-1, x) for i <= k^
     5:     accept    extend the output by y^_(j+1) .. y^_(j+k^); j <- j + k^

Merged (section 4): the call that verifies the k - 1 proposed tokens also runs the heads at every
position, so the heads at the row where verification stopped already hold the next block's
proposals. Per iteration, one decoder call over [last] + proposals (refdec.decoding.verify, shared
with IAD, GAD and BiLD) commits the accepted proposals and p_1's own token after them, then the
heads at that row propose the next k - 1 tokens:

    call 1:  [bos]                 -> y_1 (p_1) and proposals for y_2 .. y_k (heads)
    call 2:  [y_1, y_2 .. y_k]     -> accepted prefix + p_1's token; proposals from that row
    ...

With every proposal right, an output of m tokens takes m/k + 1 calls instead of m.

Exact mode (block rule "exact") accepts a proposal only when it is p_1's argmax: the output is greedy
decoding of p_1, which with refdec's identity p_1 (refdec.proposal) is the base model's greedy
output. Approximate inference (section 5), each lossy:

    top-k      accept a proposal within p_1's top `top_k` tokens (5.1)
    distance   accept a proposal whose numeric value is within `epsilon` of p_1's argmax, for
               tokens that are numbers (`values[id]`, NaN for other tokens; others must match) (5.2)
    min_block  accept the first min_block - 1 proposals unconditionally, so every call adds at least
               min_block tokens (5.3); combines with either rule

Batches: every row still decoding is verified in the same call (Rows.verify:
refdec.decoding.verify.verify_rows), its proposals padded to the longest; each row accepts its own
prefix, its heads read its own row of the bifurcation, and a row that reaches eos or max_len leaves
the batch (refdec.decoding.rows).
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..proposal import ProposalHeads
from .result import DecodeResult, DecodeStats, check_eval
from .rows import Rows
from .ties import argmax, rank
from .verify import Verified

BLOCK_RULES = ("exact", "top-k", "distance")


def accept_rule(
    rule: str = "exact", *, top_k: int = 2, values: torch.Tensor | None = None, epsilon: float = 0.0, min_block: int = 1
):
    """The test a proposed token must pass against p_1's logits (None = exact: the argmax)."""
    if rule not in BLOCK_RULES:
        raise ValueError(f"unknown block rule {rule!r}; choose one of {', '.join(BLOCK_RULES)}")
    if rule == "top-k" and top_k < 1:
        raise ValueError("top-k selection needs top_k >= 1")
    if rule == "distance" and values is None:
        raise ValueError("distance-based selection needs the numeric value of every token")
    if min_block < 1:
        raise ValueError("min_block must be at least 1")
    if rule == "exact" and min_block == 1:
        return None

    def accept(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        best = argmax(logits)
        if rule == "top-k":
            ok = rank(logits, draft) < top_k  # refdec's tie rule: lowest id first among equal logits
        elif rule == "distance":
            v = values.to(logits.device)
            ok = best.eq(draft) | (v[draft] - v[best]).abs().le(epsilon)  # NaN (not a number) compares False
        else:
            ok = best.eq(draft)
        if min_block > 1:
            ok[: min_block - 1] = True
        return ok

    return accept


@torch.inference_mode()
def decode_blockwise(
    model: Transformer,
    heads: ProposalHeads,
    src: torch.Tensor,
    *,
    max_len: int,
    block_rule: str = "exact",
    top_k: int = 2,
    values: torch.Tensor | None = None,
    epsilon: float = 0.0,
    min_block: int = 1,
    block_size: int = 0,
    trace: bool = False,
) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row (greedy of p_1
    in exact mode). The block size k is heads.k, or block_size (2 .. heads.k): p_1 and the first
    block_size - 1 proposal heads, the others unused. block_rule: one of BLOCK_RULES (above)."""
    check_eval(model)
    check_eval(heads)
    k = block_size or heads.k
    if not 2 <= k <= heads.k:
        raise ValueError(f"the block size must be between 2 and the {heads.k} the heads were trained for, not {k}")
    accept = accept_rule(block_rule, top_k=top_k, values=values, epsilon=epsilon, min_block=min_block)
    cfg = model.cfg
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=1)
    rows = Rows(
        cfg,
        B,
        max_len,
        stats,
        trace,
        memories=[model.encode(src)],
        caches=[model.new_cache(B, capacity=max_len + k + 1)],
    )
    proposals: list[list[int]] = [[] for _ in rows.alive]  # per batch row; the first call proposes nothing
    while rows:  # line 2
        # Line 4, verify (section 3): the largest k^ with y^_(j+i) = argmax p_1(. | y^_<=j+i-1, x) for i <= k^,
        # all i in one call, which also gives p_1's own token after them.
        verified = rows.verify(model, proposals, accept=accept)
        # Line 5, accept: extend the output by the k^ verified tokens (p_1's own included); j <- j + k^.
        going = rows.commit(proposals, verified, drafted_by="heads")
        # Line 3, predict, merged into this call (section 4): y^_(j+i) = argmax p_i(. | y^_<=j, x), i = 2 .. k,
        # by the heads at the position that produced each row's last token.
        proposals = propose(model, heads, [verified[r] for r in going], k)
    return rows.result(src.device)


def propose(model: Transformer, heads: ProposalHeads, verified: list[Verified], k: int) -> list[list[int]]:
    """Each row's next proposals: heads 2 .. k at the final decoder state of the position where its
    verification stopped (the bifurcation, or the last drafted token when all passed)."""
    if not verified:
        return []
    states = torch.stack([v.hidden[v.accepted] for v in verified])  # (b, D)
    return argmax(model.project(heads(states[:, None])[:, 0, 1:k])).tolist()
