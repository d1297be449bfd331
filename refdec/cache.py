"""What the decoder keeps between calls: KVCache, its self-attention keys and values with an explicit
length per batch row, and Memory, what it reads from the encoder.

Every decoder in refdec uses one KVCache and only its verbs:

    append(layer, k, v)  write q new positions for one layer at each row's [length, length + q)
                         and return that layer's keys/values for [0, end + q)
    advance(q)           commit the q positions once every layer has appended them
    truncate(n)          forget everything from position n on (rejected draft tokens); n is one
                         length for every row or one per row
    select(rows)         reorder / repeat / drop batch rows (beam search, finished rows)
    clone()              an independent copy

and one call that opens a decoder call on it, `place(tgt_new, prefix, open_from, real)`: where the
call's new tokens go (the model's forced tokens in, refdec.forced), the masks of what each may attend
to, and the positions that are real, all that the decoder layers need (NewPositions); the layers
append their keys and values through it, and its `commit` advances the cache. A route that writes
the storage itself rather than through append (refdec.routes.graphed) first calls `reserve(n)`:
room for storage positions [0, n), every one of them a number (append reserves what it writes).

Storage is preallocated, (layers, B, H, capacity, Dh), zeroed as calls reach it, and grows by
doubling, so appending a token never copies the cache. A caller may hand a new cache the storage to
keep it in (`storage`: keys and values of that shape, such as a route's static storage,
refdec.routes.graphed), which the cache then holds as its own.

Lengths. While every row holds the same number of positions (greedy and beam advance all rows together) the cache is
uniform: `length` is that one number and append writes one slice. A batched verification step commits a different number
of tokens per row; truncating to per-row lengths makes the cache ragged: `lengths` (B,) holds each row's own length,
`end` the longest, and `length` refuses to answer (a caller that wants one offset for every row would read a wrong one).
Row b's storage past lengths[b] is stale, a rejected tail or nothing at all, and is never attended: the model blocks
every key past lengths[b] + i for new query i of row b (ragged_block). The cache becomes uniform again as soon as its
rows agree (a truncate or select that leaves equal lengths), so a batch of one is never ragged.

Hidden prefix. A model with forced decoder tokens (refdec.config.ModelConfig.decoder_prefix) keeps
them in storage positions [0, prefix) of every row, below position 0 as decoders count it: lengths,
truncate and append speak of the positions after them, so a decoder never knows they are there.
`hide(p)` turns the first p committed positions into that prefix; a cache emptied by truncate(0)
drops it (the model writes it anew with the next start token). A row cut back to length 0 while
other rows keep theirs keeps it: the model then feeds that row's start token as the last forced
token, in the slot that token held (refdec.forced).

Memory: what the decoder reads from one encoder pass, the encoder states and the cross-attention
keys and values, computed once per source by `Transformer.encode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .forced import after_start

# Storage positions zeroed at once ahead of the furthest reached (KVCache.reserve): a zeroing writes one
# short run per layer, row and head, so zeroing one position per step paid that cost at every step.
ZERO_AHEAD = 16


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_heads: int,
        head_dim: int,
        capacity: int = 64,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        shape = (n_layers, batch, n_heads, max(1, capacity), head_dim)
        if storage is None:  # new storage, zeroed as the calls reach it (reserve)
            storage = torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
        elif storage[0].shape != shape or storage[1].shape != shape:  # given storage: its device and dtype
            raise ValueError(f"storage of shape {tuple(storage[0].shape)} for a cache of shape {shape}")
        self.k, self.v = storage
        self._zeroed = 0  # storage positions [0, _zeroed) of every row hold numbers: written, or zeros
        self._end = 0  # positions committed by advance() in the longest row
        self._lengths: torch.Tensor | None = None  # (B,) per row while rows differ, else None
        self.prefix = 0  # hidden storage positions before position 0 (see the module docstring)

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

    @property
    def ragged(self) -> bool:
        """Whether rows hold different numbers of positions."""
        return self._lengths is not None

    @property
    def length(self) -> int:
        """The positions every row holds; only defined while the rows agree (see `lengths`)."""
        if self._lengths is not None:
            raise ValueError("rows of this cache hold different lengths: read `lengths`")
        return self._end

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) LongTensor: the positions each row holds."""
        if self._lengths is not None:
            return self._lengths
        return torch.full((self.batch,), self._end, dtype=torch.long, device=self.k.device)

    @property
    def end(self) -> int:
        """The positions the longest row holds: keys [0, end) are returned for attention."""
        return self._end

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        """Per-row lengths, collapsed to one number when the rows agree."""
        if lengths.numel() == 0 or bool((lengths == lengths[0]).all()):
            self._end, self._lengths = (int(lengths[0]) if lengths.numel() else 0), None
        else:
            self._end, self._lengths = int(lengths.max()), lengths

    # -- verbs ----------------------------------------------------------------------------------
    def reserve(self, needed: int) -> None:
        """Room for storage positions [0, needed), every one of them a number. A call's attention
        reads every row's keys up to the longest row's end, masked past the row's own length: those
        must be numbers too (a masked weight is 0, and 0 x NaN is NaN), so the storage is zeroed up to
        the furthest position a call has reached, when it reaches it, not all at once: a batch's cache
        is sized for its longest possible output and most of it is never reached (ZERO_AHEAD at once)."""
        if needed > self.capacity:
            new_cap = max(needed, 2 * self.capacity)
            L, B, H, _, Dh = self.k.shape
            used = self.prefix + self._end
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((L, B, H, new_cap, Dh))
                new[:, :, :, :used] = old[:, :, :, :used]
                setattr(self, name, new)
            self._zeroed = used
        if needed > self._zeroed:
            ahead = min(self.capacity, max(needed, self._zeroed + ZERO_AHEAD))
            self.k[:, :, :, self._zeroed : ahead] = self.v[:, :, :, self._zeroed : ahead] = 0
            self._zeroed = ahead

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, q, Dh) at positions [lengths[b], lengths[b]+q) of row b in `layer`.

        Returns that layer's keys and values over [0, end+q), each (B, H, end+q, Dh), after the
        hidden prefix's (B, H, prefix, Dh); in a ragged cache a row's keys past its own length + q
        are stale and must be masked by the caller. The new positions count only after `advance(q)`.
        """
        q = k.shape[2]
        start, end = self.prefix + self._end, self.prefix + self._end + q
        self.reserve(end)
        if self._lengths is None:  # a cache may keep another dtype (the int8 route's float64, refdec.routes.int8):
            self.k[layer, :, :, start:end] = k  # the copy converts
            self.v[layer, :, :, start:end] = v
        else:
            k, v = k.to(self.k.dtype), v.to(self.v.dtype)
            B, H, _, Dh = k.shape
            # (B, q) each row's own offsets
            pos = self.prefix + self._lengths[:, None] + torch.arange(q, device=k.device)
            index = pos[:, None, :, None].expand(B, H, q, Dh)
            self.k[layer].scatter_(2, index, k)  # self.k[layer] is a view: written in place
            self.v[layer].scatter_(2, index, v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, q: int) -> None:
        """Commit the q positions that every layer has just appended (to every row)."""
        if self.prefix + self._end + q > self.capacity:
            raise RuntimeError("advance past what was appended")
        self._end += q
        if self._lengths is not None:
            self._lengths = self._lengths + q

    def truncate(self, n: int | Sequence[int] | torch.Tensor) -> None:
        """Keep positions [0, n) of every row, or [0, n[b]) of row b: the verifier's view of
        rejected draft tokens disappears. No row may grow."""
        if isinstance(n, int) and self._lengths is None:  # the uniform case stays arithmetic
            if not 0 <= n <= self._end:
                raise ValueError(f"truncate({n}) on a cache of length {self._end}")
            self._end = n
            if n == 0:
                self.prefix = 0
            return
        if isinstance(n, int):
            n = torch.full((self.batch,), n, dtype=torch.long, device=self.k.device)
        n = torch.as_tensor(n, dtype=torch.long, device=self.k.device).clone()  # never aliases the caller's
        if n.shape != (self.batch,) or bool((n < 0).any()) or bool((n > self.lengths).any()):
            raise ValueError(f"truncate({n.tolist()}) on a cache of lengths {self.lengths.tolist()}")
        self._set_lengths(n)
        if self._lengths is None and self._end == 0:
            self.prefix = 0

    def hide(self, p: int) -> None:
        """Make the first p committed positions of every row the hidden prefix (a uniform cache)."""
        if self._lengths is not None or not 0 <= p <= self._end:
            raise ValueError(f"hide({p}) on {self!r}")
        self.prefix += p
        self._end -= p

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (LongTensor of row indices, repeats allowed), in that order, in the
        leading rows of the same storage (new storage only when the batch grows), copying only the
        positions in use. Rows that only leave (rows increasing: a batch's finished rows) cost a move
        of each row after the first that left, in place; a batch whose rows finish one by one then
        never copies the whole cache into fresh memory. Past the positions in use a row may then
        hold another row's stale values, as stale as any position past a row's length, and masked
        as those are."""
        used, n, kept = self.prefix + self._end, len(rows), rows.tolist()
        if all(a < b for a, b in zip(kept, kept[1:])) and kept and 0 <= kept[0] and kept[-1] < self.batch:
            for i, r in enumerate(kept):  # r >= i: row r moves down to i, over rows that left or moved
                if r != i:
                    self.k[:, i, :, :used] = self.k[:, r, :, :used]
                    self.v[:, i, :, :used] = self.v[:, r, :, :used]
            self.k, self.v = self.k[:, :n], self.v[:, :n]
        else:  # rows reordered or repeated (beam search): gathered first, then written
            k, v = self.k[:, :, :, :used].index_select(1, rows), self.v[:, :, :, :used].index_select(1, rows)
            self._hold_rows(n, used)
            self.k[:, :, :, :used] = k
            self.v[:, :, :, :used] = v
        if self._lengths is not None:
            self._set_lengths(self._lengths.index_select(0, rows))

    def _hold_rows(self, n: int, used: int) -> None:
        """Make self.k, self.v n rows of storage, the cache's current rows first where n is no more
        (select writes the first `used` positions of every row next): new storage only past the rows
        the storage has."""
        if n > self.batch:
            L, _, H, capacity, Dh = self.k.shape
            self.k, self.v = self.k.new_empty((L, n, H, capacity, Dh)), self.v.new_empty((L, n, H, capacity, Dh))
            self._zeroed = used
        else:
            self.k, self.v = self.k[:, :n], self.v[:, :n]

    def clone(self) -> KVCache:
        other = KVCache.__new__(KVCache)
        other.k, other.v, other._end, other._lengths = self.k.clone(), self.v.clone(), self._end, self._lengths
        other._zeroed = self._zeroed
        other.prefix = self.prefix
        return other

    def place(
        self,
        tgt_new: torch.Tensor,
        prefix: tuple[int, ...] = (),
        open_from: int | torch.Tensor | None = None,
        real: torch.Tensor | None = None,
    ) -> NewPositions:
        """Open a decoder call of tgt_new (B, q) on this cache: the model's forced decoder tokens
        `prefix` put in (forced_tokens), their positions, the self-attention mask (causal_block, or
        ragged_block per row; with `open_from` = j, new positions j .. q-1 see every new position of
        their row), and with `real` (B,) the real positions of a right-padded ragged batch."""
        tokens, forced, open_from, real = forced_tokens(prefix, tgt_new, self, open_from, real)
        q = tokens.shape[1]
        keys = self.prefix + self._end + q  # the keys the call's attention reads
        if self.ragged or torch.is_tensor(open_from):
            offset = self.prefix + self.lengths  # (B,) each row's first new position
            block = ragged_block(offset, q, keys, open_from, real)
        else:  # one new token in a uniform cache sees every cached key: no mask, the greedy step stays lean
            offset = self.prefix + self._end
            block = causal_block(q, offset, tokens.device, open_from) if q > 1 else None
        is_real = (
            None if real is None else torch.arange(q, device=tokens.device)[None, :] < real.to(tokens.device)[:, None]
        )
        return NewPositions(tokens, offset, block, is_real, real, keys, forced, self)

    def __repr__(self) -> str:
        L, B, H, cap, Dh = self.k.shape
        length = f"lengths={self._lengths.tolist()}" if self.ragged else f"length={self._end}"
        if self.prefix:
            length += f", prefix={self.prefix}"
        return f"KVCache(layers={L}, batch={B}, heads={H}, head_dim={Dh}, {length}, capacity={cap})"


def padding_block(src_pad: torch.Tensor) -> torch.Tensor | None:
    """(B, 1, 1, S) the keys that are source padding, True = blocked, from src_pad (B, S); None when
    no row has padding: the masked_fill it saves would change nothing. Under torch.compile (the
    trainer's compiled passes) the mask is kept either way, the same no-op where there is no padding:
    a branch on the tensor's values would cut the compiled graph in two."""
    return src_pad[:, None, None, :] if torch.compiler.is_compiling() or bool(src_pad.any()) else None


@dataclass(eq=False)
class Memory:
    """What the decoder needs from one encoder pass, for one decoding call (two Memories are equal
    only if they are the same object; a route's Memory may carry what the route keeps for the call,
    refdec.routes.fast.LaidOutMemory).

    states:    (B, S, D) encoder output
    src_pad:   (B, S) True where the source is padding
    cross_kv:  per decoder layer, the cross-attention keys and values, each (B, H, S, Dh)
    src_block: (B, 1, 1, S) the cross-attention mask, True at padding; None when no row has padding
               (batch 1): the masked_fill it saves is a no-op then, so the logits are the same either way
    """

    states: torch.Tensor
    src_pad: torch.Tensor
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]]
    src_block: torch.Tensor | None = field(init=False, repr=False)

    def __post_init__(self):
        self.src_block = padding_block(self.src_pad)

    @property
    def batch(self) -> int:
        return self.states.shape[0]

    def select(self, rows: torch.Tensor) -> Memory:
        """The memory of batch rows `rows` (repeats allowed: beam search expands each source)."""
        return Memory(
            self.states.index_select(0, rows),
            self.src_pad.index_select(0, rows),
            [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cross_kv],
        )


# -- one decoder call on a cache ----------------------------------------------------------------------
@dataclass(eq=False)
class NewPositions:
    """What the decoder layers need of one call's new tokens (KVCache.place, or teacher_forced):

    tokens:     (B, q) the call's tokens, the model's forced ones in
    offset:     the first new position, one int, or (B,) one per row (a ragged cache)
    self_block: the self-attention mask over every key the call reads, True = blocked; None: none blocked
    is_real:    (B, q) True at the real positions of a right-padded ragged batch; None: all are real
    real:       (B,) how many of each row's tokens are real; None: all
    keys:       how many key positions the call's self-attention reads
    forced:     the leading positions that are forced tokens, hidden from the caller after the call
    cache:      where the new keys and values go; None when the keys are the call's own (teacher forcing)
    """

    tokens: torch.Tensor
    offset: int | torch.Tensor
    self_block: torch.Tensor | None
    is_real: torch.Tensor | None
    real: torch.Tensor | None
    keys: int
    forced: int
    cache: KVCache | None

    def keys_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values layer `layer`'s self-attention reads, given the new positions' own k, v
        (B, H, q, Dh): the cache's with these appended (KVCache.append), or these alone."""
        return (k, v) if self.cache is None else self.cache.append(layer, k, v)

    def commit(self, x: torch.Tensor) -> torch.Tensor:
        """After the last layer: the q positions committed to the cache (the forced ones into its
        hidden prefix), and the states x (B, q, D) of the positions the caller fed."""
        if self.cache is not None:
            self.cache.advance(self.tokens.shape[1])
            if self.forced:
                self.cache.hide(self.forced)
        return x[:, self.forced :]


def teacher_forced(
    tgt: torch.Tensor, prefix: tuple[int, ...] = (), self_block: torch.Tensor | None = None
) -> NewPositions:
    """A whole target sequence tgt (B, T), starting with the start token, fed at once without a cache
    (training): the forced tokens `prefix` after the start token, causal attention unless
    `self_block` (T, T) or (B, 1, T, T) replaces it."""
    if prefix:
        if self_block is not None:
            raise ValueError("a model with a decoder_prefix takes no self_block")
        tgt = after_start(tgt, prefix)
    block = causal_block(tgt.shape[1], 0, tgt.device) if self_block is None else self_block
    return NewPositions(tgt, 0, block, None, None, tgt.shape[1], len(prefix), None)


def causal_block(q_len: int, offset: int, device: torch.device, open_from: int | None = None) -> torch.Tensor:
    """(q, offset + q) mask, True = blocked: new query i (at position offset + i) sees keys 0..offset+i.
    With `open_from` = j, queries j .. q-1 see every new position (a drafter's block of masks)."""
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(offset + q_len, device=device)[None, :]
    blocked = cols > rows
    if open_from is not None:
        blocked[open_from:] = False
    return blocked


def ragged_block(
    offset: torch.Tensor,
    q_len: int,
    keys: int,
    open_from: int | torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, 1, q, keys) mask, True = blocked, for rows whose new queries start at different positions
    offset (B,): query i of row b sees keys 0 .. offset[b] + i and nothing else, since past them lie
    another row's longer history or this row's rejected tail, which must not enter its softmax. With
    `open_from` (one int, or (B,) one per row), row b's queries from open_from[b] on see up to its last
    real token, offset[b] + real[b] - 1 (all q when `real` is None), and its padding stays out."""
    steps = torch.arange(q_len, device=offset.device)
    last_key = offset[:, None] + steps  # (B, q)
    if open_from is not None:
        width = torch.full_like(offset, q_len) if real is None else real.to(offset.device)
        opened = steps[None, :] >= torch.as_tensor(open_from, device=offset.device).reshape(-1, 1)
        last_key = torch.where(opened, (offset + width - 1)[:, None], last_key)
    return (torch.arange(keys, device=offset.device) > last_key[:, :, None])[:, None]


def forced_tokens(
    prefix: tuple[int, ...],
    tgt_new: torch.Tensor,
    cache: KVCache,
    open_from: int | torch.Tensor | None,
    real: torch.Tensor | None,
):
    """A decoder call's input with the model's forced decoder tokens `prefix` (P of them, an imported
    model's language code) where they belong -> (tgt_new, forced, open_from, real), `forced` the
    positions to hide in the cache after the call (refdec.forced).

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
