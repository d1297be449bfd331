"""Other kernels for the model's products: the few-row product, row-invariant compute and the int8
products on the model's own layers, as a route that wraps a model.

refdec.model builds the Transformer from plain torch layers (nn.Linear, nn.LayerNorm) and two
parameterless modules of its own (ScaledDotProduct, OutputProduct), and computes them as written:
that is the reference route, what a loaded checkpoint is and what decode.py runs by default. A
KernelRoute (made by refdec.routes.on_route) wraps a model and computes it by its `twin`: the model's
module tree again, holding the model's very parameters and buffers (the same tensors: the same
weights now and after any in-place change), in which each of those leaves is replaced by its routed
form below (RoutedLinear, RoutedLayerNorm, RoutedAttention, RoutedOutput), as one puts a model on
int8 by replacing its linear layers; the composite modules are the model's own classes, copied, so
the twin computes refdec.model's code line for line, and the model itself is not changed. Each
routed leaf computes by the Kernels record it holds:

Few-row product (`few_rows`). On some CPUs, MKL's matrix product picks a faster routine for a few
rows x (r, D) when asked for (W @ x.T).T than for x @ W.T; on others (an AMD EPYC with AVX2) it is
slower. The fast route (refdec.routes.fast) takes it where it defers to these layers, as it always
has; `python -m refdec stepcost` times both on a machine (docs/cpu-cost.md). The products are the
same, possibly summed in another order: float32 logits may differ in the last bits.

Row-invariant compute (`row_invariant`, `on_route(model, "invariant")`). A matrix product x @ W.T may round
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

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache, Memory
from ..model import OutputProduct, ScaledDotProduct, Transformer, attention
from . import int8

FEW_ROWS = range(2, 17)  # row counts that take the few-row route
INVARIANT_BLOCK = 1 << 16  # bytes per temporary in row-invariant mode


# -- the few-row route --------------------------------------------------------------------------------
def few_row_route(x: torch.Tensor) -> bool:
    """Whether `linear` takes the (W @ x.T).T route for x (..., D): inference on CPU, 2-16 rows."""
    # (a comparison, not `in FEW_ROWS`: torch.compile traces it for a row count of any size)
    return (
        x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and FEW_ROWS.start <= x.numel() // x.shape[-1] < FEW_ROWS.stop
    )


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
            torch.sum(
                rows[r : r + r_step, None, :] * weight[o : o + o_step], dim=-1, out=out[r : r + r_step, o : o + o_step]
            )
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], O)


def rowwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocked: torch.Tensor | None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
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
        for i0, i1 in [(0, Q)] if shared else [(i, i + 1) for i in range(Q)]:
            keys = None if allowed is None else allowed[b, 0, i0].nonzero().squeeze(1)
            kb, vb = (
                (k[b], v[b]) if keys is None else (k[b].index_select(1, keys), v[b].index_select(1, keys))
            )  # (H, n, Dh)
            bb = None if bias is None else bias[b if bias.shape[0] > 1 else 0]  # (H, Q, L): T5's position bias
            bb = bb if bb is None or keys is None else bb.index_select(2, keys)
            step = max(1, INVARIANT_BLOCK // (max(1, kb.shape[1]) * H * Dh * q.element_size()))  # queries per temporary
            for j in range(i0, i1, step):
                qj = q[b, :, j : min(j + step, i1)]  # (H, m, Dh)
                scores = (qj[:, :, None, :] * kb[:, None]).sum(-1) * scale  # (H, m, n)
                scores = scores if bb is None else scores + bb[:, j : j + qj.shape[1]]
                p = torch.softmax(scores, dim=-1)
                out[b, :, j : j + qj.shape[1]] = (p[..., None] * vb[:, None]).sum(-2)  # (H, m, Dh)
    return out


# -- the leaves, on the kernels -------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernels:
    """How a route's leaves compute (the module docstring): the few-row product, row-invariant
    compute, the int8 products. All off: the model's own products."""

    few_rows: bool = False
    row_invariant: bool = False
    int8: bool = False

    def int8_now(self) -> bool:
        """The int8 products are for inference: a call with gradients on takes the float ones."""
        return self.int8 and not torch.is_grad_enabled()


class RoutedLinear(nn.Module):
    """An nn.Linear's product (its very weight and bias) by `linear`, `rowwise_linear` in row-invariant
    mode, or the int8 product (refdec.routes.int8), itself row-invariant."""

    def __init__(self, layer: nn.Linear, kernels: Kernels):
        super().__init__()
        self.weight, self.bias, self.kernels = layer.weight, layer.bias, kernels
        self.int8_forms: dict = {}  # the weight's int8 form, kept (int8_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.int8_now():
            return int8.linear(x, self.int8_weight(), self.bias)
        if self.kernels.row_invariant:
            return rowwise_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.kernels.few_rows)

    def int8_weight(self) -> int8.QuantizedWeight:
        """The weight's int8 form, (in, out), made again when the weight has changed."""
        return int8.kept(self.int8_forms, "weight", self.weight)


class RoutedLayerNorm(nn.Module):
    """An nn.LayerNorm (its very weight and bias); in row-invariant mode each row is normalised by a
    call of its own."""

    def __init__(self, norm: nn.LayerNorm, kernels: Kernels):
        super().__init__()
        self.weight, self.bias, self.kernels = norm.weight, norm.bias, kernels
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels.row_invariant:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        rows = x.reshape(-1, x.shape[-1])
        return torch.stack(
            [F.layer_norm(r, self.normalized_shape, self.weight, self.bias, self.eps) for r in rows.unbind(0)]
        ).reshape(x.shape)


class RoutedAttention(nn.Module):
    """refdec.model.ScaledDotProduct by `rowwise_attention` in row-invariant mode, and in float64 beside
    the int8 products (refdec.routes.int8, "Attention in float64")."""

    def __init__(self, heads: ScaledDotProduct, kernels: Kernels):
        super().__init__()
        self.scale, self.kernels = heads.scale, kernels

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocked: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kernel = rowwise_attention if self.kernels.row_invariant else attention
        if self.kernels.int8_now():
            return kernel(q.double(), k.double(), v.double(), blocked, self.scale, bias).to(q.dtype)
        return kernel(q, k, v, blocked, self.scale, bias)


class RoutedOutput(nn.Module):
    """refdec.model.OutputProduct, hidden (B, q, D) @ W (V, D).T, by the route's kernels (the int8
    route: W's int8 form, kept)."""

    def __init__(self, output: OutputProduct, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.int8_forms: dict = {}  # W's int8 form, kept

    def forward(self, hidden: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        if self.kernels.int8_now():
            return int8.linear(hidden, int8.kept(self.int8_forms, "W", W), None)
        if self.kernels.row_invariant:
            return rowwise_linear(hidden, W, None)
        return linear(hidden, W, None, self.kernels.few_rows)


LEAVES = {
    nn.Linear: RoutedLinear,
    nn.LayerNorm: RoutedLayerNorm,
    ScaledDotProduct: RoutedAttention,
    OutputProduct: RoutedOutput,
}


def twin(module: nn.Module, kernels: Kernels) -> nn.Module:
    """`module`'s tree again, in eval mode, holding `module`'s own parameters and buffers (not copies),
    each leaf of a type in LEAVES replaced by its routed form computing by `kernels`. The composite
    modules are copies (copy.deepcopy, every tensor kept as it is): their settings are the module's as
    it is now, and their training mode and hooks their own from then on. `module` is not changed."""
    own = {id(t): t for t in (*module.parameters(), *module.buffers())}
    tree = copy.deepcopy(module, own)
    for name, leaf in list(tree.named_modules()):
        routed = LEAVES.get(type(leaf))
        if routed is not None and name:
            parent, _, child = name.rpartition(".")
            setattr(tree.get_submodule(parent), child, routed(leaf, kernels))
    return tree.eval()


def placement(model: nn.Module) -> tuple:
    """Where a model's first parameter lives and in what dtype (a model moved or cast by .to() has new
    buffers, which a twin made before does not hold)."""
    p = next(model.parameters())
    return p.device, p.dtype


class Route:
    """What every route answers from the model it wraps: its configuration, its training mode (a route
    is in training mode exactly while its model is, and no decoder takes it then), eval() and its
    parameters."""

    model: Transformer

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self):
        self.model.eval()
        return self

    def parameters(self):
        return self.model.parameters()


class KernelRoute(Route):
    """Wraps a Transformer so that its calls compute by `kernels` (the module docstring): on its twin
    while the model is in eval mode; in training mode on the model itself (dropout is on, and no
    decoder takes a model in training mode: `training` is the model's). It offers the verbs a decoder
    calls (encode, new_cache, decode_hidden, project, decode, cfg) and teacher forcing (forward,
    forward_hidden). Beside the int8 products its cache is kept in float64, its attention's dtype."""

    def __init__(self, model: Transformer, kernels: Kernels):
        self.model, self.kernels = model, kernels
        self.twin, self.made_for = twin(model, kernels), placement(model)

    def __deepcopy__(self, memo: dict) -> KernelRoute:
        """A route of a copy of the model."""
        return KernelRoute(copy.deepcopy(self.model, memo), self.kernels)

    def refresh(self) -> None:
        """Make the twin again: after a write through `.data` in place, which no stamp sees
        (refdec.routes.stamps), its int8 forms are made anew from the weights as they are."""
        self.twin, self.made_for = twin(self.model, self.kernels), placement(self.model)

    @property
    def reference(self) -> KernelRoute:
        """Where this route computes a call on the model's own layers: every call, so itself (a
        FastRoute's `reference` is the KernelRoute it hands the calls it does not take; a family the
        fast route does not write gets a KernelRoute from on_route(model, "fast"), whose own is this)."""
        return self

    def computing(self) -> nn.Module:
        """The module that computes a call: the model itself in training mode, else the twin."""
        return self.model if self.model.training else self.twin

    def starting(self) -> nn.Module:
        """computing() for a call that starts a decoding call or a teacher-forced pass (an encoder pass,
        a memory attached): the twin made again first if the model has been moved or cast since, a
        check kept out of the decoder steps that follow."""
        if placement(self.model) != self.made_for:
            self.refresh()
        return self.computing()

    def encode(self, src: torch.Tensor) -> Memory:
        return self.starting().encode(src)

    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.starting().encode_states(src)

    def attach(self, states: torch.Tensor, src_pad: torch.Tensor) -> Memory:
        return self.starting().attach(states, src_pad)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        if self.kernels.int8_now():  # made in float64 alone: not the model's dtype first
            return KVCache(
                self.cfg.dec_layers,
                batch,
                self.cfg.n_heads,
                self.cfg.head_dim,
                capacity,
                device=self.model.tgt_embed.weight.device,
                dtype=torch.float64,
            )
        return self.model.new_cache(batch, capacity)

    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,
        layers: int | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.computing().decode_hidden(tgt_new, memory, cache, open_from, layers, real)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.computing().project(hidden)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache))

    def forward_hidden(
        self, src: torch.Tensor, tgt: torch.Tensor, self_block: torch.Tensor | None = None, memory: Memory | None = None
    ) -> torch.Tensor:
        return self.starting().forward_hidden(src, tgt, self_block, memory)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.starting()(src, tgt)

    __call__ = forward


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
