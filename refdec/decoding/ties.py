"""One tie rule for every decoder and every acceptance test: among equal maxima, the lowest token id.

Greedy decoding takes `argmax`, which returns the first (lowest) index of the maximum. Everything
that ranks tokens follows the same order, (logit descending, id ascending), so that its greedy or
lossless form picks exactly greedy's token when two logits are equal (a model whose output
projection has two equal rows ties at every position):

    argmax(logits)                  greedy's token: torch.argmax's result, on a CPU found in two
                                    passes that cost less on a verification call's many rows
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

BLOCK = 64  # argmax: the vocabulary read in blocks of this many ids
DIRECT = 1 << 16  # argmax: fewer logits than this take torch.argmax itself


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): the index of each row's maximum, the lowest among equal maxima (NaN counts
    as the largest, as in torch.argmax): torch.argmax's answer, bitwise, on every device.

    torch.argmax documents that rule: where several values are maximal it returns the index of the
    first, on every device (its CUDA kernel included); a NaN is the largest value. So one
    torch.argmax gives the tie rule everywhere, and it is what this returns off the CPU and for few
    logits. On a CPU with many logits (a batch verifying drafts: hundreds of rows of thousands of ids)
    the same index costs less in two passes (`two_passes`), which return the first maximum too."""
    if logits.device.type != "cpu" or logits.numel() < DIRECT or logits.shape[-1] // BLOCK < 2:
        return logits.argmax(dim=-1)
    return two_passes(logits)


def two_passes(logits: torch.Tensor) -> torch.Tensor:
    """argmax(logits) on a CPU, for rows of at least two blocks: torch.argmax reads a row one value
    at a time there, keeping an index beside the running maximum; a maximum alone (amax) is read many
    values at a time, several times faster. So each block of BLOCK ids gets its maximum first, the
    first block holding the row's maximum is found among V / BLOCK block maxima (torch.argmax: the
    first), and the argmax of that block alone gives the id (the first in it). A block before it holds
    no value equal to the maximum (else it would be the first block holding it), so the id is the
    row's first maximum: torch.argmax's. A NaN is the maximum of its block and of the block maxima,
    as in torch.argmax. Below DIRECT logits the passes cost more than they save."""
    V = logits.shape[-1]
    n = V // BLOCK
    rows = logits.reshape(-1, V)
    maxima = rows[:, : n * BLOCK].view(-1, n, BLOCK).amax(dim=-1)  # (N, n) each block's maximum
    if n * BLOCK < V:  # the last ids, fewer than a block
        maxima = torch.cat([maxima, rows[:, n * BLOCK :].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * BLOCK  # (N,) the first id of the first block holding the maximum
    # (N, BLOCK) the ids of that block; a short last block repeats its last id
    ids = (start[:, None] + torch.arange(BLOCK, device=logits.device)).clamp_max_(V - 1)
    return (start + rows.gather(1, ids).argmax(dim=-1)).view(logits.shape[:-1])


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
