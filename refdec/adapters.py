"""Small models made of parts of other models, which the pairing code (refdec.decoding.pairing) pairs
with a verifier: both read the verifier's encoder, so the encoder runs once per source for the pair
(`memory_from`), and both answer what a decoder asks of a companion model (refdec.decoding.pairing.Companion).

- `EarlyExit`: the first n decoder layers of the verifier itself (BiLD's early-exit small model);
  `early_exit_hidden`, what it trains on.
- `SharedEncoder`: a decoder without an encoder of its own on another model's encoder.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import KVCache, Memory
from .model import Transformer


def early_exit_hidden(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, layers: int) -> tuple:
    """Teacher forcing through `model`: its final decoder states and, through the same final norm, the
    states after its first `layers` decoder layers (an early exit's, BiLD's small model): (final, early),
    each (B, T, D); what an early exit trains on."""
    if not 1 <= layers < model.cfg.dec_layers:
        raise ValueError(f"an early exit needs 1 <= layers < {model.cfg.dec_layers}, got {layers}")
    states = model.decoder_states(src, tgt)
    return model.dec_norm(states[-1]), model.dec_norm(states[layers - 1])


class EarlyExit(nn.Module):
    """The first `layers` decoder layers of a Transformer with its final norm and prediction head:
    BiLD's early-exit small model (Kim et al. 2023, section 4.4). It shares every weight, and the
    encoder output, with the full model, and keeps its own KV cache of `layers` layers; decoders
    that take a small model take this as one."""

    def __init__(self, base: Transformer, layers: int):
        super().__init__()
        if not 1 <= layers < base.cfg.dec_layers:
            raise ValueError(f"an early exit needs 1 <= layers < {base.cfg.dec_layers}, got {layers}")
        self.base, self.layers, self.cfg = base, layers, base.cfg
        self.train(base.training)  # in step with the model it belongs to (eval for decoding)

    def encode(self, src: torch.Tensor) -> Memory:
        return self.base.encode(src)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        p = next(self.base.parameters())  # the target embedding's: the model's device and dtype (a route's too)
        return KVCache(
            self.layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity, device=p.device, dtype=p.dtype
        )

    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.base.decode_hidden(tgt_new, memory, cache, open_from=open_from, layers=self.layers, real=real)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.project(hidden)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache))

    def memory_from(self, memory: Memory) -> Memory:
        """The small model's memory from the large model's: the same (every weight is shared)."""
        return memory


class SharedEncoder(nn.Module):
    """A decoder without an encoder of its own (enc_layers 0) on another model's encoder: a BiLD
    small model that reads the large model's encoder states. Paired with that large model, the
    encoder runs once per source for both (`memory_from`), and the small model's cost is its
    decoder alone. Decoders take it as a model; its decoder is `small`, the encoder's model `base`."""

    def __init__(self, small: Transformer, base: Transformer):
        super().__init__()
        if small.cfg.enc_layers:
            raise ValueError("SharedEncoder takes a decoder without an encoder (enc_layers 0)")
        if small.cfg.memory_dim != base.cfg.d_model:
            raise ValueError(
                f"the decoder reads states of width {small.cfg.memory_dim}, the encoder gives {base.cfg.d_model}"
            )
        self.small, self.base, self.cfg = small, base, small.cfg
        self.train(small.training)

    def encode(self, src: torch.Tensor) -> Memory:
        return self.small.attach(*self.base.encode_states(src))

    def memory_from(self, memory: Memory) -> Memory:
        """The decoder's memory from the base model's (its encoder states; cross-attention K/V anew)."""
        return self.small.attach(memory.states, memory.src_pad)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        return self.small.new_cache(batch, capacity)

    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.small.decode_hidden(tgt_new, memory, cache, open_from=open_from, real=real)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.small.project(hidden)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing, no cache: (B, T, V) logits."""
        return self.small.project(self.small.forward_hidden(src, tgt, memory=self.encode(src)))
