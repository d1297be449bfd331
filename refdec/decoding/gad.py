"""Generalized aggressive decoding (GAD, GAD++; Ge et al. 2022, section 3.2): a non-autoregressive
drafter proposes a block, the autoregressive verifier checks it in one call. Section 3.2 gives the
iteration in prose (its Draft and Verify), not as a numbered algorithm; the line numbers are this
docstring's own, which the comments below point at:

     1: repeat until eos or max_len:
     2:     draft    o~_(j+1 .. j+k) = argmax of the drafter at k mask positions after o_<=j
                     (section 3.2's draft equation, unnumbered)
     3:     verify   o^_(j+i) = argmax P_AR(. | o_<=j, o~_(j+1 .. j+i-1))                    (Eq. 7)
     4:              c = the first i with o~_(j+i) != o^_(j+i) (the bifurcation)
     5:     accept   o_(j+1 .. j+c) = (o~_(j+1 .. j+c-1), o^_(j+c)); j <- j + c

Every accepted token is the verifier's argmax, so GAD's output is the verifier's greedy output.
GAD++ (Eq. 8-9) relaxes line 4's test: a drafted token passes when it is among the verifier's top_beta
tokens and its log-probability is within tau of the top-1's. top_beta=1, tau=0 is GAD.

The drafter (refdec.drafter.Drafter: the model, the k it was trained for and its layout, as its
checkpoint records them) runs in one of two layouts: the paper's bidirectional one recomputes
the whole prefix every iteration; the causal-prefix one keeps the prefix's keys and values in its
own cache and feeds only the newly accepted tokens plus the k masks. The verifier's cache is
truncated at the bifurcation by the shared verification step (refdec.decoding.verify).

A drafter without an encoder of its own (train.py --drafter-k --encoder-from, a SharedEncoder
over the verifier) reads the verifier's encoder states: the encoder runs once for both, and the
"drafter encoder" time below is then only its cross-attention keys and values.

Batches: every row still decoding drafts in one drafter call (refdec.drafter.draft_blocks: rows of
different lengths padded, each row's masks open within its own row) and is verified in one
verifier call (Rows.verify: refdec.decoding.verify.verify_rows); each row accepts its own prefix,
both caches keep a length per row, and a row that reaches eos or max_len leaves the batch
(refdec.decoding.rows).

Stats: drafter and verifier calls, tokens per verifier call, and the time per part (PARTS:
verifier encoder, drafter encoder, drafter decoder, verifier decoder; the caller's total minus
these is "other"), like the paper's table 15, measured by a timing hook (`times`) around each part.
"""

from __future__ import annotations

import torch

from ..drafter import Drafter, draft_blocks
from ..model import Transformer
from .pairing import check_pair, encoder_passes, small_memory
from .result import DecodeResult, DecodeStats, PartTimes
from .rows import Rows
from .ties import rank

# The parts GAD's time is reported in, as the paper's table 15 (the caller's total minus these is "other").
PARTS = ("verifier encoder", "drafter encoder", "drafter decoder", "verifier decoder")


def gadpp_rule(top_beta: int = 1, tau: float = 0.0):
    """Eq. 8-9: accept d if d is in the verifier's top_beta and log P(d) >= log P(top-1) - tau. The
    top beta are ranked by refdec's tie rule (refdec.decoding.ties) on the logits themselves, so at
    top_beta 1 and tau 0 a token passes exactly when it is greedy's argmax, ties included."""
    if top_beta < 1 or tau < 0:
        raise ValueError("top_beta must be at least 1 and tau at least 0")

    def accept(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.double(), dim=-1)
        in_top = rank(logits, draft) < top_beta
        close = logp.gather(-1, draft[:, None])[:, 0] >= logp.max(dim=-1).values - tau
        return in_top & close

    return accept


@torch.inference_mode()
def decode_gad(
    verifier: Transformer,
    drafter: Drafter,
    src: torch.Tensor,
    *,
    max_len: int,
    block_size: int = 0,
    top_beta: int = 1,
    tau: float = 0.0,
    trace: bool = False,
    times: PartTimes | None = None,
) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row.

    block_size: tokens drafted per iteration, the paper's k (0 = the k the drafter was trained for).
    top_beta 1 and tau 0 (the default) verify by argmax equality: GAD, the verifier's greedy output;
    anything else is GAD++'s relaxed test. times: the timing hook called around each of the PARTS
    (`with times(part): ...`; a new PartTimes by default); its seconds become stats.module_seconds."""
    check_pair(verifier, drafter.model)
    k = block_size or drafter.k
    if k < 1:
        raise ValueError(f"the block size must be at least 1 (0: the drafter's {drafter.k}), not {block_size}")
    accept = None if top_beta == 1 and tau == 0 else gadpp_rule(top_beta, tau)
    times = PartTimes(*PARTS) if times is None else times
    cfg = verifier.cfg
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=encoder_passes(verifier, drafter.model))
    with times("verifier encoder"):
        mem_v = verifier.encode(src)
    with times("drafter encoder"):
        mem_d = small_memory(verifier, drafter.model, mem_v, src)  # from the verifier's when it reads that encoder
    cache_d = drafter.model.new_cache(B, capacity=max_len + k + 1) if drafter.layout == "causal" else None
    rows = Rows(
        cfg,
        B,
        max_len,
        stats,
        trace,
        memories=[mem_v, mem_d],
        caches=[verifier.new_cache(B, capacity=max_len + 1), cache_d],
    )
    while rows:  # line 1: until eos or max_len
        mem_d = rows.memories[1]  # the verifier's memory is rows.memory
        # Line 2, draft: o~_(j+1 .. j+k), the drafter's argmax at k masks after o_<=j (section 3.2).
        with times("drafter decoder"):
            drafts = draft_blocks(drafter.model, mem_d, cache_d, rows.prefixes(), k, drafter.layout)
        # Lines 3-4, verify: o^_(j+i) given o_<=j and o~_(j+1 .. j+i-1), all i in one call (Eq. 7; GAD++: Eq. 8-9);
        # the bifurcation c is the first i where the draft fails.
        with times("verifier decoder"):
            verified = rows.verify(verifier, drafts, accept=accept)
        stats.drafter_calls += 1
        # Line 5, accept: o_(j+1 .. j+c) = (o~_(j+1 .. j+c-1), o^_(j+c)). Finished rows leave the batch.
        rows.commit(drafts, verified, drafted_by="drafter")
    stats.module_seconds = dict(times.seconds)
    return rows.result(src.device)
