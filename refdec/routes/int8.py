"""The int8 route: the linear maps of the encoder and the decoder, the output projection included, as
8-bit integer products, each row's result independent of every other row in the call.

A linear map y = x W^T + b is computed as

    x_q = round(x / s_x),  s_x = max |x_row| / 127   one scale per row of x (per position), from that row alone
    W_q = round(W / s_W),  s_W = max |W_out| / 127   one scale per output channel, made once per weight
    y   = (x_q @ W_q^T) * s_W * s_x + b              the product in int32, exact, then the scales

Why per row, and why exact. PyTorch's dynamic quantization (`quantize_dynamic`) scales the
activations per tensor, from the whole input of the call, so a row's result depends on the rows
beside it: a verification call of q tokens would not compute what q greedy steps compute, and IAD
would not equal greedy on that route. Here every operation is either elementwise or a reduction
over one row whose result does not depend on the order of its terms (a maximum), and the product
accumulates integers exactly (|sum| <= in x 127 x 127 fits int32, and oneDNN's int8 product on CPU
sums it without saturating: refdec.routes.probes.weight_levels checks that once per process, and
gives 7-bit weights where it saturates at full range). So a row's output is a function of that row
alone: bitwise the same alone, beside 7 other rows, or as one position of a verification call.
Layer norms, residual sums and the scaling are per row or elementwise too.

Attention in float64. What is left is attention, whose kernels round by the call's shape (a
verification call's queries see their keys through a mask over a longer row; a batch pads its
sources): in float32 such a last-bit difference in a product's input can move a value across a
rounding boundary of the quantizer, and a one-unit change in one int8 value moves the logits by
~1e-2, not 1e-7; on UA-GEC that made batched IAD write another token than batched greedy on one line
of 500 (margin 0.03). So on the int8 route attention is computed in float64 (its cache and the
cross-attention's keys and values are kept in float64) and rounded back to the model's dtype: a
float64 difference of ~1e-16 changes the float32 result only when it straddles a float32 rounding
boundary (about 2^-29 of values), and a quantizer boundary after that. Every position's logits are
bitwise independent of the call's shape in row-invariant mode (`--int8 --invariant`, slower),
where attention sees exactly its own keys. The fast route's encoder on a CPU needs no float64: each
source attends over its own positions alone, in a call of its own shape (refdec.routes.fast.attend_each).

The alternative, weight-only int8 (`torch.ops.aten._weight_int8pack_mm`, float activations), was
measured and left out: its CPU kernel was several times slower than the float32 product on the
model's shapes (`python -m refdec int8bench` times it beside the others; docs/int8.md). The per-row
quantization above costs a handful of elementwise operations per product; from a few rows up (a
verification call, an encoder pass, a batch) the integer product saves more than they cost.

Products that read the same input (the encoder's queries, keys and values; the cross-attention's
keys and values of every layer) are one product of their weights side by side (`linears`): the same
values, since each output channel keeps its scale and the sums are exact, in fewer operations.

The product itself (`integer_products`, what product() computes the integer part by). Two kernels
compute the same values: torch._int_mm, then the int32 sums converted to floating point once and
times s_W in place (`rescale`), and oneDNN's fused int8 linear (`fused_kernel`, that is
`torch.ops.onednn.qlinear_pointwise`, on a CPU, float32) on weights packed for it once, which writes
the int32 product, converted and times s_W, in one pass; the rows' scales and the bias or residual
stream come after either, in one pass (`rescale` again). Which kernel is faster is a property of the
machine, not of the code (on some CPUs the fused one is several times faster, on others far slower:
`python -m refdec machine` prints what it finds here). So each weight shape's plan (`plan`, a
refdec.routes.probes.Plan) is asked of refdec.routes.probes, which finds it once per process and
thread count by timing both kernels on random operands of that shape (this module hands them over:
KERNELS), or reads it from a machine report: the fused kernel is taken from the row count where it
is faster (`takes_fused`), where it agrees bitwise with the plain form (checked once), and never
where it is not faster. A plain product too large for the cache may be computed in blocks of rows
(`row_blocks`), each block rescaled while its int32 sums are still in the cache: where the fused
kernel is not taken at that size (a CPU or a torch build without it, a CPU where it is slower,
float64 weights) and the probe found the blocks faster on this machine, and on other devices by size
alone. None of these choices changes a value: every row's sums are exact and its rescaling
elementwise, whichever kernel, block or plan computes it, so a timing that varies from run to run
never changes an output. A ReLU between two products is folded into the second one's quantization
(`quantize_relu_rows`, used by the fast route).

Taking the route: `on_route(model, route, int8=True)` (refdec.routes) wraps a model so that its linear
layers and output projection compute by these products: on the model's own layers (the reference
route's KernelRoute, refdec.routes.kernels, Kernels(int8=True); with row-invariant mode too,
`on_route(model, "invariant", int8=True)`, whose attention and norms then make every position's logits
independent of the call shape), or on the fast route's layout (`on_route(model, "fast", int8=True)`,
refdec.routes.fast). The model itself is not changed, so float runs and int8 runs read one model. Any
call with gradients on takes the floating-point products. The int8 weights belong to the route: made
from the weights as they are when first used, and made again when a weight has changed
(refdec.routes.stamps: a write through the parameter, a new tensor, any optimizer step, fused ones
included); a write through `.data` in place is not seen (call the route's `refresh()`, or wrap the model
again, after one).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from . import probes
from .stamps import stamp

LEVELS = 127  # symmetric int8: values -127 .. 127
JOIN_ELEMENTS = 1 << 17  # `linears` joins its products while their output holds at most this many values
# A plain product of more than this many output values may be computed in blocks of ROW_BLOCK rows, each
# block's integer product and rescaling in turn, where this machine's plan says so (`row_blocks`).
BLOCK_ELEMENTS = 1 << 18
ROW_BLOCK = 64


class QuantizedWeight:
    """A weight as an int8 (in, out) matrix with one scale per output channel, packed for oneDNN's
    fused product where that is used (`packed`, else None), and the stamp of the tensor it was made
    from (refdec.routes.stamps), so that `current` can tell whether it still holds that tensor's values."""

    def __init__(self, w_in_out: torch.Tensor, source: torch.Tensor):
        w = w_in_out.detach()
        self.scale = (w.abs().amax(0) / probes.weight_levels()).clamp_min(torch.finfo(w.dtype).tiny)  # (out,)
        # (in, out), a view of an (out, in) contiguous matrix: oneDNN's int8 product reads it faster
        # that way than a contiguous (in, out) one
        self.q = torch.round(w / self.scale).to(torch.int8).t().contiguous().t()
        self.packed = pack(self.q, self.scale)
        self.key = stamp(source)

    def current(self, source: torch.Tensor) -> bool:
        return self.key == stamp(source)

    def __deepcopy__(self, memo: dict) -> QuantizedWeight:
        return copied(self, memo)


def copied(weight, memo: dict):
    """A deep copy of a QuantizedWeight or JoinedWeight: its tensors copied, its packed form made again
    from them (an opaque oneDNN tensor, which copy.deepcopy cannot copy)."""
    other = copy.copy(weight)
    other.scale, other.q = copy.deepcopy(weight.scale, memo), copy.deepcopy(weight.q, memo)
    if isinstance(weight, JoinedWeight):
        other.parts = copy.deepcopy(weight.parts, memo)
    other.packed = None if weight.packed is None else pack(other.q, other.scale)
    return other


def kept(holder: dict, name: str, weight: torch.Tensor) -> QuantizedWeight:
    """The int8 form of `weight` (out, in) that `holder` keeps as `name`, made again when the weight
    has changed since."""
    got = holder.get(name)
    if got is None or not got.current(weight):
        got = holder[name] = QuantizedWeight(weight.t(), weight)
    return got


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (M, K) int8 and (M, 1) scales, each row scaled by its own largest magnitude
    (a row of zeros gets the smallest normal scale and stays zeros)."""
    scale = x.abs().amax(1, keepdim=True).div_(LEVELS).clamp_min_(torch.finfo(x.dtype).tiny)
    return torch.div(x, scale).round_().to(torch.int8), scale


def quantize_relu_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(relu(y)), bitwise, without computing relu(y) or its magnitudes: a row's largest
    magnitude after the ReLU is max(0, its largest value), and a negative value, which the ReLU
    makes 0, rounds to a value <= 0 that the clamp makes 0. Two passes over y fewer (the ReLU's and
    abs's), for the feed-forward's second product, whose input is the widest (refdec.routes.fast)."""
    scale = y.amax(1, keepdim=True).clamp_min_(0).div_(LEVELS).clamp_min_(torch.finfo(y.dtype).tiny)
    return torch.div(y, scale).round_().clamp_min_(0).to(torch.int8), scale


def product(
    x: torch.Tensor,
    w: QuantizedWeight | JoinedWeight,
    add: torch.Tensor | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`add` + x (M, K) float @ the quantized weight -> (M, N) in x's dtype: the int32 product, exact,
    times each output's scale, times each row's scale, plus `add` ((N,) a bias, or (M, N) the
    residual stream; none: zero). `rows`: quantize_rows(x), when several products read the same x.
    Each output element goes through the same elementwise operations whatever the other rows, and
    whichever kernel computes its integer product, with all the rows or in a block of them
    (`integer_products`)."""
    xq, sx = quantize_rows(x) if rows is None else rows
    out = None
    for b, p in integer_products(xq, w):
        if b is None:  # all the rows at once
            return rescale(p, sx, w.scale, add)
        if out is None:
            out = torch.empty(xq.shape[0], w.scale.shape[0], dtype=sx.dtype, device=sx.device)
        rescale(p, sx[b], w.scale, add if add is None or add.dim() == 1 else add[b], out[b])
    return out


def integer_products(
    xq: torch.Tensor, w: QuantizedWeight | JoinedWeight
) -> Iterator[tuple[slice | None, torch.Tensor]]:
    """The integer product of xq (M, K) int8 and w as product() computes it, one block of rows at a
    time: yields (rows, their product), rows None for all M at once. oneDNN's fused kernel where this
    machine's plan takes it (`takes_fused`): all M rows, the int32 sums already converted and times the
    channel scales (float32); else torch._int_mm's int32 sums, all M rows or, where `blocks_for` says,
    blocks of ROW_BLOCK rows, the next block computed only once the caller has rescaled this one (while
    it is in the cache). `python -m refdec stepcost --int8` times these calls alone."""
    if takes_fused(xq, w):
        yield None, fused_kernel(xq, *w.packed, w.scale)
        return
    blocks = blocks_for(xq.shape[0], w)
    if len(blocks) == 1:
        yield None, torch._int_mm(xq, w.q)
        return
    for b in blocks:
        yield b, torch._int_mm(xq[b], w.q)


def blocks_for(m: int, w: QuantizedWeight | JoinedWeight) -> list[slice]:
    """The blocks of rows an m-row plain product with w is computed in: on a CPU as this machine's plan
    for w's shape says (`plan`), on other devices by size alone."""
    return row_blocks(m, w.scale.shape[0], w.q.device.type != "cpu" or plan(*w.q.shape).blocks)


def row_blocks(m: int, n: int, blocks: bool = True) -> list[slice]:
    """The blocks of rows an (m, n) plain product is computed in: all m rows at once, or, where `blocks`
    (the plan's choice) and the result holds more than BLOCK_ELEMENTS values, blocks of ROW_BLOCK rows."""
    if not blocks or m * n <= BLOCK_ELEMENTS:
        return [slice(0, m)]
    return [slice(i, i + ROW_BLOCK) for i in range(0, m, ROW_BLOCK)]


def blocked_from(n: int) -> int:
    """The fewest rows from which an (m, n) plain product goes in blocks where a plan takes them: a
    multiple of ROW_BLOCK, two blocks at least (where the probe times blocks against the whole product)."""
    return max(2 * ROW_BLOCK, -(-(BLOCK_ELEMENTS + 1) // (n * ROW_BLOCK)) * ROW_BLOCK)


def rescale(
    p: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, add: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`add` + the product p (M, N) times the channel scales sw (N,) and the row scales sx (M, 1), in
    sx's dtype, into `out` (M, N) (none: a new tensor, or p itself where p is the fused kernel's):
    float(p) * sw first, as oneDNN's fused kernel computes it, which hands over p already so (float32,
    not int32: only the rows' scales and `add` are left). The int32 values are converted once and then
    scaled in place: `int32 * float` would convert them inside the multiply on a slower path, and a
    fresh buffer per operation is paid for in page faults and cache misses."""
    if p.dtype == torch.int32:
        p = (p.to(sx.dtype) if out is None else out.copy_(p)).mul_(sw)
    return p.mul_(sx) if add is None else torch.addcmul(add, p, sx, out=p)


# -- oneDNN's fused product ------------------------------------------------------------------------------
def takes_fused(xq: torch.Tensor, w: QuantizedWeight | JoinedWeight) -> bool:
    """Whether product() computes xq (M, K) int8 @ w by oneDNN's fused kernel: w is packed for it (`pack`)
    and this machine's plan for w's shape takes it from M rows on."""
    if w.packed is None:
        return False
    start = plan(*w.q.shape).fused_from
    return start is not None and xq.shape[0] >= start


def fused_kernel(
    xq: torch.Tensor, packed: torch.Tensor, zero_points: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """float(xq @ W_q) * scale (M, N) in float32, in one call of oneDNN's int8 linear on W_q packed for it
    (`onednn_packed`), with no input scale (1.0), no bias and zero points of zero, so that each value is
    the int32 sum converted and times its channel's scale, as `rescale` computes it."""
    return torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def onednn_packed(q_in_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 (in, out) weight packed for oneDNN's int8 linear, and its zero points (zeros)."""
    with torch.inference_mode(False), torch.no_grad():
        return (
            torch.ops.onednn.qlinear_prepack(q_in_out.t().contiguous(), None),
            torch.zeros(q_in_out.shape[1], dtype=torch.long),
        )


def fused_available() -> bool:
    """Whether this torch build has oneDNN's fused int8 linear at all."""
    return hasattr(getattr(torch.ops, "onednn", None), "qlinear_pointwise") and torch.backends.mkldnn.is_available()


def pack(q_in_out: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """onednn_packed(q_in_out) where the fused product may be taken: a float32 weight on a CPU whose plan
    for this shape takes it (`plan`: faster here, and bitwise the plain form); else None."""
    if scale.dtype != torch.float32 or scale.device.type != "cpu" or plan(*q_in_out.shape).fused_from is None:
        return None
    return onednn_packed(q_in_out)


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N): the int8 product plus the bias."""
    y = product(x.reshape(-1, x.shape[-1]), w, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linears(
    x: torch.Tensor, weights: list[QuantizedWeight], biases: list[torch.Tensor], holder: dict, key
) -> list[torch.Tensor]:
    """[linear(x, w, b) for each weight] for x (M, K), as one product of the weights side by side
    (their JoinedWeight, kept in `holder` as `key`: `joined`): bitwise the same outputs, since the int32
    sums are exact and every output channel keeps its own scale and bias, in one integer product and one
    rescaling instead of one per weight. Each result is a column block of that product (a view). Many
    rows (a batch's encoder pass) take one product per weight, x quantized once: their outputs stay
    small enough for the cache."""
    outs = sum(w.scale.shape[0] for w in weights)
    if len(weights) == 1 or any(b is None for b in biases) or x.shape[0] * outs > JOIN_ELEMENTS:
        rows = quantize_rows(x)
        return [product(x, w, b, rows) for w, b in zip(weights, biases)]
    y = product(x, joined(holder, key, weights), torch.cat(biases))
    return list(y.split([w.scale.shape[0] for w in weights], 1))


class JoinedWeight:
    """Quantized weights of one input side by side: an (in, sum of outs) int8 matrix (laid out as
    QuantizedWeight's) and their channel scales, and the weights it was made from."""

    def __init__(self, weights: list[QuantizedWeight]):
        self.parts = list(weights)
        self.scale = torch.cat([w.scale for w in weights])
        self.q = torch.cat([w.q.t() for w in weights]).t()  # each part (out, in) contiguous: so is their stack
        self.packed = pack(self.q, self.scale)

    def __deepcopy__(self, memo: dict) -> JoinedWeight:
        return copied(self, memo)

    def of(self, weights: list[QuantizedWeight]) -> bool:
        """Whether it was made from these very QuantizedWeights (a weight written since has a new one)."""
        return len(self.parts) == len(weights) and all(a is b for a, b in zip(self.parts, weights))


def joined(holder: dict, key, weights: list[QuantizedWeight]) -> JoinedWeight:
    """The weights side by side, kept in `holder` (a route's) as `key` and made again when one of them
    is a new QuantizedWeight."""
    got = holder.get(key)
    if got is None or not got.of(weights):
        got = holder[key] = JoinedWeight(weights)
    return got


# -- which kernel computes a product: this machine's plan ---------------------------------------------------
# What refdec.routes.probes times and checks to make this machine's plans: the very calls product() makes.
KERNELS = probes.Int8Kernels(rescale, fused_kernel, onednn_packed, fused_available, row_blocks, blocked_from)


def plan(k: int, n: int) -> probes.Plan:
    """This machine's plan for products with a (k, n) int8 weight at the current thread count, asked of
    refdec.routes.probes (plan_for: read from a machine report, or found by timing KERNELS on that shape
    at the first call, then kept for the process)."""
    return probes.plan_for(k, n, KERNELS)


# -- the fast route's layout ------------------------------------------------------------------------------
PRODUCTS = ("qkv", "o", "cq", "co", "w1", "w2")  # refdec.routes.fast.DecoderWeights' matrices, each (in, out)


class Int8Layout:
    """refdec.routes.fast.DecoderWeights with each of its matrices, the vocabulary's included, in int8 form;
    norms, biases and activations are the layout's own. Made again when the layout is made again (the
    layout is a copy, made again whenever a weight it was made from has changed)."""

    def __init__(self, weights):
        self.source = weights
        self.layers = [
            {**w, **{k: QuantizedWeight(w[k].in_out, w[k].in_out) for k in PRODUCTS}} for w in weights.layers
        ]
        self.vocab = QuantizedWeight(weights.vocab.in_out, weights.vocab.in_out)

    def current(self, weights) -> bool:
        """Whether it was made from this layout (a layout made again after a weight changed is a new one)."""
        return weights is self.source
