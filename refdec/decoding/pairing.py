"""Pairing a companion model with the verifier: BiLD's small model, speculative decoding's drafter and
GAD's block drafter all run beside the model whose output is produced, and share this module.

- `check_pair`: the companion model must speak the verifier's vocabulary and be in eval mode.
- `shares_encoder`, `encoder_passes`, `small_memory`: a companion model that reads the verifier's
  encoder (an early exit, `refdec.adapters.EarlyExit`; a decoder on a frozen encoder,
  `refdec.adapters.SharedEncoder`) takes its memory from the verifier's encoder pass, so the encoder
  runs once per batch for both; any other model encodes the source itself.
- `Follower`: the companion model's KV cache kept in step with what the verifier committed, cut back
  to the first changed token after a rollback or a rejected draft.

`Companion` names what a decoder asks of a companion model; a Transformer, an EarlyExit and a
SharedEncoder all provide it (refdec.adapters).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..cache import KVCache
from ..config import ModelConfig
from ..model import Memory, Transformer
from .result import check_eval


class Companion(Protocol):
    """What a decoder asks of a drafting or small model. An adapter that reads the verifier's encoder
    also has `base` (the verifier) and `memory_from(verifier_memory)`."""

    cfg: ModelConfig
    training: bool

    def encode(self, src: torch.Tensor) -> Memory: ...

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache: ...

    def decode_hidden(
        self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache, open_from=None, real: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def project(self, hidden: torch.Tensor) -> torch.Tensor: ...


def check_pair(large: Transformer, small: Companion) -> None:
    if large.cfg.vocab_size != small.cfg.vocab_size:
        raise ValueError(
            f"the small model's vocabulary ({small.cfg.vocab_size}) is not the large model's ({large.cfg.vocab_size})"
        )
    check_eval(large)
    check_eval(small)


def shares_encoder(large: Transformer, small: Companion) -> bool:
    """Whether the small model reads the large model's encoder (so it runs once for both)."""
    return getattr(small, "base", None) is large


def encoder_passes(large: Transformer, small: Companion) -> int:
    """Encoder runs per batch for the pair: 1 when the small model reads the large model's encoder."""
    return 1 if shares_encoder(large, small) else 2


def small_memory(large: Transformer, small: Companion, memory_l, src: torch.Tensor):
    """The small model's (or drafter's) memory: built from the large model's when it reads that
    encoder (an early exit, or a SharedEncoder), else from its own encoder pass over `src`."""
    return small.memory_from(memory_l) if shares_encoder(large, small) else small.encode(src)


class Follower:
    """A drafting model's cache kept in step with the committed output of every batch row (BiLD's
    small model, speculative decoding's drafter). It remembers the tokens its cache holds per row;
    `next_logits(sequences)` truncates row b's cache to the part of them that sequences[b] (bos +
    output so far, + what it drafted) still agrees with, feeds the rest of every row in one decoder
    call (right-padded, each row at its own positions) and returns each row's next-token logits
    (B, V). After a rollback only the positions past the first changed token are recomputed, never
    the whole prefix; when the cache already holds all of a sequence, its last position is fed
    again (a cache keeps states, not logits). `select(rows)` keeps batch rows, as rows finish."""

    def __init__(self, model: Companion, memory: Memory, capacity: int):
        self.model, self.memory = model, memory
        self.cache = model.new_cache(memory.batch, capacity=capacity)
        self.tokens: list[list[int]] = [[] for _ in range(memory.batch)]

    def next_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        keeps = []
        for have, seq in zip(self.tokens, sequences):
            keep = 0
            for a, b in zip(have, seq[:-1]):  # at least the last token is fed
                if a != b:
                    break
                keep += 1
            keeps.append(keep)
        device = self.memory.states.device
        todo = [seq[k:] for seq, k in zip(sequences, keeps)]
        self.tokens = [list(seq) for seq in sequences]
        if len(sequences) == 1:
            self.cache.truncate(keeps[0])
            return self.model.decode(torch.tensor(todo, dtype=torch.long, device=device), self.memory, self.cache)[
                :, -1
            ]
        self.cache.truncate(keeps)
        real = [len(t) for t in todo]
        width = max(real)
        inp = torch.tensor(
            [t + [self.model.cfg.pad_id] * (width - len(t)) for t in todo], dtype=torch.long, device=device
        )
        hidden = self.model.decode_hidden(inp, self.memory, self.cache, real=torch.tensor(real, device=device))
        self.cache.truncate([len(seq) for seq in sequences])
        last = hidden[torch.arange(len(todo), device=device), torch.tensor(real, device=device) - 1]  # (B, D)
        return self.model.project(last[:, None])[:, 0]

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (LongTensor), in that order, as KVCache.select does."""
        self.memory = self.memory.select(rows)
        self.cache.select(rows)
        self.tokens = [self.tokens[r] for r in rows.tolist()]
