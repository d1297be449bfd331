"""The fast route: the same Transformer computed with fewer, larger operations.

refdec.model writes the Transformer as the paper describes it, one module per idea, and that is the
route a learner reads and every exactness test is written against. On a CPU, at the sizes refdec
trains (d_model 192-512, a few layers), a decoder call that appends one token is a few hundred small
operations, and their count, not their arithmetic, sets its cost: each torch operation costs a few
microseconds of dispatch whatever its size, and a one-row matrix product reads its weights from
memory rather than computing. The fast route computes the same mathematics with fewer of them:

  * the weights laid out as a call reads them (DecoderWeights, EncoderWeights): contiguous (in, out)
    matrices, a self-attention layer's queries, keys and values side by side so that one product
    makes all three, every decoder layer's cross-attention keys and values side by side (one product
    per source), the output embedding as (D, V): a copy of the parameters, the route's own;
  * PyTorch's fused attention (`F.scaled_dot_product_attention`, one call) instead of a product,
    a scale, a mask fill, a softmax and a second product;
  * each linear map one product on (N, D) rows, on the kernel this machine's float plan names for N
    rows (refdec.routes.products: torch's `addmm`, oneDNN's on a packed weight, numpy's OpenBLAS), the
    residual sum done by the output projection's product itself (torch's `addmm(x, h, W.T)`, OpenBLAS's
    beta term);
  * no module calls, hooks, dropout or mode checks inside the layer loop;
  * in a ragged batch (a batched verification call of drafts of different lengths), every linear map
    and norm on the real positions alone: padding is attended over as zeros, never multiplied; in a
    batch of sources of different lengths, the encoder's likewise, and on a CPU each source's
    self-attention over its own positions alone (`attend_each`): the padding's states are zeros;

It writes into the same KVCache with the same verbs (append, advance; the decoders truncate, select and
clone it as before), takes the same arguments, and returns the same shapes, so every decoder runs on it
unchanged. It is a route, not a model: `on_route(model, "fast")` (refdec.routes) wraps a Transformer in
a FastRoute, which offers the verbs a decoder calls (encode, new_cache, decode_hidden, project, decode,
cfg), leaving the model as it is. The route holds its own copy of the decoder's weights in the layout
above, made from the parameters when first used and made again when one of them has changed
(refdec.routes.stamps), and hands each decoding call the layout it checked in the Memory it returns
(LaidOutMemory). Where the route does not apply it hands the call to the model's own layers on the
few-row kernels (a KernelRoute, refdec.routes.kernels: its `reference`), explicitly: while training or with
gradients on, for an early exit (`layers`) or a drafter's block of masks (`open_from`); it is not made
for model families whose layers it does not write (RMS norm, gated feed-forward, T5's relative positions
and unscaled attention: see `applies_to`). On the int8 route (`on_route(model, "fast", int8=True)`) it
computes the same layout's products in int8 (refdec.routes.int8). After a write through `.data` in
place, which no stamp sees, `refresh()` makes every kept form again.

The route computes the same sums in another order (a fused attention kernel, the bias added after
the residual, another product kernel), so its float32 logits differ from the reference route's in the
last bits, as the reference route's own differ between call shapes; in float64 the two differ by
~1e-15 (the tests compare them with a tolerance), and every lossless decoder on the fast route equals
greedy on the fast route (torch.equal). On a real test set, `python -m refdec ctranslate2 --fast` reports how often
float32 fast greedy writes the reference route's output, and the logit margin at every divergence.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache, Memory
from ..config import ModelConfig
from ..forced import before_source
from ..model import Transformer
from . import int8, probes
from .int8 import Int8Layout, QuantizedWeight
from .kernels import KernelRoute, Kernels, Route
from .products import FloatWeight, product
from .stamps import stamp


def applies_to(cfg: ModelConfig) -> bool:
    """Whether the fast route writes this configuration's layers: layer norm, an ungated feed-forward
    network with biases, scaled attention and absolute positions (the paper's model, Marian, BART, mBART,
    M2M100 and NLLB; not T5)."""
    return (
        cfg.norm == "layer"
        and cfg.bias
        and not cfg.gated_ff
        and cfg.scale_attention
        and cfg.positions != "relative"
        and not cfg.rescale_head
    )


def in_out(layer: nn.Linear) -> torch.Tensor | QuantizedWeight:
    """The layer's weight as (in, out): a view, x @ in_out(layer) is the layer's product; for a layer
    on the int8 kernels (refdec.routes.kernels) its int8 form."""
    return layer.int8_weight() if layer.kernels.int8_now() else layer.weight.t()


def linear(x: torch.Tensor, w: FloatWeight | QuantizedWeight, b: torch.Tensor) -> torch.Tensor:
    """x (N, in) @ w (in, out) + b, on the kernel this machine takes for it (refdec.routes.products)."""
    if isinstance(w, QuantizedWeight):
        return int8.linear(x, w, b)
    return product(x, w, b)


def linears(x: torch.Tensor, layers: list[nn.Linear], joined: dict) -> list[torch.Tensor]:
    """[x @ in_out(m) + m.bias for m in layers] for x (N, in), on the int8 route: x is quantized once and
    the weights side by side are kept in `joined` (the route's)."""
    weights, biases = [in_out(m) for m in layers], [m.bias for m in layers]
    return int8.linears(x, weights, biases, joined, tuple(id(m) for m in layers))


def residual_linear(
    x: torch.Tensor, h: torch.Tensor, w: FloatWeight | QuantizedWeight, b: torch.Tensor
) -> torch.Tensor:
    """x + (h @ w + b) (int8: the product added to x, then the bias)."""
    if isinstance(w, QuantizedWeight):
        return int8.product(h, w, x).add_(b)
    return product(h, w, b, add=x)


def norm_args(norm: nn.LayerNorm) -> tuple:
    """A layer norm's arguments after the input, as F.layer_norm takes them: F.layer_norm(x, *norm_args(norm))."""
    return norm.normalized_shape, norm.weight, norm.bias, norm.eps


def heads(x: torch.Tensor, B: int, n: int, H: int) -> torch.Tensor:
    return x.view(B, n, H, -1).transpose(1, 2)  # (B*n, H*Dh) -> (B, H, n, Dh)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    x: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries q (B, H, q, Dh) over k, v (B, H, L, Dh), `allowed` True = may attend,
    through the output projection wo (in, out), bo, added to the residual stream x (B*q, D), or with
    `rows` to x (N, D) of those positions of the (B*q) queries alone (a ragged call's real ones). On the
    int8 route the attention is computed in float64 (refdec.routes.int8, "Attention in float64")."""
    if isinstance(wo, QuantizedWeight):  # k, v: float64 already when they come from the cache or the Memory
        a = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
        a = a.transpose(1, 2).to(x.dtype, memory_format=torch.contiguous_format)  # (B, q, H, Dh): one copy
    else:
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)  # (B, q, H, Dh)
    a = a.reshape(-1, a.shape[-2] * a.shape[-1])  # (B*q, H*Dh)
    return residual_linear(x, a if rows is None else a.index_select(0, rows), wo, bo)


def attend_each(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    H: int,
    x: torch.Tensor,
    wo: torch.Tensor | QuantizedWeight,
    bo: torch.Tensor,
) -> torch.Tensor:
    """Self-attention of a batch of sequences laid end to end, q, k, v (N, H*Dh) with sequence i
    `lengths[i]` rows long, each sequence over its own keys alone (no padding, no mask: what the
    sequence alone computes), through wo, bo, added to x (N, D). A batch of sources of different
    lengths padded to the longest would spend most of its attention on padding.

    A sequence's result must depend on its own values and length alone, bitwise, whatever else is in
    the batch: the int8 route computes it in the model's dtype, not in float64 as its decoder's
    attention is (refdec.routes.int8, "Attention in float64"), so that the encoder of a source alone and
    in any batch writes the same states. Each sequence alone in a call of its own holds that by
    construction (one call shape per length). Neighbours of one length in one call (a batch cut from
    lines sorted by length has many) hold it only where PyTorch's CPU attention kernel computes each
    (sequence, head) of a call the same way whatever the call's batch size, which is a property of the
    machine and of the shapes: on an AMD EPYC with AVX-512 at 2 threads it does not hold for 4 heads of
    8 dimensions at odd lengths of 9 to 31 (a sequence alone rounds otherwise than beside others), and
    holds for 4 heads of 48. So neighbours go in one call only where this machine holds it for that
    length, count, shape and thread count (refdec.routes.probes.grouping_holds, which checks it on
    `attend_together`; `python -m refdec machine` lists them)."""
    q, k, v = (y.view(y.shape[0], H, -1) for y in (q, k, v))  # (N, H, Dh)
    a = x.new_empty(q.shape)  # (N, H, Dh)
    start = 0
    for n, run in itertools.groupby(length for length in lengths if length):  # (an empty one has no rows)
        r = len(list(run))  # r neighbours of n rows each: in one call, or each alone
        grouped = r > 1 and probes.grouping_holds(n, r, q.shape[1], q.shape[2], q.dtype, attend_together)
        step = n * r if grouped else n
        for first in range(start, start + n * r, step):
            span = slice(first, first + step)
            attend_together(q[span], k[span], v[span], n, a[span])
        start += n * r
    return residual_linear(x, a.view(x.shape[0], -1), wo, bo)


def attend_together(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """Attention of r sequences of n rows each, q, k, v (r*n, H, Dh) laid end to end, each over its own
    keys, in one call of shape (r, H, n, Dh), written into out (r*n, H, Dh)."""
    q_, k_, v_ = (y.view(-1, n, *y.shape[1:]).transpose(1, 2) for y in (q, k, v))
    out.view(-1, n, *out.shape[1:]).copy_(F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2))


def feed_forward(ff: dict, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x + FeedForward(h); `ff` holds w1, b1, w2, b2 (weights (in, out)) and act. On int8 a ReLU is
    folded into the second product's quantization (refdec.routes.int8.quantize_relu_rows: the same
    values, two passes over the widest activations fewer)."""
    if isinstance(ff["w2"], QuantizedWeight) and ff["act"] is F.relu:
        y = int8.linear(h, ff["w1"], ff["b1"])
        return int8.product(y, ff["w2"], x, int8.quantize_relu_rows(y)).add_(ff["b2"])
    if isinstance(ff["w1"], FloatWeight) and ff["act"] is F.relu:  # the ReLU in the product's pass where it can be
        return residual_linear(x, product(h, ff["w1"], ff["b1"], relu=True), ff["w2"], ff["b2"])
    return residual_linear(x, ff["act"](linear(h, ff["w1"], ff["b1"])), ff["w2"], ff["b2"])


def decoder_stack(
    layers: list[dict],
    x: torch.Tensor,
    B: int,
    q: int,
    H: int,
    store,
    allowed: torch.Tensor | None,
    cross_kv: list,
    src_allowed: torch.Tensor | None,
    rows: torch.Tensor | None,
    pre: bool,
) -> torch.Tensor:
    """The decoder layers (DecoderWeights.layers) of one call over the residual stream x (B*q, D) of q
    new positions per row: `store(i, k, v)` keeps layer i's new keys and values (B, H, q, Dh) and
    returns the keys and values its self-attention reads (a KVCache's append), `allowed` masks them
    (True = may attend), cross_kv and src_allowed are the encoder's; `pre` pre-norm x + f(norm(x)),
    else post-norm norm(x + f(x)) (refdec.model.Sublayer).

    `rows` (N,): a ragged call's real positions among the B*q (None: every one). Then the residual
    stream holds those N rows alone and every linear map and norm reads them alone; attention takes
    its queries, keys and values laid out (B, H, q, Dh) with zeros at the padded positions, which
    come after every real one of their row (causal attention keeps them out of the real queries' view)
    and which the caller cuts. The padded positions' rows of the result are zeros."""
    if rows is not None:
        x = x.index_select(0, rows)  # (N, D)
    for i, w in enumerate(layers):
        n1, n2, n3 = w["norms"]
        h = F.layer_norm(x, *n1) if pre else x  # masked self-attention over the cache
        qkv = spread(linear(h, w["qkv"], w["qkv_b"]), rows, B * q)  # (B*q, 3*H*Dh): queries, keys, values
        q_, k, v = qkv.view(B, q, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, q, Dh), one view
        keys, values = store(i, k, v)
        x = attend(q_, keys, values, allowed, x, w["o"], w["o_b"], rows)
        x = x if pre else F.layer_norm(x, *n1)
        h = F.layer_norm(x, *n2) if pre else x  # attention over the encoder's output
        cq = spread(linear(h, w["cq"], w["cq_b"]), rows, B * q)
        x = attend(heads(cq, B, q, H), *cross_kv[i], src_allowed, x, w["co"], w["co_b"], rows)
        x = x if pre else F.layer_norm(x, *n2)
        h = F.layer_norm(x, *n3) if pre else x  # the feed-forward network
        x = feed_forward(w, h, x)
        x = x if pre else F.layer_norm(x, *n3)
    return spread(x, rows, B * q)


def spread(y: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """y (N, C) of positions `rows` -> (n, C), zeros elsewhere; y itself when rows is None."""
    if rows is None:
        return y
    return y.new_zeros(n, y.shape[1]).index_copy_(0, rows, y)


class LaidOut:
    """Weights copied from parameters into a layout of the route's own, each a FloatWeight (refdec.routes.
    products) that follows the float plan of the model's shape; `current` tells whether every parameter
    still holds the values its copy was made from (refdec.routes.stamps)."""

    def __init__(self, model: Transformer):
        self.sources: list = []  # (parameter, its stamp when copied)
        self.shape = (model.cfg.d_model, model.cfg.d_ff, model.cfg.vocab_size)  # the float plan's key

    def place(self, modules: list[nn.Linear], name: str) -> FloatWeight | torch.Tensor:
        """One (in, sum of outs) weight (FloatWeight) or (sum of outs,) vector (biases): the modules'
        parameters side by side, copied."""
        params = [getattr(m, name) for m in modules]
        self.sources += [(p, stamp(p)) for p in params]
        joined = torch.cat([p.t() if name == "weight" else p for p in params], -1).contiguous()
        return FloatWeight(joined, self.shape) if name == "weight" else joined

    def current(self) -> bool:
        """Whether every parameter still holds the values this layout was copied from."""
        return all(stamp(p) == s for p, s in self.sources)


class DecoderWeights(LaidOut):
    """The decoder layers' weights laid out as one step reads them fastest: each a contiguous
    (in, out) matrix, a self-attention layer's queries, keys and values side by side in one (D, 3
    inner) matrix, their biases in one vector, every layer's cross-attention keys and values side by side
    (one product per source), the output embedding as (D, V). A copy, the route's own (LaidOut). Norms,
    the other biases and the activations are the parameters themselves."""

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.layers = []
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, even when made mid-decoding
            for layer in model.decoder:
                sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
                w = {
                    "qkv": self.place([sa.wq, sa.wk, sa.wv], "weight"),
                    "qkv_b": self.place([sa.wq, sa.wk, sa.wv], "bias"),
                    "o": self.place([sa.wo], "weight"),
                    "cq": self.place([ca.wq], "weight"),
                    "co": self.place([ca.wo], "weight"),
                    "w1": self.place([ff.w1], "weight"),
                    "w2": self.place([ff.w2], "weight"),
                }
                norms = [norm_args(s.norm) for s in (layer.sub1, layer.sub2, layer.sub3)]  # the parameters themselves
                self.layers.append(
                    {
                        **w,
                        "o_b": sa.wo.bias,
                        "cq_b": ca.wq.bias,
                        "co_b": ca.wo.bias,
                        "b1": ff.w1.bias,
                        "b2": ff.w2.bias,
                        "act": ff.act,
                        "norms": norms,
                    }
                )
            kv = [m for layer in model.decoder for m in (layer.cross_attn.wk, layer.cross_attn.wv)]
            self.cross_kv, self.cross_kv_b = self.place(kv, "weight"), self.place(kv, "bias")
            # The output embedding (V, D), tied or not, as (D, V): a step's logits are hidden @ vocab.
            self.vocab = self.place([model.tgt_embed if model.out_proj is None else model.out_proj], "weight")

    def products(self, x: torch.Tensor) -> torch.Tensor:
        """The matrix products of a decoder step over rows x (N, D) and nothing else, in the step's order,
        on these weights and the kernels the route takes for them: per layer the self-attention's
        queries-keys-values and output, the cross-attention's queries and output, the two feed-forward
        products; then the vocabulary projection. Not a decoder step (no attention, norms or cache): what
        the step's products alone cost (refdec stepcost, refdec ctranslate2)."""
        for w in self.layers:
            product(x, w["qkv"], w["qkv_b"])
            product(x, w["o"], add=x)
            product(x, w["cq"], w["cq_b"])
            product(x, w["co"], add=x)
            product(product(x, w["w1"], w["b1"]), w["w2"], add=x)
        return product(x, self.vocab)


class EncoderWeights(LaidOut):
    """The encoder layers' weights laid out as DecoderWeights lays out the decoder's: each layer's queries,
    keys and values side by side (one product), its output and feed-forward matrices (in, out), copies of
    the route's own; norms, the other biases and the activations are the parameters themselves."""

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.layers = []
        with torch.inference_mode(False), torch.no_grad():
            for layer in model.encoder:
                a, ff = layer.attn, layer.ff
                self.layers.append(
                    {
                        "qkv": self.place([a.wq, a.wk, a.wv], "weight"),
                        "qkv_b": self.place([a.wq, a.wk, a.wv], "bias"),
                        "o": self.place([a.wo], "weight"),
                        "o_b": a.wo.bias,
                        "w1": self.place([ff.w1], "weight"),
                        "b1": ff.w1.bias,
                        "w2": self.place([ff.w2], "weight"),
                        "b2": ff.w2.bias,
                        "act": ff.act,
                        "norms": [norm_args(layer.sub1.norm), norm_args(layer.sub2.norm)],
                    }
                )


@dataclass(eq=False)
class LaidOutMemory(Memory):
    """The Memory of one decoding call on the fast route: the encoder's states and cross-attention keys
    and values, and what the route keeps for the call: the route that made it, the weight layout it
    checked at the call's start, `src_allowed` (B, 1, 1, S) True at real source positions (None: no
    padding), and the graphed route's slot (refdec.routes.graphed)."""

    route: object = None
    weights: DecoderWeights | Int8Layout | None = None
    slot: object = None

    def __post_init__(self):
        super().__post_init__()
        self.src_allowed = None if self.src_block is None else ~self.src_block

    def select(self, rows: torch.Tensor) -> LaidOutMemory:
        chosen = super().select(rows)
        return LaidOutMemory(chosen.states, chosen.src_pad, chosen.cross_kv, self.route, self.weights)


class FastRoute(Route):
    """Wraps a Transformer so that its encoder and decoder calls take the fast route where it applies
    (the module docstring). `model`: the Transformer itself, unchanged; `reference`: its layers on the few-row
    kernels (refdec.routes.kernels), where calls go where the route does not apply (`few_rows` False:
    on F.linear, for a machine where the few-row product loses; `python -m refdec stepcost` times
    both); `int8`: the layout's products, and the reference's, in int8 (refdec.routes.int8)."""

    def __init__(self, model: Transformer, int8: bool = False, few_rows: bool = True):
        if not applies_to(model.cfg):
            raise ValueError("the fast route does not write this model's layers (refdec.routes.fast.applies_to)")
        if int8:
            probes.weight_levels()  # refuse at once on a machine whose int8 product is not exact
        self.model, self.int8 = model, int8
        self.kernels = Kernels(few_rows=few_rows, int8=int8)
        self.reference = KernelRoute(model, self.kernels)
        self.laid_out: DecoderWeights | None = None  # the decoder's weights in the layout (made at first use)
        self.encoder_laid_out: EncoderWeights | None = None  # the encoder's (float: the int8 route's are its layers')
        self.int8_layout: Int8Layout | None = None  # their int8 forms
        self.joined: dict = {}  # int8: weights of one input side by side (refdec.routes.int8.joined)

    # -- what the route hands to the model: cfg, training, eval, parameters (Route) -------------------------
    def __deepcopy__(self, memo: dict) -> FastRoute:
        """A route of a copy of the model; layouts and steps are made again at first use."""
        return FastRoute(copy.deepcopy(self.model, memo), self.int8, few_rows=self.kernels.few_rows)

    def refresh(self) -> None:
        """Drop every kept form of the weights (the layout, its int8 forms, the reference's, the joined
        int8 weights), so that the next call makes them again from the weights as they are (after a
        write through `.data` in place, which no stamp sees: refdec.routes.stamps)."""
        self.laid_out = self.int8_layout = self.encoder_laid_out = None
        self.joined = {}
        self.reference.refresh()

    def applies(self) -> bool:
        return not (self.model.training or torch.is_grad_enabled())

    # -- the encoder ---------------------------------------------------------------------------------
    def encode(self, src: torch.Tensor) -> Memory:
        return self.attach(*self.encode_states(src))

    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.applies() and self.cfg.enc_layers):
            return self.reference.encode_states(src)
        src = before_source(src, self.cfg.encoder_prefix)
        src_pad = src.eq(self.cfg.pad_id)  # (B, S)
        cpu = src.device.type == "cpu"  # then each source's attention alone (attend_each), padding or not
        if not bool(src_pad.any()):
            return self.encoder_stack(src, None, None, [src.shape[1]] * src.shape[0] if cpu else None), src_pad
        real = (~src_pad).reshape(-1).nonzero().squeeze(1)  # the real positions among the B*S
        lengths = (~src_pad).sum(1).tolist() if cpu else None
        return self.encoder_stack(src, ~src_pad[:, None, None, :], real, lengths), src_pad

    def encoder_stack(
        self,
        src: torch.Tensor,
        allowed: torch.Tensor | None,
        rows: torch.Tensor | None = None,
        lengths: list[int] | None = None,
        layers: list[dict] | None = None,
    ) -> torch.Tensor:
        """The encoder over src (B, S), its forced tokens in, with `allowed` (B, 1, 1, S) True at the
        keys that are not padding (None: every key) -> states (B, S, D), computed as `decoder_stack`
        computes the decoder's layers: pre-norm x + f(norm(x)), else post-norm norm(x + f(x)). `rows`
        (N,): the real positions among the B*S; then every linear map and norm reads those N rows alone
        (a batch of sources of different lengths is mostly padding), and the padding's states are zeros.
        Attention then takes each source alone (`attend_each`) given `lengths` (B,), each source's
        real positions (on a CPU: many small calls cost less there than one call mostly over padding),
        else the queries, keys and values laid out (B, S) with zeros at the padding, masked. `layers`:
        the weights as `encoder_layers` gives them, taken before a step that is captured or compiled
        (refdec.routes.graphed), which must not make them."""
        B, S = src.shape
        H, ref, pre = self.cfg.n_heads, self.reference.starting(), self.cfg.norm_first
        x = self.model.embed_source(src).reshape(B * S, -1)
        x = x if rows is None else x.index_select(0, rows)
        for w in self.encoder_layers() if layers is None else layers:
            n1, n2 = w["norms"]
            h = F.layer_norm(x, *n1) if pre else x  # self-attention
            if self.int8:  # x quantized once for the three
                q_, k, v = linears(h, w["qkv_layers"], self.joined)
            else:
                q_, k, v = linear(h, w["qkv"], w["qkv_b"]).chunk(3, dim=1)
            if lengths is not None:  # each source over its own positions alone
                x = attend_each(q_, k, v, lengths, H, x, w["o"], w["o_b"])
            else:
                q_, k, v = (heads(spread(y, rows, B * S), B, S, H) for y in (q_, k, v))
                x = attend(q_, k, v, allowed, x, w["o"], w["o_b"], rows)
            x = x if pre else F.layer_norm(x, *n1)
            h = F.layer_norm(x, *n2) if pre else x  # the feed-forward network
            x = feed_forward(w, h, x)
            x = x if pre else F.layer_norm(x, *n2)
        return spread(ref.enc_norm(x), rows, B * S).view(B, S, -1)

    def encoder_layers(self) -> list[dict]:
        """The encoder's weights as encoder_stack reads them, one dict per layer: the route's layout
        (EncoderWeights, copied again if a parameter has changed since); on the int8 route the layers' int8
        forms, their queries, keys and values' layers (`qkv_layers`) for one int8 call on x quantized once."""
        if not self.int8:
            kept = self.encoder_laid_out
            if kept is None or not kept.current():
                kept = self.encoder_laid_out = EncoderWeights(self.model)
            return kept.layers
        layers = []
        for layer in self.reference.starting().encoder:
            a, ff = layer.attn, layer.ff
            layers.append(
                {
                    "qkv_layers": [a.wq, a.wk, a.wv],
                    "o": in_out(a.wo),
                    "o_b": a.wo.bias,
                    "w1": in_out(ff.w1),
                    "b1": ff.w1.bias,
                    "w2": in_out(ff.w2),
                    "b2": ff.w2.bias,
                    "act": ff.act,
                    "norms": [norm_args(layer.sub1.norm), norm_args(layer.sub2.norm)],
                }
            )
        return layers

    def attach(self, states: torch.Tensor, src_pad: torch.Tensor) -> Memory:
        """Encoder states -> this call's LaidOutMemory, the weights checked once for the call."""
        if not self.applies():
            return self.reference.attach(states, src_pad)
        B, S, _ = states.shape
        H = self.cfg.n_heads
        real = (~src_pad).reshape(-1).nonzero().squeeze(1) if bool(src_pad.any()) else None  # the padding: masked
        rows = states.reshape(B * S, -1)
        rows = rows if real is None else rows.index_select(0, real)
        weights = self.decoder_weights()
        if self.int8:  # in float64, its attention's dtype (refdec.routes.int8)
            layers = self.reference.starting().decoder
            cross = [m for layer in layers for m in (layer.cross_attn.wk, layer.cross_attn.wv)]
            ys = [y.double() for y in linears(rows, cross, self.joined)]
        else:  # every layer's keys and values in one product
            ys = linear(rows, weights.cross_kv, weights.cross_kv_b).chunk(2 * self.cfg.dec_layers, dim=1)
        kv = [heads(spread(y, real, B * S), B, S, H).contiguous() for y in ys]
        return LaidOutMemory(states, src_pad, list(zip(kv[0::2], kv[1::2])), self, weights)

    def decoder_weights(self) -> DecoderWeights | Int8Layout:
        """The decoder's weights in the fast layout, copied again if a parameter has changed since; in
        int8, their int8 forms in the same layout (refdec.routes.int8.Int8Layout)."""
        kept = self.laid_out
        if kept is None or not kept.current():
            kept = self.laid_out = DecoderWeights(self.model)
        if not self.int8:
            return kept
        quantized = self.int8_layout
        if quantized is None or not quantized.current(kept):
            quantized = self.int8_layout = Int8Layout(kept)
        return quantized

    def weights_for(self, memory: Memory) -> DecoderWeights | Int8Layout:
        """The layout a decoding call uses: the one its memory holds when this route made it."""
        if isinstance(memory, LaidOutMemory) and memory.route is self:
            return memory.weights
        return self.decoder_weights()

    # -- the decoder -----------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        return self.reference.new_cache(batch, capacity)  # int8: in float64, its attention's dtype

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, q, D) @ the layout's (D, V) output embedding (+ the logits bias)."""
        if not self.applies():
            return self.reference.project(hidden)
        vocab = (self.int8_layout if self.int8 else self.laid_out) or self.decoder_weights()  # checked at each attach
        vocab = vocab.vocab
        if isinstance(vocab, QuantizedWeight):
            logits = int8.linear(hidden, vocab, None)
        else:
            logits = product(hidden.reshape(-1, hidden.shape[-1]), vocab).view(*hidden.shape[:-1], -1)
        return logits if self.model.logits_bias is None else logits + self.model.logits_bias

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache))

    # -- teacher forcing -------------------------------------------------------------------------------
    def forward_hidden(
        self, src: torch.Tensor, tgt: torch.Tensor, self_block: torch.Tensor | None = None, memory: Memory | None = None
    ) -> torch.Tensor:
        """Teacher forcing, final decoder states (B, T, D), computed as decoding on this route computes
        them: the route's encoder (each source's attention alone, in the model's dtype on the int8
        route too) and one causal decoder call over the whole target in a fresh cache, the same function
        a verification call of T tokens computes. Where the route does not apply (gradients on,
        training) or for a drafter's layout of masks (`self_block`), the model's own layers on the
        route's kernels (`reference`; with gradients on, its floating-point products): there the two
        forms differ in rounding, as the reference route's encoder attention (in float64 on the int8
        route, padding masked) differs from the route's own."""
        if self_block is not None or not self.applies():
            return self.reference.forward_hidden(src, tgt, self_block, memory)
        memory = self.encode(src) if memory is None else memory
        return self.decode_hidden(
            tgt, memory, self.new_cache(tgt.shape[0], tgt.shape[1] + len(self.cfg.decoder_prefix))
        )

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing without a cache of the caller's: src (B, S), tgt (B, T) -> logits (B, T, V), as
        forward_hidden computes them."""
        return self.project(self.forward_hidden(src, tgt))

    __call__ = forward

    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,
        layers: int | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if open_from is not None or layers is not None or not self.applies():
            return self.reference.decode_hidden(tgt_new, memory, cache, open_from, layers, real)
        new = cache.place(tgt_new, self.cfg.decoder_prefix, real=real)  # positions, masks, forced tokens
        B, q = new.tokens.shape
        allowed = None if new.self_block is None else ~new.self_block  # (q, keys), or (B, 1, q, keys) in a ragged cache
        rows = None if new.is_real is None else new.is_real.reshape(-1).nonzero().squeeze(1)
        src_allowed = (
            memory.src_allowed
            if isinstance(memory, LaidOutMemory)
            else None
            if memory.src_block is None
            else ~memory.src_block
        )
        x = self.model.embed_target(new.tokens, new.offset, new.real).reshape(B * q, -1)
        x = decoder_stack(
            self.weights_for(memory).layers,
            x,
            B,
            q,
            self.cfg.n_heads,
            new.keys_values,
            allowed,
            memory.cross_kv,
            src_allowed,
            rows,
            self.cfg.norm_first,
        )
        return self.model.dec_norm(new.commit(x.view(B, q, -1)))
