"""The graphed route: the fast route's decoder call and encoder written with static shapes, so that on
a GPU each is captured once as a CUDA graph and replayed, one launch where the fast route makes a few
hundred.

A decoder call of a model this size is all launch and Python overhead on a GPU: its few hundred
operations each cost microseconds to issue and nanoseconds to compute. A CUDA graph records the
kernels of one call once and replays them with one launch, but only a call whose tensors keep their
shapes and addresses from one replay to the next. So this route computes the fast route's
mathematics (refdec.routes.fast, the same weight layout and layer loop, `decoder_stack`) on static shapes:

  * the KV cache preallocated to its capacity (StaticKVCache, the same verbs as KVCache), in storage
    that never moves while the cache lives: a select that drops rows gathers them in place, and a
    new cache takes the storage its finished predecessor of the same shape left (`Pool`);
  * attention masked over the whole capacity: new token i of row b sees the keys 0 .. offset[b] + i,
    offset[b] its row's first new position, held in a tensor (a row's stale tail is never seen);
  * a call's new tokens padded to a bucket (1, 2, 4, ..., MAX_STEP), its rows to a power of two:
    the padded positions and rows are computed and never read, and `advance` commits only the q
    positions the caller gave (their keys and values lie past every row's length: stale storage);
  * the encoder's sources padded to a power of two in length (and rows), the padding masked;
  * the memory's cross-attention keys and values copied, once per Memory, into a slot of static
    tensors that the decoder calls read.

A call fills the static inputs (its tokens, each row's offset), runs the step (`Replay`: on a GPU,
captured at its first call and replayed after; on the CPU, the same function called eagerly), and
copies the states of its real rows and positions out. The steps are kept per shape: rows, new
tokens, the cache's storage and the memory's slot. What a CPU run does not exercise is the capture
and the replay alone (`capture`); every line that builds, fills and runs the static step is tested
on the CPU, and tests check that the step makes no host synchronisation or data-dependent shape,
which a capture refuses.

Where the route does not apply, a call takes the fast route (and where that does not, the
reference route): training, gradients on, row-invariant mode, an early exit (`layers`), a drafter's
block of masks (`open_from`), more than MAX_STEP new tokens, a cache that is not a StaticKVCache,
a forced decoder prefix's first call, and the families the fast route does not write.

The route sums in another order again (masked keys over the capacity, padded calls), so its
logits differ from the reference route's in the last bits, within 1e-12 in float64 (tested), and
every lossless decoder on it equals greedy on it (torch.equal; tests/test_graphed.py).
`on_route(model, "graphed")` (refdec.routes) wraps a Transformer in a GraphedRoute as the fast route
does (refdec.routes.fast), the model unchanged; its steps and static storage are the route's, and a
copy of the route (copy.deepcopy) is a route of a copy of the model, whose steps are made again at
first use.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import KVCache, Memory, forced_tokens
from ..forced import before_source
from ..model import Transformer
from .fast import FastRoute, LaidOutMemory, decoder_stack

MAX_STEP = 64  # the widest decoder call captured: new tokens are padded to 1, 2, 4, ..., MAX_STEP


def bucket(n: int) -> int:
    """The smallest power of two at least n: the padded size of a call's tokens and rows, a source's length."""
    return 1 << max(0, n - 1).bit_length()


# -- capture and replay: the route's only lines a CPU does not run -----------------------------------
def capture(fn: Callable[[], None], pool, cuda=torch.cuda):
    """A CUDA graph of fn() as PyTorch documents capture: a warm-up run on a side stream (lazy
    initialisation, library workspaces), then one run captured. A run writes the same values
    whenever its inputs are the same, so the warm-up's writes (into the KV cache) are the replay's.
    `pool`: the memory pool the model's graphs share (each replays alone and leaves nothing in it)."""
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        fn()
    cuda.current_stream().wait_stream(side)
    graph = cuda.CUDAGraph()
    with cuda.graph(graph, pool=pool):
        fn()
    return graph


class Replay:
    """A step: a function of static tensors alone (no arguments; it reads inputs filled before each
    call and writes its results into other static tensors). On CUDA it is captured at the first call
    and replayed at every later one; elsewhere it is called as it is."""

    def __init__(self, fn: Callable[[], None], device: torch.device, pool=None, cuda=None):
        # cuda: torch.cuda unless given
        self.fn, self.graphed, self.pool, self.cuda = fn, device.type == "cuda", pool, cuda
        self.graph = None

    def __call__(self) -> None:
        if not self.graphed:
            self.fn()
            return
        if self.graph is None:
            self.graph = capture(self.fn, self.pool, self.cuda or torch.cuda)
        self.graph.replay()


# -- static storage, lent to one owner at a time ----------------------------------------------------
def static_zeros(*shape, device, dtype) -> torch.Tensor:
    """An ordinary tensor (not an inference tensor, so that any later call may write it in place)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.zeros(shape, device=device, dtype=dtype)


class Slab:
    """A KV cache's storage: keys and values (layers, rows, H, capacity, Dh)."""

    def __init__(self, shape: tuple, device, dtype):
        self.k, self.v = (
            static_zeros(*shape, device=device, dtype=dtype),
            static_zeros(*shape, device=device, dtype=dtype),
        )
        self.owner = None


class Slot:
    """A memory's cross-attention keys and values per decoder layer, each (rows, H, width, Dh), and
    `allowed` (rows, 1, 1, width), True at the real source positions, as the decoder calls read them."""

    def __init__(self, layers: int, rows: int, heads: int, width: int, head_dim: int, device, dtype):
        self.cross = [
            (
                static_zeros(rows, heads, width, head_dim, device=device, dtype=dtype),
                static_zeros(rows, heads, width, head_dim, device=device, dtype=dtype),
            )
            for _ in range(layers)
        ]
        self.allowed = static_zeros(rows, 1, 1, width, device=device, dtype=torch.bool).fill_(True)
        self.owner = None

    def hold(self, memory: Memory) -> None:
        """Copy memory's rows in (the rows past them keep what they held: never read)."""
        n, S = memory.src_pad.shape
        for (sk, sv), (k, v) in zip(self.cross, memory.cross_kv):
            sk[:n, :, :S].copy_(k)
            sv[:n, :, :S].copy_(v)
        self.allowed[:n, 0, 0, :S].copy_(~memory.src_pad)
        self.allowed[:n, 0, 0, S:] = False


class Pool:
    """Static storage by shape, each piece lent to one owner at a time and free again once its owner
    is gone (a finished decoding call's cache or memory): the next call of the same shape takes the
    same storage, so the steps captured over it replay."""

    def __init__(self, make: Callable):
        self.make, self.pieces = make, {}

    def take(self, owner, *shape):
        pieces = self.pieces.setdefault(shape, [])
        piece = next((p for p in pieces if p.owner is None or p.owner() is None), None)
        if piece is None:
            piece = self.make(*shape)
            pieces.append(piece)
        piece.owner = weakref.ref(owner)
        return piece


class StaticKVCache(KVCache):
    """A KVCache (the same verbs, lengths and hidden prefix: refdec.cache) whose storage stays where
    it is while the cache lives, so that a captured step reads and writes it in place: a Slab of a
    power-of-two batch and capacity, with MAX_STEP positions to spare for a padded call. `select`
    (KVCache's) keeps its rows in the leading rows of the same storage; growing past the capacity
    or the rows (a rare call) moves the cache to a larger slab."""

    def __init__(
        self,
        pool: Pool,
        n_layers: int,
        batch: int,
        n_heads: int,
        head_dim: int,
        capacity: int = 64,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.pool, self.shape = pool, (n_layers, n_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        slab = self._take(bucket(batch), bucket(max(1, capacity) + MAX_STEP))
        storage = slab.k[:, :batch], slab.v[:, :batch]  # the slab's leading rows
        super().__init__(n_layers, batch, n_heads, head_dim, slab.k.shape[3], storage=storage)

    def _take(self, rows: int, capacity: int) -> Slab:
        """Take a slab of `rows` rows and `capacity` positions from the pool, giving back the one held."""
        L, H, Dh = self.shape
        old = getattr(self, "slab", None)
        self.slab = self.pool.take(self, (L, rows, H, capacity, Dh), self.device, self.dtype)
        if old is not None:
            old.owner = None
        return self.slab

    def _move(self, rows: int, capacity: int, batch: int) -> None:
        """Take a slab of `rows` rows and `capacity` positions; the cache's `batch` rows are its leading ones."""
        slab = self._take(rows, capacity)
        self.k, self.v = slab.k[:, :batch], slab.v[:, :batch]

    def reserve(self, needed: int) -> None:
        """KVCache.reserve on storage whose every position holds a number already: nothing to zero;
        past the capacity, a larger slab, the positions in use copied into it."""
        if needed <= self.capacity:
            return
        used, k, v = self.prefix + self._end, self.k, self.v
        self._move(self.slab.k.shape[1], bucket(needed + MAX_STEP), self.batch)
        self.k[:, :, :, :used] = k[:, :, :, :used]
        self.v[:, :, :, :used] = v[:, :, :, :used]

    def _hold_rows(self, n: int, used: int) -> None:
        """KVCache.select's storage of n rows: the slab's leading rows, a larger slab past its rows."""
        if n > self.slab.k.shape[1]:
            self._move(bucket(n), self.capacity, n)
        else:
            self.k, self.v = self.slab.k[:, :n], self.slab.v[:, :n]

    def clone(self) -> StaticKVCache:
        L, H, Dh = self.shape  # a slab of this one's capacity (a power of two: MAX_STEP to spare already)
        other = StaticKVCache(
            self.pool, L, self.batch, H, Dh, self.capacity - MAX_STEP, device=self.device, dtype=self.dtype
        )
        if other.slab.k.shape[1] != self.slab.k.shape[1]:  # as many rows of storage as this one's
            other._move(self.slab.k.shape[1], self.capacity, self.batch)
        other._end, other._lengths, other.prefix = self._end, self._lengths, self.prefix
        used = self.prefix + self._end
        other.k[:, :, :, :used] = self.k[:, :, :, :used]
        other.v[:, :, :, :used] = self.v[:, :, :, :used]
        return other

    def __repr__(self) -> str:
        return "Static" + super().__repr__()


# -- the route ---------------------------------------------------------------------------------------
@dataclass
class Step:
    """One captured shape of a decoder call or an encoder pass: its static inputs, its static
    output, and the step that reads the one and writes the other."""

    tokens: torch.Tensor  # (rows, width) token ids
    offset: torch.Tensor | None  # (rows,) each row's first new position (decoder calls)
    out: torch.Tensor  # (rows, width, D) final states
    run: Replay
    holds: tuple = ()  # the slab and slot it reads in place, kept alive with it


class RouteState:
    """A route's steps and static storage, for one weight layout and one placement of the model's
    parameters and buffers (a captured step reads them where they were): made again when either changes."""

    def __init__(self, layout, mark: tuple, device: torch.device):
        self.layout, self.mark = layout, mark
        self.slabs = Pool(Slab)
        self.slots = Pool(Slot)
        self.steps: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None


class GraphedRoute(FastRoute):
    """Wraps a Transformer so that its encoder and decoder calls take the graphed route where it applies
    (the module docstring), and the fast route's calls (FastRoute) where it does not."""

    def __init__(self, model: Transformer, few_rows: bool = True):
        super().__init__(model, few_rows=few_rows)
        self.state: RouteState | None = None  # the captured steps and static storage (made at first use)
        # what each step function goes through before its capture (None: nothing; `refdec stepcost --fused`
        # compiles them there, to measure what fusing buys)
        self.prepare_step: Callable[[Callable[[], None]], Callable[[], None]] | None = None

    def __deepcopy__(self, memo: dict) -> GraphedRoute:
        twin = GraphedRoute(copy.deepcopy(self.model, memo), few_rows=self.kernels.few_rows)
        twin.prepare_step = self.prepare_step
        return twin

    def _replay(self, run: Callable[[], None], device: torch.device, pool) -> Replay:
        return Replay(self.prepare_step(run) if self.prepare_step else run, device, pool)

    def _state(self) -> RouteState:
        """The route's steps, checked against its layout and where the parameters live (once per decoding call)."""
        self.encoder_layers()  # the encoder's layout, copied again first if one of its parameters has changed
        layout = (self.decoder_weights(), self.encoder_laid_out)  # copied again first if a parameter has changed
        tensors = [*self.model.parameters(), *(b for b in self.model.buffers() if b is not None)]
        mark = tuple((p.data_ptr(), p.dtype, p.device) for p in tensors)
        state = self.state
        if state is None or state.layout != layout or state.mark != mark:
            state = self.state = RouteState(layout, mark, self.model.tgt_embed.weight.device)
        return state

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        p = self.model.tgt_embed.weight
        return StaticKVCache(
            self._state().slabs,
            self.cfg.dec_layers,
            batch,
            self.cfg.n_heads,
            self.cfg.head_dim,
            capacity,
            device=p.device,
            dtype=p.dtype,
        )

    # -- the encoder --------------------------------------------------------------------------------
    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = before_source(src, self.cfg.encoder_prefix)
        n, S = full.shape
        if not (self.applies() and self.cfg.enc_layers) or S > self.cfg.max_positions:
            return FastRoute.encode_states(self, src)  # its route, or its error
        rows, width = bucket(n), min(bucket(S), self.cfg.max_positions)
        state = self._state()
        step = state.steps.get(("encoder", rows, width))
        if step is None:
            step = state.steps[("encoder", rows, width)] = self._encoder_step(rows, width, state.pool)
        step.tokens.fill_(self.cfg.pad_id)
        step.tokens[:, 0] = self.cfg.eos_id  # a padded row: one real token, so that its attention has a key
        step.tokens[:n, :S] = full
        step.run()
        return step.out[:n].clone(), step.tokens[:n].eq(self.cfg.pad_id)

    def _encoder_step(self, rows: int, width: int, pool) -> Step:
        p = self.model.tgt_embed.weight
        tokens = static_zeros(rows, width, device=p.device, dtype=torch.long)
        out = static_zeros(rows, width, self.cfg.d_model, device=p.device, dtype=p.dtype)
        layers = self.encoder_layers()  # the layout made here, outside the captured (or compiled) step

        def run():
            out.copy_(self.encoder_stack(tokens, tokens.ne(self.cfg.pad_id)[:, None, None, :], layers=layers))

        return Step(tokens, None, out, self._replay(run, p.device, pool))

    # -- the decoder call -----------------------------------------------------------------------------
    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,
        layers: int | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n, q = tgt_new.shape
        first_forced = bool(self.cfg.decoder_prefix) and not cache.ragged and cache.end == 0
        if (
            open_from is not None
            or layers is not None
            or not self.applies()
            or not isinstance(cache, StaticKVCache)
            or q > MAX_STEP
            or memory.batch != n
            or cache.batch != n
            or first_forced
        ):
            return FastRoute.decode_hidden(self, tgt_new, memory, cache, open_from, layers, real)
        offsets = [cache.prefix + m for m in (cache.lengths.tolist() if cache.ragged else [cache.end] * n)]
        if max(offsets) + q > self.cfg.max_positions:
            return FastRoute.decode_hidden(self, tgt_new, memory, cache, open_from, layers, real)  # its check and error
        width = bucket(q)
        cache.reserve(max(offsets) + width)  # the padded positions too
        tgt_new = forced_tokens(self.cfg.decoder_prefix, tgt_new, cache, None, real)[0]
        step = self._decoder_step(memory, cache, width)
        step.tokens.fill_(self.cfg.pad_id)
        step.tokens[:n, :q] = tgt_new
        step.offset.zero_()  # padded rows: positions 0 .. width - 1 of storage rows no cache row holds
        step.offset[:n] = torch.tensor(offsets, device=step.offset.device)
        step.run()
        cache.advance(q)
        return step.out[:n, :q].clone()

    def step_of(self, memory: Memory, cache: StaticKVCache, q: int) -> Step:
        """The step a call of q new tokens per row over this memory and cache runs (a measuring
        tool's handle on the replay alone: refdec.commands.harness.time_replay)."""
        return self._decoder_step(memory, cache, bucket(q))

    def _decoder_step(self, memory: Memory, cache: StaticKVCache, width: int) -> Step:
        """The step of this shape over this cache's storage and this memory's slot (made at first use)."""
        state, slot = self._slot(memory)
        rows = slot.cross[0][0].shape[0]
        key = ("decoder", rows, width, id(cache.slab), id(slot))
        step = state.steps.get(key)
        if step is None:
            step = state.steps[key] = self._make_decoder_step(cache.slab, slot, rows, width, state.pool)
        return step

    def _slot(self, memory: Memory) -> tuple[RouteState, Slot]:
        """The slot holding this memory's cross-attention keys and values for this route's steps:
        taken and filled once per decoding call, kept in the call's LaidOutMemory (the route's state
        checked then too)."""
        own = isinstance(memory, LaidOutMemory) and memory.route is self
        got = memory.slot if own else None
        if got is None or got[0] is not self.state:
            state = self._state()
            n, S = memory.src_pad.shape
            k = memory.cross_kv[0][0]
            slot = state.slots.take(
                memory,
                len(self.model.decoder),
                bucket(n),
                self.cfg.n_heads,
                bucket(S),
                self.cfg.head_dim,
                k.device,
                k.dtype,
            )
            slot.hold(memory)
            got = (state, slot)
            if own:
                memory.slot = got
        return got

    def _make_decoder_step(self, slab: Slab, slot: Slot, rows: int, width: int, pool) -> Step:
        """The decoder call on static shapes: `width` new tokens in each of `rows` rows at positions
        offset[b] .. offset[b] + width - 1, their keys and values written into the slab there,
        attention over the slab's whole capacity (a key past a query's position masked), the slot's
        cross-attention keys and values; the final states into `out`."""
        cfg, device = self.cfg, slab.k.device
        D, H, C = cfg.d_model, cfg.n_heads, slab.k.shape[3]
        tokens = static_zeros(rows, width, device=device, dtype=torch.long)
        offset = static_zeros(rows, device=device, dtype=torch.long)
        out = static_zeros(rows, width, D, device=device, dtype=slab.k.dtype)
        steps, keys = torch.arange(width, device=device), torch.arange(C, device=device)
        layer, row = torch.arange(cfg.dec_layers, device=device), torch.arange(rows, device=device)[:, None, None]
        head = torch.arange(H, device=device)[None, :, None]
        model = self.model
        table = model.positions if model.tgt_positions is None else model.tgt_positions
        scale = cfg.d_model**0.5 if cfg.scale_embeddings else 1.0
        layers = self.decoder_weights().layers

        def run():
            at = offset[:, None] + steps  # (rows, width): each new token's position
            x = model.tgt_embed_norm(model.tgt_embed(tokens) * scale + table[at.clamp(max=cfg.max_positions - 1)])
            allowed = (keys <= at[:, :, None])[:, None]  # (rows, 1, width, C)
            where = (row, head, at.clamp(max=C - 1)[:, None, :])  # (rows, H, width) positions in a layer's storage

            def store(i, k, v):  # the new keys and values at their positions; every position is read
                # written into the slab itself (not a view of it), which a compiled step (stepcost --fused) writes
                # in place
                slab.k.index_put_((layer[i], *where), k)
                slab.v.index_put_((layer[i], *where), v)
                return slab.k[i, :rows], slab.v[i, :rows]

            x = decoder_stack(
                layers,
                x.reshape(rows * width, D),
                rows,
                width,
                H,
                store,
                allowed,
                slot.cross,
                slot.allowed,
                None,
                cfg.norm_first,
            )
            out.copy_(model.dec_norm(x.view(rows, width, D)))

        return Step(tokens, offset, out, self._replay(run, device, pool), (slab, slot))
