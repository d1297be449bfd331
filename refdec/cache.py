"""KVCache: the decoder's self-attention keys and values, with an explicit length.

Every decoder in refdec uses this one object and only its verbs:

    append(layer, k, v)  write q new positions for one layer at [length, length + q) and
                         return that layer's keys/values for [0, length + q)
    advance(q)           commit the q positions once every layer has appended them
    truncate(n)          forget everything from position n on (rejected draft tokens)
    select(rows)         reorder / repeat / drop batch rows (beam search, finished rows)
    clone()              an independent copy

Storage is preallocated, (layers, B, H, capacity, Dh), and grows by doubling, so appending a
token never copies the cache. `length` is one number for the whole batch: every row of a batch
holds the same number of positions (greedy and beam advance all rows together; the speculative
decoders run one sentence at a time). Cross-attention keys and values do not live here: they are
computed once per source by `Transformer.encode` and kept in `Memory`.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_heads: int, head_dim: int, capacity: int = 64,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (n_layers, batch, n_heads, max(1, capacity), head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions committed by advance()

    # -- shape ----------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        L, B, H, _, Dh = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((L, B, H, new_cap, Dh))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    # -- verbs ----------------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, q, Dh) at positions [length, length+q) of `layer`.

        Returns that layer's keys and values over [0, length+q), each (B, H, length+q, Dh).
        The new positions count only after `advance(q)`.
        """
        q = k.shape[2]
        end = self.length + q
        self._reserve(end)
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, q: int) -> None:
        """Commit the q positions that every layer has just appended."""
        if self.length + q > self.capacity:
            raise RuntimeError("advance past what was appended")
        self.length += q

    def truncate(self, n: int) -> None:
        """Keep positions [0, n): the verifier's view of rejected draft tokens disappears."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) on a cache of length {self.length}")
        self.length = n

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (LongTensor of row indices, repeats allowed), in that order."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)

    def clone(self) -> "KVCache":
        other = KVCache.__new__(KVCache)
        other.k, other.v, other.length = self.k.clone(), self.v.clone(), self.length
        return other

    def __repr__(self) -> str:
        L, B, H, cap, Dh = self.k.shape
        return f"KVCache(layers={L}, batch={B}, heads={H}, head_dim={Dh}, length={self.length}, capacity={cap})"
