"""Forced encoder tokens (ModelConfig.encoder_prefix), placed before every source, and forced decoder
tokens (ModelConfig.decoder_prefix): the tokens an imported model expects after
its start token (an NLLB or M2M100 model's target language code), which the model inserts itself so
that no decoder sees them. They live in the KV cache's hidden prefix (refdec.cache): a decoder's
cache lengths and outputs start after them, while they still take positions of the model's table
(a drafter near max_positions counts them: refdec.drafter).
"""

from __future__ import annotations

import torch

from .cache import KVCache


def before_source(src: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """src (B, S) -> (B, P + S) with the P forced encoder tokens (ModelConfig.encoder_prefix, an NLLB
    model's source language code) before every source; src itself when there are none."""
    return torch.cat([src.new_tensor(prefix).expand(src.shape[0], -1), src], dim=1) if prefix else src


def after_start(tgt: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """tgt (B, T) beginning with the start token -> (B, T + P) with the P forced tokens after it."""
    forced = tgt.new_tensor(prefix).expand(tgt.shape[0], -1)
    return torch.cat([tgt[:, :1], forced, tgt[:, 1:]], dim=1)


def with_forced_prefix(prefix: tuple[int, ...], tgt_new: torch.Tensor, cache: KVCache,
                       open_from: int | torch.Tensor | None, real: torch.Tensor | None):
    """A decoder call's input with the model's forced decoder tokens `prefix` (P of them, an imported
    model's language code) where they belong -> (tgt_new, forced, open_from, real), `forced` the
    positions to hide in the cache after the call.

    An empty cache: the P tokens go after the start token (open_from and real shift by P); the start
    token and the first P - 1 of them become the cache's hidden prefix, and the last one's slot is
    visible position 0, whose state predicts the first output token. A row of a ragged cache cut back
    to length 0 keeps its hidden prefix, so the start token fed to it again goes into that slot: it
    is fed as the last forced token."""
    P = len(prefix)
    if P and not cache.ragged and cache.end == 0:
        cache.truncate(0)  # drops a hidden prefix left by rows that were all cut back to 0
        real = None if real is None else real + P
        open_from = None if open_from is None else open_from + P
        return after_start(tgt_new, prefix), P, open_from, real
    if P and cache.ragged and bool(cache.lengths.eq(0).any()):
        tgt_new = tgt_new.clone()
        tgt_new[cache.lengths.eq(0).to(tgt_new.device), 0] = prefix[-1]
    return tgt_new, 0, open_from, real
