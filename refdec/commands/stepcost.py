"""What one decoder call costs as a function of how many new tokens it appends.

    python -m refdec stepcost --task mt-en-de              # the shipped model, 2 threads
    python -m refdec stepcost --task mt-en-de --report cost.json
    python -m refdec stepcost --task gec-uk --rows 64 --q 1,8,16     # calls of a batch of 64 rows
    python -m refdec stepcost --task gec-uk --fast                   # the fast route beside
    python -m refdec stepcost --task gec-uk --rows 32 --fast --int8  # and the int8 route, its calls split
    python -m refdec stepcost --task mt-en-de --q 1 --fast --parts   # its call in parts, against the roofline
    python -m refdec stepcost --task gec-uk --rows 32 --q 1 --fast --ragged-src   # the encoder over unequal sources
    python -m refdec stepcost --task mt-en-de --fast --graphed --device cuda   # and the graphed route, on a GPU
    python -m refdec stepcost --task mt-en-de --graphed --fused --device cuda  # and its steps compiled (fused)

For q in 1, 2, 4, ... it times `model.decode` of q new tokens over a cache of --prefix tokens with
--src source tokens, interleaving the q values round by round, and prints the median cost and
cost(q) / cost(1): the price of verifying a draft of q tokens in one call, which decides what every
speculative decoder can gain on this machine. Each call is
timed twice, interleaved: the model as model.py reads it (plain: torch's F.linear, x @ W.T; the
reference route, what decode.py runs by default) and with refdec.routes.kernels' few-row product for
the linear layers ((W @ x.T).T for 2-16 rows, which the fast route takes where it hands a call to the
model's layers). It also times the one-row vocabulary projection both ways: the strided view W.t()
(the reference route's) against a contiguous transposed copy (the fast route's layout).

With --rows B every call decodes B batch rows at once (a batched decoder's call: B rows x q tokens),
and the table adds the cost per decoder position (ms / (B x q)): once a call holds a few hundred
positions that cost stops falling, the call is bound by arithmetic, and a decoder that computes more
positions per output token (a drafted token that is rejected, a padded one) pays for each of them.
The encoder's cost over B sources of --src tokens is timed in the same rounds: the part of a
sentence's cost that no decoding algorithm changes. With --ragged-src its B sources are of lengths
spread evenly up to --src, right-padded to the longest, as a batch of lines in input order is (the
reference route computes the padding; the fast route its real positions alone); the cost per
source token then counts the real ones.

With --int8 the fast route on int8 products (refdec.routes.int8) is timed beside, and each of its
calls is split into parts timed alone on the call's shapes (int8_parts): the integer products, the
quantization and rescaling around them, the float64 attention, and the rest of the call.

With --fast --parts the fast route's calls are split too, each part timed alone on the call's shapes and
the kernels the route takes for them (fast_call_parts): the products by weight shape, each
beside its roofline (the least time this machine could take: its multiply-adds at the core's rate, its
bytes at the rate memory is read, both measured here), the attention calls, the layer norms and the
rest of the call, with the count of torch operations one call dispatches.

With --device cuda every time is read after torch.cuda.synchronize(), so it covers the GPU's work
and not only its launch. --graphed times the graphed route (refdec.routes.graphed) beside: its first call
of each shape is captured in the warm-up round, the timed calls replay. --fused times the graphed
route once more with each step compiled by torch.compile before its capture
(`fused`: its elementwise work fused into fewer kernels), its first call of each
shape compiled in the warm-up round (seconds each); on the CPU the compiled steps run as they are, and
their kernels are built by a C++ compiler, which must be there. Each route beside the reference is
checked too: the largest difference of its logits from the reference route's over the same calls
(the q new tokens after the prefix), printed and reported.

The table goes to stdout; stderr says what is timed and, every few seconds, how many rounds are done
and how long the rest should take (64 rows x 30 rounds take minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..app.inputs import check_outputs, checkpoint_files, shown_path
from ..checkpoint import load_model
from ..compiling import compiled, cpp_compiler
from ..errors import UsageError, run_command
from ..machine import environment, machine_line
from ..progress import ProgressLine
from ..repo import repo_file
from ..routes import ROUTES, applies_to, int8, on_route, products
from ..routes.kernels import FEW_ROWS
from ..timing import interleaved, median_seconds, seconds
from .harness import (
    command_parser,
    machine_options,
    report_option,
    set_up_machine,
    time_decode,
    time_products,
    time_replay,
    write_report,
)


def int8_parts(route, memory, prefix: int, q: int, reps: int) -> dict[str, float]:
    """Median seconds of the parts of one fast int8 route decoder call (refdec.routes.int8) appending q
    tokens to every row of `memory`'s batch over a cache of `prefix`, each part timed alone on the call's
    shapes: `products` the integer products alone (on rows already quantized, as the route computes them:
    oneDNN's fused product, its channel scaling in the same pass, or torch._int_mm in the route's blocks of
    rows; per layer the self-attention's queries-keys-values and output, the cross-attention's queries and
    output, the two feed-forward products, then the vocabulary), `quantization` what the route's products
    add around them (each row's scale, the rounding, the rescaling, the bias and residual), `attention` the
    two float64 attention calls per layer (the self-attention over prefix + q keys, masked when q > 1, and
    the cross-attention over the source, padding masked), and `call` the whole call; the rest of the call
    (norms, the cache, embeddings, dispatch) is call minus the three."""
    weights = route.decoder_weights()
    B, S, H, Dh = memory.states.shape[0], memory.states.shape[1], route.cfg.n_heads, route.cfg.head_dim
    n = memory.states.shape[0] * q
    mats = [w[k] for w in weights.layers for k in int8.PRODUCTS] + [weights.vocab]
    x = {m.q.shape[0]: torch.randn(n, m.q.shape[0]) for m in mats}  # rows of each product's input width
    xq = {k: int8.quantize_rows(v)[0] for k, v in x.items()}
    qs, ks = torch.randn(B, H, q, Dh, dtype=torch.float64), torch.randn(B, H, prefix + q, Dh, dtype=torch.float64)
    src_kv = torch.randn(B, H, S, Dh, dtype=torch.float64)
    causal = torch.ones(q, prefix + q, dtype=torch.bool).tril(prefix) if q > 1 else None
    src_allowed = getattr(memory, "src_allowed", None)

    def products():
        for m in mats:  # each as the route computes it: oneDNN's fused kernel, or torch._int_mm in blocks
            for _ in int8.integer_products(xq[m.q.shape[0]], m):
                pass

    def whole_products():
        for m in mats:
            int8.product(x[m.q.shape[0]], m, None)

    def attention():
        for _ in weights.layers:
            F.scaled_dot_product_attention(qs, ks, ks, attn_mask=causal)
            F.scaled_dot_product_attention(qs, src_kv, src_kv, attn_mask=src_allowed)

    device = memory.states.device
    with torch.inference_mode():
        parts = {
            "products": median_seconds(products, reps, device),
            "with quantization": median_seconds(whole_products, reps, device),
            "attention": median_seconds(attention, reps, device),
            "call": time_decode(route, memory, prefix, q, reps),
        }
    parts["quantization"] = parts.pop("with quantization") - parts["products"]
    parts["rest"] = parts["call"] - parts["products"] - parts["quantization"] - parts["attention"]
    return parts


# -- the fast route's calls in parts, against the machine's rates (--parts) ------------------------------
PEAK_SIZE = 1024  # the (PEAK_SIZE x PEAK_SIZE) by (PEAK_SIZE x PEAK_SIZE) product that measures the core's rate
PEAK_ROUNDS = 5


def product_groups(weights) -> list[tuple[str, list]]:
    """The fast route's decoder products by shape: (name, the FloatWeights of that part in every layer)."""
    layers = weights.layers
    return [
        ("self-attention q, k, v", [w["qkv"] for w in layers]),
        ("attention outputs, cross queries", [w[k] for w in layers for k in ("o", "cq", "co")]),
        ("feed-forward in", [w["w1"] for w in layers]),
        ("feed-forward out", [w["w2"] for w in layers]),
        ("vocabulary", [weights.vocab]),
    ]


def in_step_order(weights) -> list[tuple[int, object]]:
    """(group index in `product_groups`, weight) of every product of a decoder step, in the step's order."""
    order = []
    for w in weights.layers:
        order += [(0, w["qkv"]), (1, w["o"]), (1, w["cq"]), (1, w["co"]), (2, w["w1"]), (3, w["w2"])]
    return order + [(4, weights.vocab)]


def limits(weight_bytes: int) -> dict:
    """The machine's rates, measured now: `flops` (per second) of a PEAK_SIZE-cube float32 product on each
    kernel refdec.routes.products has here (medians of PEAK_ROUNDS interleaved rounds), the fastest taken
    (`peak_kernel`), and `bytes` (per second) of a sum over a float32 buffer of `weight_bytes`, read again
    and again as consecutive decoder steps read their weights (the median of 4 x PEAK_ROUNDS sums)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=g)
    w = products.FloatWeight(torch.randn(PEAK_SIZE, PEAK_SIZE, generator=g))
    names = products.available(torch.float32)
    with torch.inference_mode():
        times = interleaved([lambda k=k: products.product(a, w, kernel=k) for k in names], PEAK_ROUNDS)
        medians = [statistics.median(t) for t in times]
        best = min(range(len(names)), key=medians.__getitem__)
        buffer = torch.randn(max(1, weight_bytes // 4), generator=g)
        buffer.sum()
        read = median_seconds(buffer.sum, 4 * PEAK_ROUNDS)
    return {
        "flops": 2 * PEAK_SIZE**3 / medians[best],
        "peak_kernel": names[best],
        "bytes": buffer.numel() * 4 / read,
        "buffer_bytes": buffer.numel() * 4,
    }


def bound(ws: list, n: int, rates: dict) -> tuple[float, str]:
    """Seconds the machine needs at least for the products of n rows with every weight of `ws`, and which
    rate bounds it ("compute" or "memory")."""
    flops = sum(2 * n * w.shape[0] * w.shape[1] for w in ws)
    moved = sum(4 * (w.shape[0] * w.shape[1] + n * (w.shape[0] + w.shape[1])) for w in ws)
    compute, memory = flops / rates["flops"], moved / rates["bytes"]
    return (compute, "compute") if compute >= memory else (memory, "memory")


def fast_call_parts(route, memory, prefix: int, q: int, reps: int, rates: dict) -> list[dict]:
    """One row per part of a fast-route call appending q tokens to every row of `memory`'s batch over a
    cache of `prefix` (the module docstring): name, seconds (median of `reps` calls timed alone), and for a
    product group its shapes, kernel and roofline."""
    weights = route.decoder_weights()
    B, S = memory.states.shape[:2]
    H, Dh, D, L = route.cfg.n_heads, route.cfg.head_dim, route.cfg.d_model, route.cfg.dec_layers
    n = B * q
    g = torch.Generator().manual_seed(0)
    named = product_groups(weights)
    order = in_step_order(weights)
    xs = {k: torch.randn(n, k, generator=g) for k in {w.shape[0] for _, w in order}}
    spent: list[list[float]] = [[] for _ in named]

    def step_products():  # every product in the step's order, each group's time summed
        took = [0.0] * len(named)
        for i, w in order:
            start = time.perf_counter()
            products.product(xs[w.shape[0]], w)
            took[i] += time.perf_counter() - start
        return took

    out = []
    with torch.inference_mode():
        step_products()
        for _ in range(reps):
            for i, t in enumerate(step_products()):
                spent[i].append(t)
        for (name, ws), times in zip(named, spent):
            least, by = bound(ws, n, rates)
            out.append(
                {
                    "part": name,
                    "shape": f"{ws[0].shape[0]} x {ws[0].shape[1]}",
                    "count": len(ws),
                    "kernel": ws[0].kernel(n, xs[ws[0].shape[0]]),
                    "seconds": statistics.median(times),
                    "bound_seconds": least,
                    "bound_by": by,
                }
            )
        qs, ks = torch.randn(B, H, q, Dh, generator=g), torch.randn(B, H, prefix + q, Dh, generator=g)
        src_kv = torch.randn(B, H, S, Dh, generator=g)
        causal = torch.ones(q, prefix + q, dtype=torch.bool).tril(prefix) if q > 1 else None
        src_allowed = getattr(memory, "src_allowed", None)

        def attention():
            for _ in range(L):
                F.scaled_dot_product_attention(qs, ks, ks, attn_mask=causal)
                F.scaled_dot_product_attention(qs, src_kv, src_kv, attn_mask=src_allowed)

        x, norm = torch.randn(n, D, generator=g), route.model.decoder[0].sub1.norm

        def norms():
            for _ in range(3 * L):
                F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

        out.append({"part": f"attention ({2 * L} calls)", "seconds": median_seconds(attention, reps)})
        out.append({"part": f"layer norms ({3 * L})", "seconds": median_seconds(norms, reps)})
        call = time_decode(route, memory, prefix, q, reps)
        operations = count_operations(route, memory, prefix, q)
    out.append({"part": "rest (cache, embedding, views, Python)", "seconds": call - sum(p["seconds"] for p in out)})
    out.append({"part": "the whole call", "seconds": call, "torch_operations": operations})
    return out


class Counting(TorchDispatchMode):
    """Counts the torch operations dispatched while it is on (views included; the calls into OpenBLAS are
    not torch's)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_operations(route, memory, prefix: int, q: int) -> int:
    """How many torch operations one call appending q tokens over a cache of `prefix` dispatches."""
    rows = memory.states.shape[0]
    cache = route.new_cache(rows, capacity=prefix + q)
    route.decode(torch.full((rows, prefix), 7), memory, cache)
    new = torch.full((rows, q), 9)
    route.decode(new, memory, cache)
    cache.truncate(prefix)
    with Counting() as counting:
        route.decode(new, memory, cache)
    return counting.count


def parts_table(rows: list[dict]) -> list[str]:
    """The parts as printed lines."""
    heads = ("in x out", 12), ("count", 5), ("kernel", 9), ("ms", 8), ("bound ms", 9), ("bound by", 8), ("x bound", 7)
    lines = [f"{'part':<40} " + " ".join(f"{head:>{width}}" for head, width in heads)]
    for r in rows:
        if "bound_seconds" in r:
            lines.append(
                f"{r['part']:<40} {r['shape']:>12} {r['count']:>5} {r['kernel']:>9} {1000 * r['seconds']:8.3f} "
                f"{1000 * r['bound_seconds']:9.3f} {r['bound_by']:>8} {r['seconds'] / r['bound_seconds']:6.2f}x"
            )
        else:
            counted = f" ({r['torch_operations']} torch operations)" if "torch_operations" in r else ""
            lines.append(f"{r['part']:<40} {'':>12} {'':>5} {'':>9} {1000 * r['seconds']:8.3f}{counted}")
    products_rows = [r for r in rows if "bound_seconds" in r]
    took, least = sum(r["seconds"] for r in products_rows), sum(r["bound_seconds"] for r in products_rows)
    blank = f"{'':>12} {'':>5} {'':>9}"
    lines.append(f"{'the products':<40} {blank} {1000 * took:8.3f} {1000 * least:9.3f} {'':>8} {took / least:6.2f}x")
    return lines


def fast_parts(model, args, qs: list[int]) -> dict:
    """The fast route's calls at each q split into parts against the machine's rates (fast_call_parts), printed;
    what the report keeps."""
    route = on_route(model, "fast")
    weights = route.decoder_weights()
    weight_bytes = sum(4 * w.shape[0] * w.shape[1] for _, ws in product_groups(weights) for w in ws)
    with torch.inference_mode():
        memory = route.encode(torch.full((args.rows, args.src), 11))
        rates = limits(weight_bytes)
        by_q = {q: fast_call_parts(route, memory, args.prefix, q, 20, rates) for q in qs}
    print(
        f"the machine: {rates['flops'] / 1e9:.0f} GFLOP/s (a {PEAK_SIZE}-cube float32 product, "
        f"{rates['peak_kernel']}), {rates['bytes'] / 1e9:.1f} GB/s reading {rates['buffer_bytes'] / 1e6:.1f} MB "
        f"(the decoder step's weights)"
    )
    for q, rows in by_q.items():
        print(f"fast route, one call of {args.rows} row(s) x q = {q}, its parts timed alone (medians of 20 calls):")
        print("\n".join(parts_table(rows)))
    return {"rates": rates, "by_q": {str(q): rows for q, rows in by_q.items()}}


def beside(args) -> dict[str, Callable]:
    """The routes timed beside the reference, by the name their columns take, each with how it is made from
    the model: the routes of refdec.routes' table that a flag asks for (--fast, --graphed), the fast route on
    int8 products (--int8) and the graphed route with its steps compiled (--fused, `fused_route`)."""
    made = {name: partial(on_route, route=name) for name in ROUTES if getattr(args, name, False)}
    if args.int8:
        made["fast-int8"] = partial(on_route, route="fast", int8=True)
    if args.fused:
        made["graphed-fused"] = fused_route
    return made


def measure(model, args, qs: list[int]) -> tuple[dict, dict, dict, dict, dict]:
    """Seconds per call of each route at each q (samples), of the one-row projection both ways (proj), of
    the encoder (encoder), of the int8 route's parts (parts), over interleaved rounds after a warm-up, and
    each route's logit_gaps (gaps). Routes: few-row and plain (refdec.routes.kernels), and those `beside`
    gives, each wrapping the model, whose encoders are timed too; with --fast the matrix products alone of
    the fast route's q = 1 call (time_products; kept with the encoder's figures), and for a graphed route
    the step of its q = 1 call alone (time_replay: on a GPU the replay of its graph, without the Python
    around it)."""
    # the model's own layers on the few-row product: the fast route's `reference` (for a family the fast
    # route does not write, on_route gives that KernelRoute itself, whose `reference` it is)
    routes = {"few-row": on_route(model, "fast").reference, "plain": model}
    routes |= {name: make(model) for name, make in beside(args).items()}  # the same model, wrapped
    parts: dict[tuple[str, int], list[float]] = {}
    fast = routes.get("fast")
    device = model.tgt_embed.weight.device
    samples: dict[tuple[str, int], list[float]] = {(r, q): [] for r in routes for q in qs}
    W = model.tgt_embed.weight if model.out_proj is None else model.out_proj.weight
    W_t = W.t().contiguous()
    proj: dict[str, list[float]] = {"strided W.t()": [], "contiguous copy": []}
    encoder: dict[str, list[float]] = {"reference": [], **{name: [] for name in beside(args)}}
    encoder |= {"fast products, q = 1": []} if args.fast else {}
    encoder |= {f"{name} replay, q = 1": [] for name, m in routes.items() if hasattr(m, "step_of")}
    src = torch.full((args.rows, args.src), 11, device=device)
    enc_src = ragged_sources(src, model.cfg.pad_id) if args.ragged_src else src  # the encoder's timed batch
    print(
        f"timing calls of {args.rows} row(s) at q = {','.join(map(str, qs))} on the {', '.join(routes)} route(s): "
        f"a warm-up round, then {args.rounds} round{'s' * (args.rounds != 1)}",
        file=sys.stderr,
        flush=True,
    )
    progress = ProgressLine(args.rounds + 1, "rounds")
    with torch.inference_mode():
        memories = {route: m.encode(src) for route, m in routes.items()}
        h = torch.randn(1, 1, model.cfg.d_model, device=device)
        schedule = [(3, False)] + [(5, True)] * args.rounds  # a warm-up round, then the timed ones
        for done, (reps, timed) in enumerate(schedule):
            progress.update(done)  # the rounds finished so far
            for route, m in routes.items():
                for q in qs:
                    cost = time_decode(m, memories[route], args.prefix, q, reps)
                    if timed:
                        samples[route, q].append(cost)
                if timed and route == "fast":  # right after its calls, as warm as they were
                    encoder["fast products, q = 1"].append(time_products(fast, reps, args.rows))
                if timed and hasattr(m, "step_of"):  # a graphed route: its step alone too
                    encoder[f"{route} replay, q = 1"].append(time_replay(m, memories[route], args.prefix, 1, reps))
                if timed and route == "fast-int8":
                    for q in qs:
                        for part, t in int8_parts(m, memories[route], args.prefix, q, reps).items():
                            parts.setdefault((part, q), []).append(t)
            if not timed:
                continue
            for name, w in (("strided W.t()", W.t()), ("contiguous copy", W_t)):
                proj[name].append(seconds(lambda w=w: [h @ w for _ in range(10)], device) / 10)
            for name in ("reference", *beside(args)):  # the reference: decode.py's
                encoder[name].append(seconds(lambda name=name: routes.get(name, model).encode(enc_src), device))
    with torch.inference_mode():
        gaps = {route: logit_gaps(model, routes[route], src, args.prefix, qs) for route in beside(args)}
    return samples, proj, encoder, parts, gaps


def fused(step):
    """A graphed route's step compiled by torch.compile (inductor) as one whole graph of fixed shapes: its
    elementwise work (norms, masks, softmax, residuals, the writes into the cache) fused into fewer kernels,
    the matrix products left to the BLAS (a GPU's cuBLAS, a CPU's oneDNN or MKL). Compiled at its first call
    (on a GPU, the warm-up run before the capture), once per shape of step: every shape is one more
    compilation of the same function, so it may keep more than torch.compile's default 8 (past which, with
    fullgraph, it raises), for its own calls alone (refdec.compiling.compiled)."""
    return compiled(step, FUSED_SHAPES, dynamic=False, fullgraph=True)


FUSED_SHAPES = 1024  # compilations a fused step may keep: one per shape of step a measurement meets


def fused_route(model):
    """The graphed route with each step compiled before its capture (`fused`): a form to measure what
    fusing buys, not a decoding route."""
    route = on_route(model, "graphed")
    route.prepare_step = fused
    return route


def logit_gaps(model, route, src: torch.Tensor, prefix: int, qs: list[int]) -> dict[int, float]:
    """For each q, the largest absolute difference between the route's logits and the reference route's
    (`model` as model.py reads it) for the q new tokens of a call after a prefix of `prefix` tokens,
    over the same source: what the route's other order of sums (or int8 products) moves them by."""
    gaps = {}
    for q in qs:
        tokens = torch.arange(prefix + q, device=src.device) % 50 + 10  # ordinary ids past the special ones
        logits = []
        for m in (model, route):
            memory = m.encode(src)
            cache = m.new_cache(src.shape[0], capacity=prefix + q)
            m.decode(tokens[:prefix].expand(src.shape[0], -1), memory, cache)
            logits.append(m.decode(tokens[prefix:].expand(src.shape[0], -1), memory, cache))
        gaps[q] = (logits[1].double() - logits[0].double()).abs().max().item()
    return gaps


def source_lengths(B: int, S: int) -> list[int]:
    """--ragged-src's source lengths: row i of B holds round((i + 1) * S / B) tokens, at least 1."""
    return [max(1, round((i + 1) * S / B)) for i in range(B)]


def ragged_sources(src: torch.Tensor, pad_id: int) -> torch.Tensor:
    """src (B, S) with each row cut to its source_lengths, the rest padding."""
    B, S = src.shape
    lengths = torch.tensor(source_lengths(B, S), device=src.device)
    return src.masked_fill(torch.arange(S, device=src.device)[None, :] >= lengths[:, None], pad_id)


def parser() -> argparse.ArgumentParser:
    p = command_parser(__doc__, "stepcost")
    p.add_argument("--task", default="mt-en-de", help="task whose shipped checkpoint to load (default mt-en-de)")
    p.add_argument("--model", help="checkpoint path (default: checkpoints/<task>/model.pt)")
    p.add_argument("--src", type=int, default=30, help="source tokens (default 30)")
    p.add_argument(
        "--ragged-src",
        action="store_true",
        help="time the encoder over sources of lengths spread "
        "evenly up to --src, padded (a batch of lines in input order), not all of --src tokens",
    )
    p.add_argument("--prefix", type=int, default=30, help="tokens already in the cache (default 30)")
    p.add_argument("--rows", type=int, default=1, help="batch rows per call (default 1)")
    p.add_argument("--q", default="1,2,4,8,16,32,64", help="new-token counts to time (default 1,2,4,8,16,32,64)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    p.add_argument(
        "--fast", action="store_true", help="time the fast route (refdec.routes.fast) too, in the same rounds"
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="time the fast route on int8 products (refdec.routes.int8) too, "
        "and each call's parts alone: integer products, quantization, attention, the rest",
    )
    p.add_argument(
        "--parts",
        action="store_true",
        help="with --fast: each fast-route call's parts timed alone (the products by shape against the "
        "machine's roofline, attention, norms, the rest), with the core's and memory's rates measured here",
    )
    p.add_argument(
        "--graphed",
        action="store_true",
        help="time the graphed route (refdec.routes.graphed) too, in the same "
        "rounds (CUDA graphs on a GPU; on the CPU its static-shape steps run as they are)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="time the graphed route with each step compiled by torch.compile "
        "(fused) too: what fusing its elementwise work buys (compiled in the warm-up round, "
        "seconds per shape; on the CPU a C++ compiler must be there)",
    )
    machine_options(p)
    report_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    try:
        qs = [int(x) for x in args.q.split(",")]
        if min(qs) < 1 or args.rounds < 1 or args.threads < 1 or args.rows < 1 or args.src < 1:
            raise ValueError
    except ValueError:
        raise UsageError(
            "--q takes positive integers separated by commas; --rounds, --threads, --rows and --src at least 1"
        ) from None
    device = set_up_machine(args)
    path = args.model or repo_file("checkpoints", args.task, "model.pt", flag="--model")
    check_outputs({"--report": args.report}, checkpoint_files("the model", path))
    model, _, _ = load_model(path, task=args.task, device=device)
    chosen = [f"--{name}" for name in ("fast", "graphed", "int8", "fused") if getattr(args, name)]
    if chosen and not applies_to(model.cfg):
        raise UsageError(
            f"{'/'.join(chosen)}: the fast route does not write this model's layers (its family's "
            f"norm, feed-forward or positions: refdec.routes.fast.applies_to), so there is no such "
            f"route to time; without them stepcost times its layers on the few-row and plain products"
        )
    if args.parts and not args.fast:
        raise UsageError("--parts splits the fast route's calls: add --fast")
    if args.parts and device.type != "cpu":
        raise UsageError("--parts measures the CPU's rates: it runs on the CPU (leave out --device)")
    if args.src + args.prefix + max(qs) > model.cfg.max_positions:
        raise UsageError(f"--src/--prefix/--q exceed the model's {model.cfg.max_positions} positions")
    if args.fused and device.type == "cpu" and cpp_compiler() is None:
        raise UsageError(
            "--fused on the CPU needs a C++ compiler (torch.compile builds its kernels with one): install g++"
        )
    samples, proj, encoder, parts, gaps = measure(model, args, qs)
    med = {key: statistics.median(v) for key, v in samples.items()}
    B = args.rows
    other_routes = list(beside(args))  # the routes beside the reference
    rows = [
        {
            "q": q,
            "ms": 1000 * med["few-row", q],
            "ratio": med["few-row", q] / med["few-row", qs[0]],
            "ms_per_position": 1000 * med["few-row", q] / (B * q),
            "plain_ms": 1000 * med["plain", q],
            "plain_ratio": med["plain", q] / med["plain", qs[0]],
            **{
                key: value
                for route in other_routes
                for key, value in (
                    (f"{route}_ms", 1000 * med[route, q]),
                    (f"{route}_ratio", med[route, q] / med[route, qs[0]]),
                )
            },
        }
        for q in qs
    ]
    enc = {name: 1000 * statistics.median(v) for name, v in encoder.items()}
    enc_ms = enc["reference"]
    print(
        f"decoder call of {B} row(s), each appending q tokens to a cache of {args.prefix}, source of {args.src}, "
        f"{args.threads} threads, {device}, {shown_path(path)}"
    )
    print(machine_line(args.threads))
    print(
        f"few-row route: linear layers compute (W @ x.T).T for {FEW_ROWS.start}-{FEW_ROWS.stop - 1} "
        f"rows (refdec's default); plain: x @ W.T throughout"
    )
    columns = []  # (header, key, decimals) of each route beside the reference
    for route in other_routes:
        columns += [
            (f"   {route} ms/call", f"{route}_ms", 3),
            (f"   {route} cost(q)/cost(q={qs[0]})", f"{route}_ratio", 2),
        ]
    print(
        f"    q   ms/call   cost(q)/cost(q={qs[0]})   ms/position   plain ms/call   plain cost(q)/cost(q={qs[0]})"
        + "".join(head for head, _, _ in columns)
    )
    for r in rows:
        print(
            f"{r['q']:5d}  {r['ms']:8.3f}   {r['ratio']:6.2f}             {r['ms_per_position']:8.4f}     "
            f"{r['plain_ms']:8.3f}        {r['plain_ratio']:6.2f}"
            + "".join(f"{r[key]:{len(head)}.{digits}f}" for head, key, digits in columns)
        )
    tokens = sum(source_lengths(B, args.src)) if args.ragged_src else B * args.src
    sources = (
        f"1-{args.src} tokens ({tokens} in all, padded to {args.src})" if args.ragged_src else f"{args.src} tokens"
    )
    print(
        f"encoder over {B} source(s) of {sources}: {enc_ms:.3f} ms ({enc_ms / tokens:.4f} ms per "
        f"source token)"
        + "".join(f"; {route} route {enc[route]:.3f} ms ({enc[route] / tokens:.4f})" for route in other_routes)
    )
    if args.fast:
        whole = next((f" (of {r['fast_ms']:.3f} ms for the whole call)" for r in rows if r["q"] == 1), "")
        print(f"fast route, the q = 1 call's matrix products alone: {enc['fast products, q = 1']:.3f} ms{whole}")
    for route in other_routes:
        if f"{route} replay, q = 1" in enc:
            whole = next((f" (of {r[f'{route}_ms']:.3f} ms for the whole call)" for r in rows if r["q"] == 1), "")
            print(
                f"{route} route, the q = 1 call's step alone (on a GPU its graph's replay): "
                f"{enc[f'{route} replay, q = 1']:.3f} ms{whole}"
            )
    for route, by_q in gaps.items():
        print(
            f"{route} route, largest |logit difference| from the reference route's: "
            + ", ".join(f"q = {q} {gap:.2e}" for q, gap in by_q.items())
        )
    split = (
        {
            f"{part}_ms": {q: 1000 * statistics.median(parts[part, q]) for q in qs}
            for part in ("call", "products", "quantization", "attention", "rest")
        }
        if args.int8
        else {}
    )
    if args.int8:
        print(
            "fast int8 route, one call's parts timed alone (ms): q, the call, the integer products, the quantization "
            "and rescaling around them, float64 attention, the rest"
        )
        for q in qs:
            print(
                f"{q:5d}  "
                + "  ".join(
                    f"{split[f'{part}_ms'][q]:8.3f}"
                    for part in ("call", "products", "quantization", "attention", "rest")
                )
            )
    split_fast = fast_parts(model, args, qs) if args.parts else None
    pm = {k: 1000 * statistics.median(v) for k, v in proj.items()}
    print("one-row vocabulary projection: " + ", ".join(f"{k} {v:.3f} ms" for k, v in pm.items()))
    if args.report:
        write_report(
            args.report,
            {
                "model": shown_path(path),
                "threads": args.threads,
                "device": str(device),
                "rows": B,
                "src": args.src,
                "ragged_src": args.ragged_src,
                "source_tokens": tokens,
                "prefix": args.prefix,
                "calls": rows,
                "encoder_ms": enc_ms,
                **(
                    {"fast_encoder_ms": enc["fast"], "fast_products_ms": enc["fast products, q = 1"]}
                    if args.fast
                    else {}
                ),
                **(
                    {"graphed_encoder_ms": enc["graphed"], "graphed_replay_ms": enc["graphed replay, q = 1"]}
                    if args.graphed
                    else {}
                ),
                **({"int8_encoder_ms": enc["fast-int8"], "int8_parts": split} if args.int8 else {}),
                **(
                    {"fused_encoder_ms": enc["graphed-fused"], "fused_replay_ms": enc["graphed-fused replay, q = 1"]}
                    if args.fused
                    else {}
                ),
                **({"fast_parts": split_fast} if split_fast is not None else {}),
                "logit_gaps": {route: {str(q): gap for q, gap in by_q.items()} for route, by_q in gaps.items()},
                "projection_ms": pm,
                "environment": environment(args.threads, device, model.tgt_embed.weight.dtype),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
