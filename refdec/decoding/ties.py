"""One tie rule for every decoder and every acceptance test: among equal maxima, the lowest token id.

Greedy decoding takes `argmax`, which returns the first (lowest) index of the maximum. Everything
that ranks tokens follows the same order, (logit descending, id ascending), so that its greedy or
lossless form picks exactly greedy's token when two logits are equal (a model whose output
projection has two equal rows ties at every position):

    rank(logits, tokens)            how many tokens come before each given token in that order:
                                    GAD++'s top-beta and blockwise's top-k accept rank < beta / k
    best_candidates(scores, n, by)  beam search's n best candidates, ordered by score, then by the
                                    logit they came from (two candidates of one beam whose scores
                                    round to the same value keep their logits' order, so beam(1)
                                    is greedy), then by index

`torch.topk` and `torch.sort` without stable=True promise no order among equal values.
"""

from __future__ import annotations

import torch


def rank(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits (N, V), tokens (N,) -> (N,) the place of each token in its row's order (0 = argmax):
    the tokens with a larger logit, plus those with an equal logit and a lower id."""
    token_logit = logits.gather(-1, tokens[:, None])  # (N, 1)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    before = logits.gt(token_logit) | (logits.eq(token_logit) & ids.lt(tokens[:, None]))
    return before.sum(dim=-1)


def best_candidates(scores: torch.Tensor, n: int, tiebreak: torch.Tensor | None = None) -> torch.Tensor:
    """scores (B, N) -> (B, n) indices of the n best per row, best first, in the order (score
    descending, tiebreak descending, index ascending). Only the candidates at least as good as the
    n-th best (ties included) are sorted."""
    nth = scores.topk(n, dim=-1).values[:, -1]  # (B,)
    rows = []
    for b in range(scores.shape[0]):
        idx = scores[b].ge(nth[b]).nonzero().squeeze(1)  # ascending index
        if tiebreak is not None:
            idx = idx[tiebreak[b, idx].sort(descending=True, stable=True).indices]
        idx = idx[scores[b, idx].sort(descending=True, stable=True).indices]
        rows.append(idx[:n])
    return torch.stack(rows)
