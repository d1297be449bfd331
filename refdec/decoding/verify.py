"""The one verification step every draft-then-verify decoder shares (IAD, GAD, blockwise,
BiLD, speculative sampling).

The verifier's KV cache holds the committed output except its last token `last`. One decoder call
feeds `last` followed by the m drafted tokens d_1..d_m:

    input     last   d_1    d_2   ...  d_m
    predicts  p_0    p_1    p_2   ...  p_m        p_i = argmax P(. | output, d_1..d_i, x)

Draft token d_i is checked against p_{i-1}, the verifier's own choice at that position. With n the
length of the longest draft prefix that passes, the step commits

    d_1 .. d_n, p_n                               (Ge et al. 2022, Eq. 3-7: accept up to and including
                                                   the bifurcation, where the verifier's token is taken)

so every call commits at least one token, and exactly the tokens greedy decoding would produce as
long as "passes" means d_i == p_{i-1}. p_n is the token at the bifurcation, or, when the whole
draft passed, the verifier's next token for free. Positions after the bifurcation are cut from the
cache with `truncate`; they are never recomputed.

Lossy variants change only the test a drafted token must pass (GAD++'s top-beta / tau rule, BiLD's
rollback distance): `accept(logits, draft) -> bool mask` replaces equality. Samplers change how the
token at the bifurcation is drawn (BiLD's nucleus sampling, speculative sampling's residual
distribution): `choose(logits_row, n, rejected) -> token` replaces the argmax, where `rejected` says
whether draft token n was refused (False when the whole draft passed and the token is the free one).
With neither, the step is exactly greedy.

Two cuts keep the step equal to greedy at the boundaries: the committed tokens stop at the first
eos, and at `budget` tokens (what is left of max_len).

The whole exactness argument lives in `accept_row`, one row's acceptance: the first failing draft
position n, the committed d_1 .. d_n plus the verifier's p_n, and the two cuts. `verify_rows` runs
the decoder call for every row of a batch at once (drafts of different lengths padded, each row's
cache length moved by its own count: a ragged KVCache, whose attention never sees a row's rejected
tail) and applies `accept_row` to each row; `verify` is the same for one sentence. The loop around
it, rows leaving the batch as they finish, is refdec.decoding.rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..model import Memory, Transformer
from ..trace import Step
from .ties import argmax as first_max

AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ChooseRule = Callable[[torch.Tensor, int, bool], int]


def accept_row(
    draft: list[int],
    logits: torch.Tensor,
    argmax: list[int],
    *,
    budget: int,
    eos_id: int,
    accept: AcceptRule | None = None,
    choose: ChooseRule | None = None,
    draft_ids: torch.Tensor | None = None,
) -> tuple[list[int], int]:
    """One row's acceptance, the step above: (the committed tokens, n the number of drafted tokens
    that passed). logits (m + 1, V) and argmax (m + 1 ids, the lowest among equal maxima) are the
    verifier's at positions last, d_1 .. d_m; draft_ids: the draft as a tensor on their device."""
    if not draft:
        passed = []
    elif accept is None:
        passed = [d == p for d, p in zip(draft, argmax)]  # d_i passes when it is p_(i-1)
    else:
        ids = draft_ids if draft_ids is not None else torch.tensor(draft, device=logits.device)
        passed = accept(logits[: len(draft)], ids).tolist()
    n = next((i for i, good in enumerate(passed) if not good), len(passed))  # the bifurcation
    tokens = draft[:n] + [argmax[n] if choose is None else choose(logits[n], n, n < len(draft))]
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]  # nothing after the first eos
    return tokens[:budget], n  # nothing past max_len


def per_row(rule, b: int):
    """Row b's rule: `rule` itself when one rule serves every row, else rule[b] (a rule per row)."""
    return rule[b] if isinstance(rule, (list, tuple)) else rule


@dataclass
class Verified:
    """What one verification call decided.

    tokens:    the committed tokens: the accepted draft prefix, then the verifier's token (cut at
               eos and at the budget)
    accepted:  how many drafted tokens passed (n above, before the cuts)
    logits:    (m + 1, V) the verifier's logits at positions last, d_1 .. d_m
    hidden:    (m + 1, D) its final decoder states there (heads on top of the decoder, as in
               blockwise parallel decoding, read the row of the bifurcation)
    """

    tokens: list[int]
    accepted: int
    logits: torch.Tensor
    hidden: torch.Tensor


def verify(
    model: Transformer,
    memory: Memory,
    cache: KVCache,
    last: int,
    draft: list[int],
    *,
    budget: int,
    eos_id: int,
    accept: AcceptRule | None = None,
    choose: ChooseRule | None = None,
) -> Verified:
    """One decoder call over [last] + draft for a single sentence (batch row 0 of memory and cache):
    `verify_rows` with one row.

    On return the cache holds the committed output except its new last token (tokens[-1]), ready
    for the next call. `budget` >= 1 is the number of tokens the output may still grow by."""
    return verify_rows(
        model, memory, cache, [last], [draft], budgets=[budget], eos_id=eos_id, accept=accept, choose=choose
    )[0]


def verify_rows(
    model: Transformer,
    memory: Memory,
    cache: KVCache,
    lasts: list[int],
    drafts: list[list[int]],
    *,
    budgets: list[int],
    eos_id: int,
    accept: AcceptRule | list[AcceptRule] | None = None,
    choose: ChooseRule | list[ChooseRule] | None = None,
) -> list[Verified]:
    """The step above for every batch row of memory and cache in one decoder call: row b verifies
    [lasts[b]] + drafts[b] with budgets[b] tokens left, and gets its own Verified. `accept` and
    `choose` are one rule for every row or a list of one per row (speculative sampling's rules hold
    each row's drafting distributions).

    Drafts of different lengths are right-padded to the longest; a padded position comes after all
    of its row's fed ones, so causal attention keeps it out of them, and it is cut with the rest.
    Acceptance, the bifurcation token (the lowest id among equal maxima, as greedy's argmax) and
    the cuts are decided per row, and row b's cache is truncated to what row b committed: the
    cache is ragged afterwards whenever rows committed different numbers of tokens."""
    if any(b < 1 for b in budgets):
        raise ValueError("verify needs a budget of at least one token")
    drafts = [d[: b - 1] for d, b in zip(drafts, budgets)]  # drafted tokens past the budget could never be committed
    widths = [len(d) + 1 for d in drafts]
    width = max(widths)
    base = cache.lengths
    pad = model.cfg.pad_id
    inp = torch.tensor(
        [[t] + d + [pad] * (width - w) for t, d, w in zip(lasts, drafts, widths)],
        dtype=torch.long,
        device=memory.states.device,
    )  # (B, width)
    lengths = None if min(widths) == width else torch.tensor(widths, device=inp.device)  # (B,) fed positions per row
    hidden = model.decode_hidden(inp, memory, cache, real=lengths)  # (B, width, D)
    if lengths is None:
        logits = model.project(hidden)  # (B, width, V)
        argmax = first_max(logits).tolist()  # the lowest id among equal maxima, as greedy's
    else:  # only fed positions are projected (the projection is the widest product); rows split again
        flat = model.project(hidden[torch.arange(width, device=inp.device)[None, :] < lengths[:, None]][None])[0]
        logits = flat.split(widths)  # row b: (widths[b], V)
        ids = first_max(flat).tolist()  # one argmax for every row's positions, then split as the logits
        argmax = [ids[start : start + w] for start, w in zip(itertools.accumulate([0] + widths), widths)]
    out, keep = [], []
    for b, (draft, w) in enumerate(zip(drafts, widths)):
        tokens, n = accept_row(
            draft,
            logits[b],
            argmax[b],
            budget=budgets[b],
            eos_id=eos_id,
            accept=per_row(accept, b),
            choose=per_row(choose, b),
            draft_ids=inp[b, 1:w],
        )
        keep.append(int(base[b]) + len(tokens))  # last, d_1 .. d_(c-1): the committed output minus its new last token
        out.append(Verified(tokens, n, logits[b][:w], hidden[b, :w]))
    cache.truncate(keep[0] if len(keep) == 1 else keep)
    return out


def step_of(draft: list[int], v: Verified, drafted_by: str, **marks) -> Step:
    """The trace's Step of one row's verification of `draft`: the drafted tokens it committed (those
    that passed, up to the eos and budget cuts) and the verifier's own token after them, None when
    the step ended on a drafted eos. `marks`: the Step's other fields (origin, rollback)."""
    kept = min(v.accepted, len(v.tokens))
    own = v.tokens[kept] if len(v.tokens) > kept else None
    return Step(drafted=tuple(draft), accepted=kept, own=own, drafted_by=drafted_by if draft else "", **marks)
