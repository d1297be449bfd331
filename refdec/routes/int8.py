"""The int8 route: the linear maps of the encoder and the decoder, the output projection included, as
8-bit integer products, each row's result independent of every other row in the call.

A linear map y = x W^T + b is computed as

    x_q = round(x / s_x),  s_x = max |x_row| / 127   one scale per row of x (per position), from that row alone
    W_q = round(W / s_W),  s_W = max |W_out| / 127   one scale per output channel, made once per weight
    y   = (x_q @ W_q^T) * s_x * s_W + b              the product in int32 (torch._int_mm), exact

Why per row, and why exact. PyTorch's dynamic quantization (`quantize_dynamic`) scales the
activations per tensor, from the whole input of the call, so a row's result depends on the rows
beside it: a verification call of q tokens would not compute what q greedy steps compute, and IAD
would not equal greedy on that route. Here every operation is either elementwise or a reduction
over one row whose result does not depend on the order of its terms (a maximum), and the product
accumulates integers exactly (|sum| <= in x 127 x 127 fits int32, and oneDNN's int8 product on CPU
sums it without saturating: `exact_products` checks that once per process). So a row's output is a
function of that row alone: bitwise the same alone, beside 7 other rows, or as one position of a
verification call. Layer norms, residual sums and the scaling are per row or elementwise too.

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
where attention sees exactly its own keys.

The alternative, weight-only int8 (`torch.ops.aten._weight_int8pack_mm`, float activations), was
measured and left out: its CPU kernel took 3-10x the float32 product's time at one row and 30-50x
at 32 rows on the model's shapes (docs/int8.md). The per-row quantization above costs a handful of
elementwise operations per product, a few microseconds each; from a few rows up (a verification
call, an encoder pass, a batch) the integer product saves more than they cost.

Products that read the same input (the encoder's queries, keys and values; the cross-attention's
keys and values of every layer) are one product of their weights side by side (`linears`): the same
values, since each output channel keeps its scale and the sums are exact, in fewer operations.

Switching: `set_int8_route(model)` (refdec.routes.kernels) gives every linear layer of each Transformer in `model` its int8
weight and the output projection its int8 embedding; `set_int8_route(model, False)` takes them
away. The route combines with the reference route (refdec.model, refdec.routes.kernels) and with the fast
route (refdec.routes.fast), whichever the model is on, and with row-invariant mode (whose attention and
norms then make every position's logits independent of the call shape). Training and any call with
gradients on take the floating-point products. The int8 weights are made from the weights as they
are when first used and made again when a weight has been written in place through the parameter
(an optimizer step, load_state_dict) or given a new tensor; a write through `.data` in place is not
seen (switch the route off and on again after one).
"""

from __future__ import annotations

import weakref

import torch

LEVELS = 127  # symmetric int8: values -127 .. 127
JOIN_ELEMENTS = 1 << 17  # `linears` joins its products while their output holds at most this many values
# From this many output values on, `product` converts the int32 product to float and scales that in
# place (the same values): `int32 * float` makes a float copy of the whole product beside its result,
# and a batch's vocabulary projection (16 MB each) pays for every fresh buffer in page faults.
IN_PLACE_ELEMENTS = 1 << 16


class QuantizedWeight:
    """A weight as an int8 (in, out) matrix with one scale per output channel, and the tensor it was
    made from, so that `current` can tell whether it still holds that tensor's values."""

    def __init__(self, w_in_out: torch.Tensor, source: torch.Tensor):
        w = w_in_out.detach()
        self.scale = (w.abs().amax(0) / weight_levels()).clamp_min(torch.finfo(w.dtype).tiny)  # (out,)
        # (in, out), a view of an (out, in) contiguous matrix: oneDNN's int8 product reads it fastest
        # that way (2-3x faster than a contiguous (in, out) one for the vocabulary, 192 x 8000)
        self.q = torch.round(w / self.scale).to(torch.int8).t().contiguous().t()
        self.key = stamp(source)

    def current(self, source: torch.Tensor) -> bool:
        return self.key == stamp(source)


def stamp(t: torch.Tensor) -> tuple:
    """What identifies a tensor's values without reading them: its memory, shape, dtype and the
    version counter that every in-place write through it (or through a view of it) advances."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (M, K) int8 and (M, 1) scales, each row scaled by its own largest magnitude
    (a row of zeros gets the smallest normal scale and stays zeros)."""
    scale = x.abs().amax(1, keepdim=True).div_(LEVELS).clamp_min_(torch.finfo(x.dtype).tiny)
    return torch.div(x, scale).round_().to(torch.int8), scale


def product(x: torch.Tensor, w: "QuantizedWeight | JoinedWeight", add: torch.Tensor | None = None,
            rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`add` + x (M, K) float @ the quantized weight -> (M, N) in x's dtype: the int32 product, exact,
    times each row's scale, times each output's scale, plus `add` ((N,) a bias, or (M, N) the
    residual stream; none: zero). `rows`: quantize_rows(x), when several products read the same x.
    Each output element goes through the same elementwise operations whatever the other rows."""
    xq, sx = quantize_rows(x) if rows is None else rows
    if xq.shape[0] * w.scale.shape[0] < IN_PLACE_ELEMENTS:
        scaled = torch._int_mm(xq, w.q) * sx
    else:  # the same values, without a float copy of the int32 product beside the result (IN_PLACE_ELEMENTS)
        scaled = torch._int_mm(xq, w.q).to(sx.dtype).mul_(sx)
    return scaled.mul_(w.scale) if add is None else torch.addcmul(add, scaled, w.scale)


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N): the int8 product plus the bias."""
    y = product(x.reshape(-1, x.shape[-1]), w, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linears(x: torch.Tensor, weights: list[QuantizedWeight], biases: list[torch.Tensor]) -> list[torch.Tensor]:
    """[linear(x, w, b) for each weight] for x (M, K), as one product of the weights side by side
    (`joined`): bitwise the same outputs, since the int32 sums are exact and every output channel
    keeps its own scale and bias, in one integer product and one rescaling instead of one per weight.
    Each result is a column block of that product (a view). Many rows (a batch's encoder pass) take
    one product per weight, x quantized once: their outputs stay small enough for the cache."""
    outs = sum(w.scale.shape[0] for w in weights)
    if len(weights) == 1 or any(b is None for b in biases) or x.shape[0] * outs > JOIN_ELEMENTS:
        rows = quantize_rows(x)
        return [product(x, w, b, rows) for w, b in zip(weights, biases)]
    y = product(x, joined(weights), torch.cat(biases))
    return list(y.split([w.scale.shape[0] for w in weights], 1))


class JoinedWeight:
    """Quantized weights of one input side by side: an (in, sum of outs) int8 matrix (laid out as
    QuantizedWeight's) and their channel scales, and which weights it was made from (weakly)."""

    def __init__(self, weights: list[QuantizedWeight]):
        self.parts = [weakref.ref(w) for w in weights]
        self.scale = torch.cat([w.scale for w in weights])
        self.q = torch.cat([w.q.t() for w in weights]).t()  # each part (out, in) contiguous: so is their stack


_JOINED: "weakref.WeakKeyDictionary[QuantizedWeight, JoinedWeight]" = weakref.WeakKeyDictionary()


def joined(weights: list[QuantizedWeight]) -> JoinedWeight:
    """The weights side by side, made once for these very QuantizedWeights (a weight written since
    gets a new QuantizedWeight, so a new joined one); kept while the first of them lives."""
    kept = _JOINED.get(weights[0])
    if kept is None or len(kept.parts) != len(weights) or any(a() is not b for a, b in zip(kept.parts, weights)):
        kept = _JOINED[weights[0]] = JoinedWeight(weights)
    return kept


# -- the int8 product's exactness on this CPU -----------------------------------------------------------
_LEVELS_FOR_WEIGHTS: list[int] = []


def weight_levels() -> int:
    """127, or 63 if this CPU's int8 product saturates at full range (x86 without VNNI sums pairs of
    u8 x s8 products in int16; 7-bit weights keep those sums in range, as fbgemm's reduce_range does)."""
    if not _LEVELS_FOR_WEIGHTS:
        _LEVELS_FOR_WEIGHTS.append(next((n for n in (127, 63) if exact_products(n)), 0))
        if not _LEVELS_FOR_WEIGHTS[0]:
            raise RuntimeError("torch._int_mm does not compute int8 products exactly on this machine; "
                               "the int8 route cannot run here (decode without --int8)")
    return _LEVELS_FOR_WEIGHTS[0]


def exact_products(levels: int) -> bool:
    """Whether torch._int_mm equals the int64 product on extreme and random int8 operands, weights
    within +-levels, for a few shapes (one row, a few rows, many)."""
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 768, 24), (5, 256, 40), (64, 1024, 16)):
        x = torch.randint(-LEVELS, LEVELS + 1, (m, k), generator=g, dtype=torch.int8)
        w = torch.randint(-levels, levels + 1, (k, n), generator=g, dtype=torch.int8)
        x[0], w[:, 0] = LEVELS, -levels  # the largest sums
        x[-1, ::2], x[-1, 1::2] = -LEVELS, LEVELS
        if not torch.equal(torch._int_mm(x, w).long(), x.long() @ w.long()):
            return False
    return True


# -- the switch -------------------------------------------------------------------------------------------
class Int8Route:
    """Marks a layer (refdec.routes.kernels' RoutedLinear, the model's vocabulary projection) that takes
    the int8 product when `int8` is on; `set_int8_route` switches them per model."""

    int8 = False
    int8_weights: dict | None = None  # name -> QuantizedWeight, made at first use

    def int8_active(self) -> bool:
        return self.int8 and not (self.training or torch.is_grad_enabled())

    def quantized(self, name: str, source: torch.Tensor, in_out: bool = False) -> QuantizedWeight:
        """The int8 form of `source` ((out, in), or (in, out) with `in_out`), kept as `name` and made
        again when `source` has changed since."""
        if self.int8_weights is None:
            self.int8_weights = {}
        kept = self.int8_weights.get(name)
        if kept is None or not kept.current(source):
            kept = self.int8_weights[name] = QuantizedWeight(source if in_out else source.t(), source)
        return kept


# -- the fast route's layout ------------------------------------------------------------------------------
PRODUCTS = ("qkv", "o", "cq", "co", "w1", "w2")  # refdec.routes.fast.DecoderWeights' matrices, each (in, out)


class Int8Layout:
    """refdec.routes.fast.DecoderWeights with each of its matrices, the vocabulary's included, in int8 form;
    norms, biases and activations are the layout's own. Made again when the layout is made again, or
    when one of its matrices has been written in place (its version counter, which a write through
    parameter laid out in it advances: each parameter keeps a counter of its own)."""

    def __init__(self, weights):
        self.source = weights
        self.layers = [{**w, **{k: QuantizedWeight(w[k], w[k]) for k in PRODUCTS}} for w in weights.layers]
        self.vocab = QuantizedWeight(weights.vocab, weights.vocab)
        self.versions = versions(weights)

    def current(self, weights) -> bool:
        return (weights is self.source and self.versions == versions(weights) and self.vocab.current(weights.vocab)
                and all(q[k].current(w[k]) for q, w in zip(self.layers, weights.layers) for k in PRODUCTS))


def versions(weights) -> list[int]:
    """The version counters of the parameters a refdec.routes.fast.DecoderWeights holds."""
    return [p._version for p, _, _ in weights.places]
