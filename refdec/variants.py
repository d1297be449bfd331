"""The layers by which the seq2seq families people deploy differ from the 2017 Transformer.

refdec.model builds the paper's Transformer; a ModelConfig field switches each of these in (the
config's comments say which family needs which, refdec.hf.importing sets them from a folder's
config.json). Each is written as transformers computes it, operation for operation, so that an
imported model's float64 logits equal transformers' to the last few bits:

    activation(name)        the feed-forward nonlinearity: relu, gelu, gelu_new (tanh form), silu
    GatedFeedForward        T5 v1.1's gated feed-forward network, w2(act(w1 x) * w3 x)
    make_norm(cfg)          LayerNorm (with its epsilon) or RMSNorm, T5LayerNorm: x / rms(x) x gain
    learned_positions(cfg)  BART's and mBART's learned position tables, one per side
    RelativePositionBias    T5's bucketed relative position bias, added to the attention scores
    embed_norms(cfg)        BART's and mBART's layernorm_embedding, one per side

The families' fixed position tables (Marian's, M2M100's) are in refdec.positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation as transformers' NewGELUActivation writes it (T5 v1.1's gated-gelu)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ModelConfig.activation names (refdec.config.ACTIVATIONS)."""
    return _ACTIVATIONS[name]


class GatedFeedForward(nn.Module):
    """T5 v1.1's feed-forward network (transformers' T5DenseGatedActDense): w2(act(w1 x) * w3 x), the
    paper's (refdec.model.FeedForward) with a gate w3 beside w1; the same parameter names, and w3."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, d_ff, bias = cfg.d_model, cfg.d_ff, cfg.bias
        self.w1, self.w2 = nn.Linear(D, d_ff, bias=bias), nn.Linear(d_ff, D, bias=bias)
        self.w3 = nn.Linear(D, d_ff, bias=bias)
        self.act, self.drop = activation(cfg.activation), nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(self.act(self.w1(x)) * self.w3(x)))


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
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact) * (buckets - exact)).to(
        torch.long
    )
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


def position_bias(
    bias: RelativePositionBias | None, offset: int | torch.Tensor, queries: int, keys: int
) -> torch.Tensor | None:
    """T5's bias (1 or B, H, queries, keys) for the queries at positions offset .. offset + queries - 1
    (offset one int, or (B,) one per row of a ragged cache), or None for a model without one."""
    if bias is None:
        return None
    at = torch.as_tensor(offset, device=bias.embedding.weight.device).reshape(-1, 1)
    return bias(at + torch.arange(queries, device=at.device), keys)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The layer normalisation cfg.norm names: LayerNorm (Ba et al. 2016) or T5's RMSNorm."""
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm == "layer" else RMSNorm(cfg.d_model, cfg.norm_eps)


def learned_positions(cfg: ModelConfig) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """(source, target) learned position tables, each (max_positions, D), for positions "learned"."""
    if cfg.positions != "learned":
        return None, None
    table = lambda: nn.Parameter(torch.zeros(cfg.max_positions, cfg.d_model))  # noqa: E731
    return (table() if cfg.enc_layers else None), table()


def relative_biases(cfg: ModelConfig) -> tuple[RelativePositionBias | None, RelativePositionBias | None]:
    """(encoder, decoder) relative position biases for positions "relative": the encoder's sees both
    directions, the decoder's only the past."""
    if cfg.positions != "relative":
        return None, None
    make = lambda both: RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, both)  # noqa: E731
    return (make(True) if cfg.enc_layers else None), make(False)


def embed_norms(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """(source, target) norms of embeddings + positions (cfg.embed_norm), else identities."""
    on = cfg.embed_norm
    return (make_norm(cfg) if on and cfg.enc_layers else nn.Identity()), (make_norm(cfg) if on else nn.Identity())
