"""Other kernels for the model's products: the few-row product, row-invariant compute and the int8
products on the model's own layers, as a route that wraps a model.

refdec.model builds the Transformer from plain torch layers (nn.Linear, nn.LayerNorm, its own
attention) and computes them as written: that is the reference route, what a loaded checkpoint is
and what decode.py runs by default. `on_kernels(module, Kernels(...))` returns the module's layers
again as the classes below (RoutedLinear, RoutedLayerNorm, RoutedAttention, RoutedTransformer:
subclasses of the model's own), built beside the model and holding its very parameter and buffer
dictionaries, so that they compute with its weights as they are now (nothing copied, the model
itself unchanged); each computes by the Kernels record it holds:

Few-row product (`few_rows`). On some CPUs, MKL's matrix product picks a faster routine for a few
rows x (r, D) when asked for (W @ x.T).T than for x @ W.T; on others (an AMD EPYC with AVX2) it is
slower. The fast route (refdec.routes.fast) takes it where it defers to these layers, as it always
has; `python -m refdec stepcost` times both on a machine (docs/cpu-cost.md). The products are the
same, possibly summed in another order: float32 logits may differ in the last bits.

Row-invariant compute (`row_invariant`, `row_invariant(model)`). A matrix product x @ W.T may round
row i differently depending on how many rows x has (MKL picks its blocking by shape, and by the
memory alignment of its operands). In row-invariant mode every dot product is an elementwise product
summed over its last dimension by torch's own reduction, which sums each output alone over the same
D elements in the same order whatever else is in the tensor and wherever it lies in memory; every
attention query sees exactly its own keys; every layer-norm row is normalised by a call of its own.
So a position's logits do not depend on the call shape (new tokens, batch rows, cache length), and a
decoder that verifies k tokens in one call computes bitwise what greedy computes one by one, ties
included; it is slower (docs/algorithms.md, "Row-invariant mode"). Temporaries are kept to
INVARIANT_BLOCK bytes: glibc serves larger ones (from 128 KiB) by mmap, and their page faults made a
greedy step several times slower.

The int8 products (`int8`, refdec.routes.int8). The linear layers and the vocabulary projection as
int8 products with one activation scale per row, exact in int32, and attention in float64: row-
invariant by construction, and they win over the modes above. Each layer keeps the int8 form of its
weight beside it (in the route's layer, not the model's), made again when the weight has changed
(refdec.routes.stamps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..model import MultiHeadAttention, Transformer, attention
from . import int8

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
@dataclass(frozen=True)
class Kernels:
    """How a route's layers compute (the module docstring): the few-row product, row-invariant
    compute, the int8 products. All off: the model's own products."""

    few_rows: bool = False
    row_invariant: bool = False
    int8: bool = False

    def int8_now(self) -> bool:
        """The int8 products are for inference: a call with gradients on takes the float ones."""
        return self.int8 and not torch.is_grad_enabled()


class RoutedLinear(nn.Linear):
    """nn.Linear (the model's own parameters) whose forward is `linear`, `rowwise_linear` in
    row-invariant mode, or the int8 product (refdec.routes.int8), itself row-invariant."""

    kernels: Kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.int8_now():
            return int8.linear(x, self.int8_weight(), self.bias)
        if self.kernels.row_invariant:
            return rowwise_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.kernels.few_rows)

    def int8_weight(self) -> int8.QuantizedWeight:
        """The weight's int8 form, (in, out), made again when the weight has changed."""
        return int8.kept(self.__dict__, "int8_form", self.weight)


class RoutedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the model's own parameters); in row-invariant mode each row is normalised by a
    call of its own."""

    kernels: Kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels.row_invariant:
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        return torch.stack([super(RoutedLayerNorm, self).forward(r) for r in rows.unbind(0)]).reshape(x.shape)


class RoutedAttention(MultiHeadAttention):
    """refdec.model.MultiHeadAttention whose heads attend by `rowwise_attention` in row-invariant
    mode, and in float64 beside the int8 products (refdec.routes.int8, "Attention in float64")."""

    kernels: Kernels

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = rowwise_attention if self.kernels.row_invariant else attention
        if self.kernels.int8_now():
            return kernel(q.double(), k.double(), v.double(), blocked, self.scale, bias).to(q.dtype)
        return kernel(q, k, v, blocked, self.scale, bias)


class RoutedTransformer(Transformer):
    """refdec.model.Transformer whose vocabulary projection takes the route's kernels and whose cache,
    beside the int8 products, is kept in float64 (the dtype its attention computes in)."""

    kernels: Kernels

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        if self.kernels.int8_now():  # made in float64 alone: not the model's dtype first
            return KVCache(self.cfg.dec_layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity,
                           device=self.tgt_embed.weight.device, dtype=torch.float64)
        return super().new_cache(batch, capacity)

    def vocabulary(self, hidden: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """hidden (B, q, D) @ W (V, D).T by the route's kernels (the int8 route: W's int8 form)."""
        if self.kernels.int8_now():
            return int8.linear(hidden, int8.kept(self.__dict__, "int8_vocabulary", W), None)
        if self.kernels.row_invariant:
            return rowwise_linear(hidden, W, None)
        return linear(hidden, W, None, self.kernels.few_rows)


ROUTED = {nn.Linear: RoutedLinear, nn.LayerNorm: RoutedLayerNorm, MultiHeadAttention: RoutedAttention,
          Transformer: RoutedTransformer}


def on_kernels(module: nn.Module, kernels: Kernels, memo: dict | None = None) -> nn.Module:
    """`module` (a Transformer, an adapter, proposal heads) computed by `kernels`: its module tree
    again, each nn.Linear, nn.LayerNorm, attention and Transformer in it as its class above, each
    holding the same parameter and buffer dictionaries as the module it stands for (so the same
    weights, now and after any change, the same state-dict keys), every other module the model's own.
    `module` itself is not changed. `memo` (id -> routed module), shared by the models of one run,
    keeps a module that several of them hold (an early exit's base) one module on the route too."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    children = {name: None if child is None else on_kernels(child, kernels, memo) for name, child in module._modules.items()}
    cls = ROUTED.get(type(module))
    if cls is None and all(children[name] is child for name, child in module._modules.items()):
        memo[id(module)] = module  # nothing below it computes differently
        return module
    routed = (cls or type(module)).__new__(cls or type(module))
    routed.__dict__.update(module.__dict__)  # its settings (cfg, heads, scale, eps, training)
    routed._parameters, routed._buffers, routed._modules = module._parameters, module._buffers, children
    for name, value in module.__dict__.items():
        if isinstance(value, nn.Module) and name not in module._modules:  # a module held as a plain attribute
            routed.__dict__[name] = on_kernels(value, kernels, memo)
    if cls is not None:
        routed.kernels = kernels
    memo[id(module)] = routed
    return routed


def row_invariant(module: nn.Module, memo: dict | None = None, int8: bool = False) -> nn.Module:
    """`module` in row-invariant mode (on_kernels; with `int8`, the int8 products too)."""
    return on_kernels(module, Kernels(row_invariant=True, int8=int8), memo)


def kernels_of(module) -> Kernels:
    """The kernels a model computes by: a route's own, or none (Kernels()) for a model as model.py reads."""
    found = getattr(module, "kernels", None)
    return found if isinstance(found, Kernels) else Kernels()


def is_row_invariant(module) -> bool:
    """Whether `module` computes in row-invariant mode."""
    return kernels_of(module).row_invariant


def is_int8(module) -> bool:
    """Whether `module` computes by the int8 products (False for anything that is not one of
    refdec's models: an external decoder's model)."""
    return kernels_of(module).int8
