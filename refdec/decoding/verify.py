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
rollback distance): `accept(logits, draft) -> bool mask` replaces equality; the committed token at
the bifurcation is always the verifier's argmax.

Two cuts keep the step equal to greedy at the boundaries: the committed tokens stop at the first
eos, and at `budget` tokens (what is left of max_len).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..cache import KVCache
from ..model import Memory, Transformer

AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
           budget: int, eos_id: int, accept: AcceptRule | None = None) -> Verified:
    """One decoder call over [last] + draft for a single sentence (batch row 0 of memory and cache).

    On return the cache holds the committed output except its new last token (tokens[-1]), ready
    for the next call. `budget` >= 1 is the number of tokens the output may still grow by."""
    if budget < 1:
        raise ValueError("verify needs a budget of at least one token")
    draft = draft[: budget - 1]  # drafted tokens past the budget could never be committed
    base = cache.length
    inp = torch.tensor([[last] + draft], dtype=torch.long, device=memory.states.device)
    hidden = model.decode_hidden(inp, memory, cache)  # (1, m + 1, D)
    logits = model.project(hidden)[0]  # (m + 1, V)
    pred = logits.argmax(dim=-1).tolist()  # pred[i] = p_i
    if draft:
        d = torch.tensor(draft, dtype=torch.long, device=logits.device)
        ok = (d.eq(logits[:-1].argmax(dim=-1)) if accept is None else accept(logits[:-1], d)).tolist()
    else:
        ok = []
    n = next((i for i, good in enumerate(ok) if not good), len(ok))
    tokens = draft[:n] + [pred[n]]
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    tokens = tokens[:budget]
    cache.truncate(base + len(tokens))  # keep last, d_1 .. d_(c-1): the committed output minus its new last token
    return Verified(tokens, n, logits, hidden[0])

