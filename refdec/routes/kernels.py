"""The compute modes of the reference route: other ways to compute a linear map, attention, layer
norm and the vocabulary projection, each the same mathematics, switched per model.

refdec.model builds the Transformer from plain torch layers (nn.Linear, nn.LayerNorm, its own
attention) and computes them as written. `use_kernels(model)` gives its layers the classes below
(RoutedLinear, RoutedLayerNorm, RoutedAttention, RoutedTransformer: subclasses of the model's own,
same parameters and state-dict keys, no copy), whose forward picks a mode by the switches it holds.
Every checkpoint loaded for decoding gets them (refdec.checkpoint.load_model, refdec.hf's import),
with the few-row route and the projection copy on; a model built directly computes as model.py
reads until a switch below is used on it.

Few-row route (`linear`, on once the kernels are in use, `set_few_row_route`). On CPU, MKL's matrix product picks a
much faster routine for a few rows x (r, D) when asked for (W @ x.T).T than for x @ W.T: on the
mt-en-de model a decoder call over 2-16 new tokens costs 1.30-1.57 single steps instead of 1.38-1.92
(`python -m refdec stepcost` times both; docs/cpu-cost.md). Beyond 16 rows (an encoder pass) it
loses, so the route depends on the row count. The products are the same, possibly summed in another
order: float32 logits may differ in the last bits between routes.

Projection copy (RoutedTransformer.vocabulary). On CPU, MKL's (1, D) @ (D, V) with a contiguous
(D, V) copy of the output embedding W (V, D) takes about half the time of the strided view W.t()
inside a decoding loop. The copy is kept beside the values it was made from and checked against W's
current values (torch.equal costs a fraction of a transposition), so weights changed in any way,
through `.data` or a fused optimizer step included, give a new copy. A decoding call (one Memory)
takes it on its second one-row step: a call with a single one-row step, as IAD's often are, does not
pay for the check, and no call ever decodes with weights older than its own. A projection belongs to
the call whose decoder states it projects: the Memory of the model's latest decode_hidden.

Row-invariant compute (`set_row_invariant`, off by default). A matrix product x @ W.T may round row
i differently depending on how many rows x has (MKL picks its blocking by shape, and by the memory
alignment of its operands). In row-invariant mode every dot product is an elementwise product summed
over its last dimension by torch's own reduction, which sums each output alone over the same D
elements in the same order whatever else is in the tensor and wherever it lies in memory; every
attention query sees exactly its own keys; every layer-norm row is normalised by a call of its own.
So a position's logits do not depend on the call shape (new tokens, batch rows, cache length), and a
decoder that verifies k tokens in one call computes bitwise what greedy computes one by one, ties
included; it is slower (docs/algorithms.md, "Row-invariant mode"). Temporaries are kept to
INVARIANT_BLOCK bytes: glibc serves larger ones (from 128 KiB) by mmap, and their page faults made a
greedy step several times slower. This mode never takes the few-row route or the projection copy.

The int8 route (refdec.routes.int8, `set_int8_route`, off by default). The linear layers and the vocabulary
projection as int8 products with one activation scale per row, exact in int32: row-invariant by
construction, and it wins over the modes above wherever it is on.

What a route keeps for one decoding call (the projection copy here, the fast route's layout and
masks, the graphed route's slot) it keeps in `call_state(memory)`, beside the Memory and not in it.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache, Memory
from ..model import MultiHeadAttention, Transformer, attention
from . import int8
from .int8 import Int8Route

FEW_ROWS = range(2, 17)  # row counts that take the few-row route
INVARIANT_BLOCK = 1 << 16  # bytes per temporary in row-invariant mode


# -- the few-row route --------------------------------------------------------------------------------
def few_row_route(x: torch.Tensor) -> bool:
    """Whether `linear` takes the (W @ x.T).T route for x (..., D): inference on CPU, 2-16 rows."""
    # (a comparison, not `in FEW_ROWS`: torch.compile traces it for a row count of any size)
    return (x.device.type == "cpu" and not torch.is_grad_enabled()
            and FEW_ROWS.start <= x.numel() // x.shape[-1] < FEW_ROWS.stop)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, few_rows: bool = True) -> torch.Tensor:
    """x (..., D) @ weight (O, D).T + bias (O,) -> (..., O); F.linear except for few rows on CPU
    (`few_rows` False: F.linear always)."""
    if not (few_rows and few_row_route(x)):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).t()  # (D, r)
    y = weight @ rows if bias is None else torch.addmm(bias[:, None], weight, rows)  # (O, r)
    return y.t().reshape(*x.shape[:-1], weight.shape[0])


# -- row-invariant compute ------------------------------------------------------------------------------
def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., D) @ weight (O, D).T + bias -> (..., O), each output the sum over D of x * w alone
    (blocks of rows and outputs bound the temporary; a block's size changes no output)."""
    D, O = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, D)
    out = rows.new_empty(rows.shape[0], O)
    per_block = max(1, INVARIANT_BLOCK // (D * x.element_size()))  # (row, output) pairs per temporary
    o_step = min(O, per_block)
    r_step = max(1, per_block // O) if o_step == O else 1
    for r in range(0, rows.shape[0], r_step):
        for o in range(0, O, o_step):
            torch.sum(rows[r:r + r_step, None, :] * weight[o:o + o_step], dim=-1, out=out[r:r + r_step, o:o + o_step])
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], O)


def rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                      scale: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """refdec.model.attention computed so that each query sees exactly the keys it may attend to
    (never a masked longer row: more terms change how a sum rounds): queries that share their keys
    (no mask, or a mask without a query dimension) go together, the others one by one, batch row by row."""
    B, H, Q, Dh = q.shape
    L = k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    out = q.new_empty(B, H, Q, Dh)
    allowed = None if blocked is None else ~blocked.expand(B, 1, Q, L)
    shared = allowed is None or blocked.shape[-2] == 1
    for b in range(B):
        for i0, i1 in ([(0, Q)] if shared else [(i, i + 1) for i in range(Q)]):
            keys = None if allowed is None else allowed[b, 0, i0].nonzero().squeeze(1)
            kb, vb = (k[b], v[b]) if keys is None else (k[b].index_select(1, keys), v[b].index_select(1, keys))  # (H, n, Dh)
            bb = None if bias is None else bias[b if bias.shape[0] > 1 else 0]  # (H, Q, L): T5's position bias
            bb = bb if bb is None or keys is None else bb.index_select(2, keys)
            step = max(1, INVARIANT_BLOCK // (max(1, kb.shape[1]) * H * Dh * q.element_size()))  # queries per temporary
            for j in range(i0, i1, step):
                qj = q[b, :, j:min(j + step, i1)]  # (H, m, Dh)
                scores = (qj[:, :, None, :] * kb[:, None]).sum(-1) * scale  # (H, m, n)
                scores = scores if bb is None else scores + bb[:, j:j + qj.shape[1]]
                p = torch.softmax(scores, dim=-1)
                out[b, :, j:j + qj.shape[1]] = (p[..., None] * vb[:, None]).sum(-2)  # (H, m, Dh)
    return out


# -- the layers, on the kernels ------------------------------------------------------------------------
class RoutedLinear(nn.Linear, Int8Route):
    """nn.Linear (same parameters and state-dict keys) whose forward is `linear`, `rowwise_linear`
    in row-invariant mode, or on the int8 route (refdec.routes.int8) the int8 product, itself row-invariant."""

    row_invariant, few_rows = False, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_active():
            return int8.linear(x, self.quantized("weight", self.weight), self.bias)
        if self.row_invariant:
            return rowwise_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.few_rows)


class RoutedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state-dict keys); in row-invariant mode each row is
    normalised by a call of its own."""

    row_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row_invariant:
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        return torch.stack([super(RoutedLayerNorm, self).forward(r) for r in rows.unbind(0)]).reshape(x.shape)


class RoutedAttention(MultiHeadAttention):
    """refdec.model.MultiHeadAttention whose heads attend by `rowwise_attention` in row-invariant mode,
    and in float64 on the int8 route (refdec.routes.int8, "Attention in float64")."""

    row_invariant = False

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = rowwise_attention if self.row_invariant else attention
        if self.wo.int8_active():
            return kernel(q.double(), k.double(), v.double(), blocked, self.scale, bias).to(q.dtype)
        return kernel(q, k, v, blocked, self.scale, bias)


# -- what a route keeps per decoding call --------------------------------------------------------------------
_CALLS: "weakref.WeakKeyDictionary[Memory, dict]" = weakref.WeakKeyDictionary()


def call_state(memory: Memory) -> dict:
    """The routes' state for one decoding call, one Memory (a Memory made by select is a call of its
    own): gone with the Memory."""
    state = _CALLS.get(memory)
    if state is None:
        state = _CALLS[memory] = {}
    return state


class RoutedTransformer(Transformer, Int8Route):
    """refdec.model.Transformer whose vocabulary projection takes the compute modes (the module
    docstring) and whose cache, on the int8 route, is kept in float64 (the dtype its attention
    computes in); the base of the fast and graphed routes' models."""

    row_invariant, few_rows = False, True
    call: "weakref.ref[Memory] | None" = None  # the Memory of the latest decode_hidden (the projection's call)
    projection_copy: tuple | None = None  # (the values W had, their contiguous transpose)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        if self.int8_active():  # made in float64 alone: not the model's dtype first
            return KVCache(self.cfg.dec_layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity,
                           device=self.tgt_embed.weight.device, dtype=torch.float64)
        return super().new_cache(batch, capacity)

    def decode_hidden(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache, *args, **kwargs) -> torch.Tensor:
        self.call = weakref.ref(memory)
        return super().decode_hidden(tgt_new, memory, cache, *args, **kwargs)

    def vocabulary(self, hidden: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """hidden (B, q, D) @ W (V, D).T; a one-row inference step on CPU within a decoding call uses
        the contiguous transposed copy from the call's second one-row step on; the int8 route, W's int8 form."""
        if self.int8_active():
            return int8.linear(hidden, self.quantized("vocabulary", W), None)
        if self.row_invariant:
            return rowwise_linear(hidden, W, None)
        if hidden.shape[0] * hidden.shape[1] == 1 and hidden.device.type == "cpu" and not torch.is_grad_enabled():
            memory = None if self.call is None else self.call()  # the call this one-row step belongs to
            W_t = None if memory is None else self._projection(call_state(memory), W)
            if W_t is not None:
                return hidden @ W_t
        return linear(hidden, W, None, self.few_rows)

    def _projection(self, state: dict, W: torch.Tensor) -> torch.Tensor | None:
        """A contiguous (D, V) copy of W (V, D) for this call's one-row steps, from its second one on."""
        copies = state.setdefault("projection", {})
        got = copies.get(W.data_ptr())
        if got is None:
            copies[W.data_ptr()] = False  # one one-row step seen
            return None
        if got is False:
            got = copies[W.data_ptr()] = self._transposed(W)
        return got

    def _transposed(self, W: torch.Tensor) -> torch.Tensor:
        """W.t() as a contiguous copy, remade unless the values it was made from equal W's now."""
        kept = self.projection_copy
        if (kept is None or kept[0].shape != W.shape or kept[0].dtype != W.dtype or kept[0].device != W.device
                or not torch.equal(kept[0], W)):
            kept = self.projection_copy = (W.detach().clone(), W.detach().t().contiguous())
        return kept[1]


# -- the switches -----------------------------------------------------------------------------------
ROUTED = {nn.Linear: RoutedLinear, nn.LayerNorm: RoutedLayerNorm, MultiHeadAttention: RoutedAttention,
          Transformer: RoutedTransformer}


def use_kernels(module: nn.Module) -> nn.Module:
    """Give every plain layer inside `module` (a Transformer, an adapter, proposal heads) its class
    on the kernels (ROUTED; the parameters, their values and the state-dict keys stay) and return
    it: the few-row route and the projection copy on, row-invariant and int8 off until switched.
    Layers already on the kernels (or on the fast or graphed route) are left as they are."""
    for m in module.modules():
        routed = ROUTED.get(type(m))
        if routed is not None:
            m.__class__ = routed
    return module


def set_row_invariant(module: nn.Module, on: bool = True) -> nn.Module:
    """Switch row-invariant compute on (or off) for every layer of `module` (a Transformer, an
    EarlyExit, a SharedEncoder, proposal heads) and return it. Other models are untouched."""
    for m in use_kernels(module).modules():
        if isinstance(m, (RoutedLinear, RoutedLayerNorm, RoutedAttention, RoutedTransformer)):
            m.row_invariant = on
    return module


def set_few_row_route(module: nn.Module, on: bool = True) -> nn.Module:
    """Let the linear layers and the vocabulary projection of `module` take the few-row route of
    `linear` (on, the default on the kernels) or always F.linear (off), and return it. Other models are untouched."""
    for m in use_kernels(module).modules():
        if isinstance(m, (RoutedLinear, RoutedTransformer)):
            m.few_rows = on
    return module


def is_row_invariant(module: nn.Module) -> bool:
    """Whether `module` computes in row-invariant mode (all of its layers: the switch sets them together)."""
    layers = [m for m in module.modules() if isinstance(m, (RoutedLinear, RoutedLayerNorm, RoutedAttention))]
    return bool(layers) and all(m.row_invariant for m in layers)


def set_int8_route(module: nn.Module, on: bool = True) -> nn.Module:
    """Switch the int8 route on (or off) for every linear layer and vocabulary projection inside
    `module` (a Transformer, or anything holding some) and return it. Off, their int8 weights are
    dropped."""
    if on:
        int8.weight_levels()  # refuse at once on a machine whose int8 product is not exact
    for m in use_kernels(module).modules():
        if isinstance(m, Int8Route):
            m.int8 = on
            if not on:
                m.int8_weights = None
    return module


def is_int8(module) -> bool:
    """Whether `module`'s layers take the int8 route (the switch sets them together); False for
    anything that is not a torch module (an external decoder's model)."""
    if not isinstance(module, nn.Module):
        return False
    layers = [m for m in module.modules() if isinstance(m, Int8Route)]
    return bool(layers) and all(m.int8 for m in layers)
