"""Big Little Decoder (BiLD; Kim et al., NeurIPS 2023, "Speculative Decoding with Big Little
Decoder", section 3, Algorithm 1).

A small model decodes autoregressively while it is confident; the large model steps in only when
it is not, and then checks in one non-autoregressive call everything the small model wrote since
the large model's last call. The paper's Algorithm 1, numbered as the paper numbers it:

     1: y <- []
     2: while y[-1] != eos:
     3:     p_S <- small(y)
     4:     if max p_S[-1] >= fallback_threshold (and the small model wrote fewer than max_window
            tokens since the large model's last call):
     5:         # use the small model's prediction
     6:         y <- y + [sample(p_S[-1])]
     7:     else:
     8:         # fall back to the large model
     9:         p_L <- large(y)          one call over every token since the large model's last call
    10:         m <- the first small-model token with d(p_L[m], p_S[m]) > rollback_threshold
    11:         if m exists:
    12:             # roll back: use the large model's prediction
    13:             y <- y[:m] + [sample(p_L[m])]
    14:         else:
    15:             # no rollback: use the large model's prediction
    16:             y <- y + [sample(p_L[-1])]
    17: return y

Line 4 is section 3.3's fallback policy, which falls back when max p_S < fallback_threshold (the
algorithm's line 4 writes max p_S > the threshold for the small model's turn; the two differ only
at equality); max_window, a cap on the small model's run, is refdec's (the paper's run ends only on
the threshold).

d is the paper's distance: the cross-entropy of the small model's (hard) token under the large
model's distribution, -log p_L(y_m). Sampling is argmax by default, nucleus (top-p) sampling from
a seeded generator with sample=True.

That large-model call is refdec's shared verification step (refdec.decoding.verify): its draft is
the small model's tokens, its acceptance test is d <= rollback_threshold, and the token it commits
at the first failure, or after the last token when none fails, is the large model's. Both caches
are truncated to what stayed valid, never recomputed: the large model's by the verification step,
the small model's by its Follower (refdec.decoding.pairing), which cuts back to the first changed
token and catches up with the rest in one call.

As in the paper's Algorithm 1, an eos written by the small model ends the sentence without a
large-model check. With a fallback threshold above 1 the small model never writes a token, every
iteration is one large-model step, and BiLD is greedy decoding of the large model exactly.

Batches: each row follows the algorithm above on its own; the rows are only synchronised at the
large model. The small model writes for every row in the same calls until each row either falls
back (its run waits: nothing more is written for it) or finishes on the small model's eos or at
max_len (it leaves the batch); then one large-model call (verify_rows) checks every waiting row's
run, each row with its own rollback. A row therefore decides exactly what it decides alone; what
the batch adds is the waiting, in which a row that fell back early idles while the others write
(small-model calls that are fed for it and discarded). Sampling draws from the one seeded
generator, rows in turn.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..trace import Step
from .pairing import Follower, check_pair, encoder_passes, small_memory
from .result import DecodeResult, DecodeStats
from .rows import Rows
from .sampling import distribution, draw


def rollback_rule(threshold: float):
    """accept(logits, draft): keep a small-model token while -log p_L(token) <= threshold."""

    def accept(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        nll = -torch.log_softmax(logits.double(), dim=-1).gather(-1, draft[:, None])[:, 0]
        return nll.le(threshold)

    return accept


@torch.inference_mode()
def decode_bild(
    large: Transformer,
    small: Transformer,
    src: torch.Tensor,
    *,
    max_len: int,
    fallback_threshold: float = 0.4,
    rollback_threshold: float = 2.0,
    max_window: int = 10,
    sample: bool = False,
    top_p: float = 0.9,
    seed: int = 0,
    trace: bool = False,
) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row."""
    check_pair(large, small)
    if max_window < 1:
        raise ValueError("max_window must be at least 1")
    cfg = large.cfg
    gen = torch.Generator().manual_seed(seed)
    next_token = (
        (lambda logits: draw(distribution(logits, top_p=top_p), gen))
        if sample
        else (lambda logits: int(logits.argmax()))
    )
    accept = rollback_rule(rollback_threshold)
    choose = (lambda row, n, rejected: next_token(row)) if sample else None
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=encoder_passes(large, small))
    mem_l = large.encode(src)
    follower = Follower(small, small_memory(large, small, mem_l, src), capacity=max_len + 1)
    rows = Rows(
        cfg, B, max_len, stats, trace, memories=[mem_l], caches=[large.new_cache(B, capacity=max_len + 1), follower]
    )
    while rows:  # Algorithm 1, line 2: while y[-1] != eos
        # Lines 3-6: the small model writes while it is confident (each row until it falls back or ends).
        runs = small_run(follower, rows, next_token, fallback_threshold=fallback_threshold, max_window=max_window)
        runs = end_unchecked(rows, runs)  # rows the small model ended leave, as in the paper, unchecked
        if not rows:
            break
        # The runs become the large model's draft: each output goes back to where its large-model call starts.
        for out, run in zip(rows.outputs(), runs):
            del out[len(out) - len(run) :]
        # Lines 8-10: fall back; one large-model call over every token since its last call finds m,
        # the first small-model token with d(p_L[m], p_S[m]) > rollback_threshold.
        verified = rows.verify(large, runs, accept=accept, choose=choose)
        stats.fallbacks += len(rows)
        rolled = [v.accepted < len(run) for v, run in zip(verified, runs)]
        stats.rollbacks += sum(rolled)
        # Lines 11-16: y <- y[:m] + [sample(p_L[m])] (rollback), else y + [sample(p_L[-1])].
        rows.commit(runs, verified, drafted_by="small", rollback=rolled)
    return rows.result(src.device)


def end_unchecked(rows: Rows, runs: list[list[int]]) -> list[list[int]]:
    """Rows whose run ended the sentence (the small model's eos, or max_len) leave the batch without
    a large-model check, traced as unverified; returns the runs of the rows that wait for one."""
    waiting = []
    for r, (out, run) in enumerate(zip(rows.outputs(), runs)):
        if rows.done(out):
            rows.record(r, Step(drafted=tuple(run), accepted=len(run), drafted_by="small", verified=False))
        else:
            waiting.append(r)
    rows.keep(waiting)
    return [runs[r] for r in waiting]


def small_run(
    follower: Follower, rows: Rows, next_token, *, fallback_threshold: float, max_window: int
) -> list[list[int]]:
    """Algorithm 1, lines 3-6, for every batch row in the same small-model calls: the small model
    appends its token to a row's output while its max probability is at least fallback_threshold
    and it wrote fewer than max_window tokens in this run, and the row has not finished (eos or
    max_len). Returns each batch row's run: the tokens the small model appended."""
    outs = rows.outputs()
    runs: list[list[int]] = [[] for _ in outs]  # each row's small-model tokens since the large model's last call
    writing = list(range(len(rows)))  # rows the small model still writes for; the others fell back or finished
    while writing:
        logits_s = follower.next_logits(rows.prefixes())  # line 3: p_S <- small(y)
        rows.stats.drafter_calls += 1
        confident = (torch.softmax(logits_s.double(), dim=-1).max(dim=-1).values >= fallback_threshold).tolist()
        still = []
        for r in writing:
            if not (confident[r] and len(runs[r]) < max_window):  # line 4 fails: falls back, waits for the large model
                continue
            tok = next_token(logits_s[r])  # line 6: y <- y + [sample(p_S[-1])]
            outs[r].append(tok)
            runs[r].append(tok)
            if not rows.done(outs[r]):
                still.append(r)
        writing = still
    return runs
