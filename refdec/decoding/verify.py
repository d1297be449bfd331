"""The one verification step every draft-then-verify decoder shares (IAD, GAD, blockwise, BiLD).

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

Batched (`verify_rows`), each row of a batch runs this step on its own draft in the same decoder
call; rows accept different numbers of tokens, so each row's cache length moves by its own count
(a ragged KVCache, whose attention never sees a row's rejected tail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..cache import KVCache
from ..model import Memory, Transformer

AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ChooseRule = Callable[[torch.Tensor, int, bool], int]


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


def verify(model: Transformer, memory: Memory, cache: KVCache, last: int, draft: list[int], *,
           budget: int, eos_id: int, accept: AcceptRule | None = None,
           choose: ChooseRule | None = None) -> Verified:
    """One decoder call over [last] + draft for a single sentence (batch row 0 of memory and cache):
    `verify_rows` with one row.

    On return the cache holds the committed output except its new last token (tokens[-1]), ready
    for the next call. `budget` >= 1 is the number of tokens the output may still grow by."""
    return verify_rows(model, memory, cache, [last], [draft], budgets=[budget], eos_id=eos_id,
                       accept=accept, choose=choose)[0]


def verify_rows(model: Transformer, memory: Memory, cache: KVCache, lasts: list[int], drafts: list[list[int]], *,
                budgets: list[int], eos_id: int, accept: AcceptRule | None = None,
                choose: ChooseRule | None = None) -> list[Verified]:
    """The step above for every batch row of memory and cache in one decoder call: row b verifies
    [lasts[b]] + drafts[b] with budgets[b] tokens left, and gets its own Verified.

    Drafts of different lengths are right-padded to the longest; a padded position comes after all
    of its row's real ones, so causal attention keeps it out of them, and it is cut with the rest.
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
    inp = torch.tensor([[t] + d + [pad] * (width - w) for t, d, w in zip(lasts, drafts, widths)],
                       dtype=torch.long, device=memory.states.device)  # (B, width)
    real = None if min(widths) == width else torch.tensor(widths, device=inp.device)
    hidden = model.decode_hidden(inp, memory, cache, real=real)  # (B, width, D)
    logits = model.project(hidden, memory)  # (B, width, V); one row and one token: the fast projection
    agree = inp[:, 1:].eq(logits[:, :-1].argmax(dim=-1)).tolist() if accept is None else None  # (B, width - 1)
    out, keep = [], []
    for b, (draft, w) in enumerate(zip(drafts, widths)):
        m = w - 1
        if not draft:
            ok = []
        elif accept is None:
            ok = agree[b][:m]
        else:
            ok = accept(logits[b, :m], inp[b, 1:w]).tolist()
        n = next((i for i, good in enumerate(ok) if not good), len(ok))
        tokens = draft[:n] + [int(logits[b, n].argmax()) if choose is None else choose(logits[b, n], n, n < len(draft))]
        if eos_id in tokens:
            tokens = tokens[: tokens.index(eos_id) + 1]
        tokens = tokens[:budgets[b]]
        keep.append(int(base[b]) + len(tokens))  # last, d_1 .. d_(c-1): the committed output minus its new last token
        out.append(Verified(tokens, n, logits[b, :w], hidden[b, :w]))
    cache.truncate(keep[0] if len(keep) == 1 else keep)
    return out


def row_memories(memory: Memory, batch: int, device):
    """Each batch row's memory in turn (GAD, blockwise, BiLD and speculative decoding decode rows one by
    one; IAD verifies its rows together with verify_rows)."""
    for b in range(batch):
        yield memory if batch == 1 else memory.select(torch.tensor([b], device=device))


class Follower:
    """A drafting model's cache kept in step with the committed output (BiLD's small model,
    speculative sampling's drafter). It remembers the tokens its cache holds; `next_logits(sequence)`
    truncates the cache to the part of them that `sequence` (bos + output so far) still agrees with,
    feeds the rest in one decoder call and returns the next-token logits (V,). After a rollback
    only the positions past the first changed token are recomputed, never the whole prefix; when
    the cache already holds all of `sequence`, its last position is fed again (a cache keeps
    states, not logits)."""

    def __init__(self, model: Transformer, memory: Memory, capacity: int):
        self.model, self.memory = model, memory
        self.cache = model.new_cache(1, capacity=capacity)
        self.tokens: list[int] = []

    def next_logits(self, sequence: list[int]) -> torch.Tensor:
        keep = 0
        for a, b in zip(self.tokens, sequence[:-1]):  # at least the last token is fed
            if a != b:
                break
            keep += 1
        self.cache.truncate(keep)
        inp = torch.tensor([sequence[keep:]], dtype=torch.long, device=self.memory.states.device)
        self.tokens = list(sequence)
        return self.model.decode(inp, self.memory, self.cache)[0, -1]
