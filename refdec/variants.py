"""The layers by which the seq2seq families people deploy differ from the 2017 Transformer.

refdec.model builds the paper's Transformer; a ModelConfig field switches each of these in (the
config's comments say which family needs which, refdec.hf.importing sets them from a folder's
config.json). Each is written as transformers computes it, operation for operation, so that an
imported model's float64 logits equal transformers' to the last few bits:

    activation(name)        the feed-forward nonlinearity: relu, gelu, gelu_new (tanh form), silu
    RMSNorm                 T5LayerNorm: x / rms(x) x gain, no mean and no bias
    marian_positions        MarianSinusoidalPositionalEmbedding's table
    RelativePositionBias    T5's bucketed relative position bias, added to the attention scores
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation as transformers' NewGELUActivation writes it (T5 v1.1's gated-gelu)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_new": gelu_new, "silu": F.silu}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ModelConfig.activation names (refdec.config.ACTIVATIONS)."""
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Root mean square layer normalisation (Zhang and Sennrich 2019) as T5LayerNorm computes it: the
    mean square in float32 whatever the model's dtype (so a float64 model rounds it as its
    transformers twin does), no mean subtracted, a gain and no bias."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)  # (..., 1)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def marian_positions(n: int, d: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding's (n, d) table in float64: the paper's frequencies
    10000^(-2i/d) laid out [sin | cos], computed in numpy's float64 and rounded to float32, as
    transformers computes it (the values a float64 transformers model holds too)."""
    denom = np.array([np.power(10000, 2 * (j // 2) / d) for j in range(d)])  # (d,) one scalar power each
    position_enc = np.arange(n)[:, None] / denom[None, :]  # (n, d)
    out = torch.empty(n, d, dtype=torch.float32)
    sentinel = d // 2 if d % 2 == 0 else d // 2 + 1
    out[:, :sentinel] = torch.tensor(np.sin(position_enc[:, 0::2]), dtype=torch.float32)
    out[:, sentinel:] = torch.tensor(np.cos(position_enc[:, 1::2]), dtype=torch.float32)
    return out.double()


def relative_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key position - query position): exact buckets for
    small distances, logarithmic ones up to max_distance, the sign its own half when bidirectional
    (the encoder). Written as T5Attention._relative_position_bucket, float32 logarithm included."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out = out + (relative > 0).to(torch.long) * buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(relative < exact, relative, large)


class RelativePositionBias(nn.Module):
    """T5's relative position bias (Raffel et al. 2020, section 2.1): one learned scalar per head and
    bucket, added to every layer's self-attention scores (the first layer's table, shared by all)."""

    def __init__(self, n_heads: int, buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.embedding = nn.Embedding(buckets, n_heads)
        self.buckets, self.max_distance, self.bidirectional = buckets, max_distance, bidirectional

    def forward(self, query_positions: torch.Tensor, keys: int) -> torch.Tensor:
        """query_positions (R, q), R = 1 or B -> the bias (R, H, q, keys) of keys at positions 0 .. keys-1."""
        relative = torch.arange(keys, device=query_positions.device)[None, None, :] - query_positions[:, :, None]
        bucket = relative_bucket(relative, self.bidirectional, self.buckets, self.max_distance)  # (R, q, L)
        return self.embedding(bucket).permute(0, 3, 1, 2)
