"""Generalized aggressive decoding (GAD, GAD++; Ge et al. 2022, section 3.2): a non-autoregressive
drafter proposes a block, the autoregressive verifier checks it in one call.

    repeat until eos or max_len:
        draft    o~_(j+1 .. j+k) = argmax of the drafter at k mask positions after o_<=j   (Eq. 1)
        verify   o^_(j+i) = argmax P_AR(. | o_<=j, o~_(j+1 .. j+i-1))                    (Eq. 7)
                 c = the first i with o~_(j+i) != o^_(j+i) (the bifurcation)
        accept   o_(j+1 .. j+c) = (o~_(j+1 .. j+c-1), o^_(j+c)); j <- j + c

Every accepted token is the verifier's argmax, so GAD's output is the verifier's greedy output.
GAD++ (Eq. 8-9) relaxes the test: a drafted token passes when it is among the verifier's top_beta
tokens and its log-probability is within tau of the top-1's. top_beta=1, tau=0 is GAD.

The drafter (refdec.drafter) runs in one of two layouts: the paper's bidirectional one recomputes
the whole prefix every iteration; the causal-prefix one keeps the prefix's keys and values in its
own cache and feeds only the newly accepted tokens plus the k masks. The verifier's cache is
truncated at the bifurcation by the shared verification step (refdec.decoding.verify).

A drafter without an encoder of its own (train.py --drafter-k --encoder-from, a SharedEncoder
over the verifier) reads the verifier's encoder states: the encoder runs once for both, and the
"drafter encoder" time below is then only its cross-attention keys and values.

Batches: every row still decoding drafts in one drafter call (refdec.drafter.draft_blocks: rows of
different lengths padded, each row's masks open within its own row) and is verified in one
verifier call (refdec.decoding.verify.verify_rows); each row accepts its own prefix, both caches
keep a length per row, and a row that reaches eos or max_len leaves the batch.

Stats: drafter and verifier calls, tokens per verifier call, and the time per part
(module_seconds: verifier encoder, drafter encoder, drafter decoder, verifier decoder; the caller's
total minus these is "other"), like the paper's table 15.
"""

from __future__ import annotations

import time

import torch

from ..drafter import LAYOUTS, draft_blocks
from ..model import Transformer
from .pairing import check_pair, encoder_passes, small_memory
from .result import DecodeResult, DecodeStats, result_of
from .ties import rank
from .verify import leave, verify_rows


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
def decode_gad(verifier: Transformer, drafter: Transformer, src: torch.Tensor, *, max_len: int, k: int, layout: str = "causal",
        top_beta: int = 1, tau: float = 0.0, exact: bool | None = None, trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row.

    exact: verify by argmax equality (GAD); default: when top_beta == 1 and tau == 0."""
    check_pair(verifier, drafter)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown drafter layout {layout!r}")
    if k < 1:
        raise ValueError("the block size k must be at least 1")
    accept = None if (exact if exact is not None else (top_beta == 1 and tau == 0)) else gadpp_rule(top_beta, tau)
    cfg = verifier.cfg
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=encoder_passes(verifier, drafter))
    secs = {"verifier encoder": 0.0, "drafter encoder": 0.0, "drafter decoder": 0.0, "verifier decoder": 0.0}
    t0 = time.perf_counter()
    mem_v = verifier.encode(src)
    t1 = time.perf_counter()
    mem_d = small_memory(verifier, drafter, mem_v, src)  # from the verifier's when it reads that encoder
    secs["verifier encoder"] += t1 - t0
    secs["drafter encoder"] += time.perf_counter() - t1
    cache_v = verifier.new_cache(B, capacity=max_len + 1)
    cache_d = drafter.new_cache(B, capacity=max_len + k + 1) if layout == "causal" else None
    outs: list[list[int]] = [[] for _ in range(B)]
    steps: list[list[dict]] | None = [[] for _ in range(B)] if trace else None
    alive = list(range(B)) if max_len > 0 else []  # source row of each batch row still decoding
    while alive:
        t0 = time.perf_counter()
        drafts = draft_blocks(drafter, mem_d, cache_d, [[cfg.bos_id] + outs[b] for b in alive], k, layout)
        t1 = time.perf_counter()
        verified = verify_rows(verifier, mem_v, cache_v, [outs[b][-1] if outs[b] else cfg.bos_id for b in alive],
                               drafts, budgets=[max_len - len(outs[b]) for b in alive], eos_id=cfg.eos_id,
                               accept=accept)
        secs["drafter decoder"] += t1 - t0
        secs["verifier decoder"] += time.perf_counter() - t1
        stats.drafter_calls += 1
        stats.verifier_calls += 1
        going = []
        for r, (b, v) in enumerate(zip(alive, verified)):
            outs[b] += v.tokens
            stats.accepted.append(len(v.tokens))
            if steps is not None:
                steps[b].append({"draft": drafts[r], "accepted": v.accepted, "tokens": v.tokens})
            if outs[b][-1] != cfg.eos_id and len(outs[b]) < max_len:
                going.append(r)
        mem_v, mem_d = leave(going, len(alive), [mem_v, mem_d], [cache_v] + ([cache_d] if cache_d is not None else []))
        alive = [alive[r] for r in going]
    stats.module_seconds = secs
    return result_of(outs, cfg.eos_id, stats, steps, src.device)
