"""Forced encoder tokens (ModelConfig.encoder_prefix), placed before every source, and forced decoder
tokens (ModelConfig.decoder_prefix): the tokens an imported model expects after
its start token (an NLLB or M2M100 model's target language code), which the model inserts itself so
that no decoder sees them. They live in the KV cache's hidden prefix (refdec.cache): a decoder's
cache lengths and outputs start after them, while they still take positions of the model's table
(a drafter near max_positions counts them: refdec.drafter). A decoder call puts them in through the
cache (refdec.cache.KVCache.place, forced_tokens).
"""

from __future__ import annotations

import torch


def before_source(src: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """src (B, S) -> (B, P + S) with the P forced encoder tokens (ModelConfig.encoder_prefix, an NLLB
    model's source language code) before every source; src itself when there are none."""
    return torch.cat([src.new_tensor(prefix).expand(src.shape[0], -1), src], dim=1) if prefix else src


def after_start(tgt: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """tgt (B, T) beginning with the start token -> (B, T + P) with the P forced tokens after it."""
    forced = tgt.new_tensor(prefix).expand(tgt.shape[0], -1)
    return torch.cat([tgt[:, :1], forced, tgt[:, 1:]], dim=1)
