"""Drawing tokens: argmax, or nucleus (top-p) sampling from a seeded generator (Holtzman et al. 2020)."""

from __future__ import annotations

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (V,) -> the smallest set of most likely tokens whose mass reaches top_p, renormalised
    (top_p = 1 keeps the distribution as it is)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True, stable=True)  # equal probabilities: lowest id first
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # a token is kept if the mass before it is below top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def distribution(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """logits (V,) -> the sampling distribution (float64 for exact ratios)."""
    return nucleus(torch.softmax(logits.double() / temperature, dim=-1), top_p)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))  # the generator lives on the CPU
