"""The int8 route (refdec.routes.int8): exact int8 products whose rows do not depend on the other rows of a
call, a model's logits for a row alone equal to that row's within 8 rows (torch.equal, float32 and
float64, on the reference and the fast route), every lossless decoder on the route equal to greedy
on the route, a wrapper that leaves the model in floating point, the floating-point products with
gradients on, int8 weights that follow weight writes and optimizer steps (fused ones included), and
the :int8 run option."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    AVX512_FLAGS,
    TEXTS,
    ZEN3_FLAGS,
    adversarial_drafter,
    alone,
    assert_rows_equal,
    batch1_greedy,
    check_batched_iad,
    copy_model,
    counting_probes,
    error_of,
    fake_cpu,
    ragged_src,
    random_checkpoint,
    random_heads,
    random_src,
    tiny_model,
)

from refdec.app.plan import parse_compare
from refdec.config import BOS_ID, EOS_ID, PAD_ID
from refdec.decoding import decode_greedy, decode_iad
from refdec.decoding import gad as gad_module
from refdec.decoding.bild import decode_bild
from refdec.decoding.blockwise import decode_blockwise
from refdec.decoding.gad import decode_gad
from refdec.decoding.speculative import decode_speculative
from refdec.drafter import Drafter
from refdec.errors import UsageError
from refdec.routes import fast, int8, on_route, probes
from refdec.routes.int8 import QuantizedWeight
from refdec.routes.kernels import is_int8

ROUTES = ["reference", "fast"]


def int8_copy(model, route: str = "reference", dtype: torch.dtype | None = None):
    """The int8 route (on the model's own layers, or the fast route's layout) around a copy of the model."""
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
    return on_route(m, route, int8=True)


# -- the product ---------------------------------------------------------------------------------------
def test_this_machines_int8_product_is_exact():
    """torch._int_mm sums int8 products in int32 without saturating (the route refuses a machine
    where it does not at any weight range)."""
    assert probes.weight_levels() in (127, 63)
    assert probes.exact_products(probes.weight_levels())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k,n", [(16, 12), (32, 40), (48, 96), (192, 8000)])
def test_a_row_of_a_product_does_not_depend_on_the_other_rows(dtype, k, n):
    """Each row of int8.linear alone equals (torch.equal) the same row within 2-40 rows of other
    data, wherever it sits; with a bias and with a residual stream added; a row of zeros stays zeros."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    qw = QuantizedWeight(w.t(), w)
    x = torch.randn(40, k, generator=g, dtype=dtype) * torch.rand(40, 1, generator=g, dtype=dtype) * 10
    x[7] = 0
    res = torch.randn(40, n, generator=g, dtype=dtype)
    whole, whole_res = int8.linear(x, qw, b), int8.product(x, qw, res)
    for rows in (2, 8, 13, 40):
        part = int8.linear(x[:rows], qw, b)
        assert torch.equal(part, whole[:rows])
    for i in (0, 5, 7, 39):
        assert torch.equal(int8.linear(x[i : i + 1], qw, b), whole[i : i + 1])
        assert torch.equal(int8.product(x[i : i + 1], qw, res[i : i + 1]), whole_res[i : i + 1])
    assert torch.equal(int8.product(x[7:8], qw), torch.zeros(1, n, dtype=dtype))
    ref = x @ w.t() + b  # and the quantized product is close to the exact one
    assert ((whole - ref).abs().amax(1) / ref.abs().amax(1)).max() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_product_in_blocks_of_rows_equals_it_in_one(dtype, monkeypatch):
    """A product large enough to be computed in blocks of rows (int8.row_blocks: here 64, 64 and 22
    rows) equals (torch.equal) the same product in one integer product and one rescaling, with a bias,
    with a residual stream and with neither; each row alone, on either side of a block's edge, too. The
    plan is forced to blocks, whatever this machine's probe finds."""
    monkeypatch.setattr(int8, "plan", planned(None, blocks=True))
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8000, 192, generator=g, dtype=dtype)
    b, qw = torch.randn(8000, generator=g, dtype=dtype), QuantizedWeight(w.t(), w)
    x = torch.randn(150, 192, generator=g, dtype=dtype) * torch.rand(150, 1, generator=g, dtype=dtype) * 10
    res = torch.randn(150, 8000, generator=g, dtype=dtype)
    blocks = int8.row_blocks(150, 8000)
    assert [(s.start, s.stop) for s in blocks] == [(0, 64), (64, 128), (128, 192)]
    xq, sx = int8.quantize_rows(x)
    for add in (b, res, None):
        at_once = int8.rescale(torch._int_mm(xq, qw.q), sx, qw.scale, add)
        blocked = int8.product(x, qw, add)
        assert torch.equal(blocked, at_once)
        for i in (0, 63, 64, 149):
            alone = int8.product(x[i : i + 1], qw, add if add is None or add.dim() == 1 else add[i : i + 1])
            assert torch.equal(alone, blocked[i : i + 1])


@pytest.fixture
def fused_here():
    """Skips the test where this torch build has no oneDNN fused int8 kernel that agrees with the plain
    product (probes.fused_kernel_exact, checked when the test runs: seconds on a CPU where the kernel is
    slow, none at collection)."""
    if not probes.fused_kernel_exact(int8.KERNELS):
        pytest.skip("no oneDNN fused int8 kernel in this torch build")


def planned(fused_from, blocks=False):
    """A stand-in for int8.plan: every shape's plan as given, whatever this machine's probe finds
    (`fused_from` may be a function of the weight's (k, n))."""
    return lambda k, n: probes.Plan(fused_from(k, n) if callable(fused_from) else fused_from, blocks)


@pytest.mark.parametrize("k,n", [(16, 12), (192, 576), (768, 192), (192, 8000)])
def test_onednns_fused_product_equals_the_plain_one(k, n, fused_here, monkeypatch):
    """Where a plan takes oneDNN's fused int8 linear (int8.takes_fused), it equals (torch.equal) torch._int_mm
    with int8.rescale, whole and in blocks of rows (130 rows: two whole blocks of 64 and a part), with a
    bias, a residual stream and neither, at 1 to 130 rows, so that a row's values do not depend on which of
    the two computes it. Both plans are forced, and the rows are the same on every
    machine, whatever its probe finds."""
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    monkeypatch.setattr(int8, "plan", planned(1))
    qw = QuantizedWeight(w.t(), w)
    assert qw.packed is not None
    for m in (1, 3, 17, 64, 130):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
        res = torch.randn(m, n, generator=g)
        for add in (b, res, None):
            monkeypatch.setattr(int8, "plan", planned(1))
            fused = int8.product(x, qw, add)
            assert int8.takes_fused(int8.quantize_rows(x)[0], qw)
            for blocks in (False, True):
                monkeypatch.setattr(int8, "plan", planned(None, blocks))
                assert not int8.takes_fused(int8.quantize_rows(x)[0], qw)
                assert torch.equal(fused, int8.product(x, qw, add)), (m, add is None, blocks)
    assert QuantizedWeight(w.t().double(), w.double()).packed is None  # float64 takes the plain product
    monkeypatch.setattr(int8, "plan", planned(None))
    assert QuantizedWeight(w.t(), w).packed is None  # a plan without the fused product packs nothing


def test_the_products_plan_is_the_probes_timing_both_ways(monkeypatch):
    """probes.probe_plan takes oneDNN's fused product from the first row count from which it was faster at
    every count timed, never where it was slower, and times it at one row only where it was GIVE_UP
    times slower there (a CPU where it is a thousand times slower); row blocks where they were faster.
    The kernels' timings are forced (probes.race) on stand-in kernels, so that every outcome is tested on
    every machine."""
    kernels = int8.KERNELS._replace(fused_available=lambda: True, pack=lambda q: (None, None))
    monkeypatch.setattr(probes, "fused_kernel_exact", lambda kernels: True)

    def timed(fused_us: dict, blocks_faster: bool):
        calls = []

        def race(f, g, args, give_up=None):
            m = args[0].shape[0]
            calls.append(m)
            if f.__name__ == "fused_call":
                return fused_us.get(m, fused_us.get("else")), 100.0
            return (90.0, 100.0) if blocks_faster else (110.0, 100.0)

        monkeypatch.setattr(probes, "race", race)
        return calls

    n, m0 = 768, -(-probes.FUSED_ELEMENTS // 768)  # 86 rows: where the fused product is first tried
    calls = timed({"else": 50.0}, True)
    plan = probes.probe_plan(192, n, kernels)
    assert (plan.fused_from, plan.blocks) == (m0, False) and calls == [1, m0, 4 * m0]  # blocks: the fused takes them
    timed({1: 500.0, m0: 120.0, "else": 50.0}, False)
    assert probes.probe_plan(192, n, kernels).fused_from == 4 * m0  # faster from 4 x m0 on only
    timed({1: 50.0, m0: 50.0, "else": 120.0}, True)
    plan = probes.probe_plan(192, n, kernels)
    assert plan.fused_from is None and plan.blocks  # slower at the larger count: never
    calls = timed({"else": 100.0 * probes.GIVE_UP + 1}, False)
    plan = probes.probe_plan(192, n, kernels)
    assert plan.fused_from is None and not plan.blocks and calls == [1, 384] and "slower" in plan.why
    calls = timed({"else": 1.0}, False)
    assert probes.probe_plan(192, 8000, kernels).fused_from == 1 and calls == [1, 4]  # the vocabulary: from one row
    monkeypatch.setattr(probes, "fused_kernel_exact", lambda kernels: False)
    timed({"else": 1.0}, False)
    assert probes.probe_plan(192, n, kernels).fused_from is None  # faster, but not bitwise the plain form: never
    calls = timed({}, True)
    plan = probes.probe_plan(192, n, kernels._replace(fused_available=lambda: False))
    assert plan.fused_from is None and calls == [384]  # 384 rows: the first with blocks


def test_this_machines_plans_are_found_once_and_reported(monkeypatch):
    """int8.plan asks probes.plan_for, which probes a shape once per thread count and keeps the plan: a
    second call probes nothing, another thread count probes again; plans_made lists each plan with the
    timings it was chosen by (what `refdec machine` and every timing report show)."""
    monkeypatch.setattr(probes, "decided", probes.Decisions(environment_read=True))
    probed = counting_probes(monkeypatch)
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1
    plan = int8.plan(24, 40)
    assert int8.plan(24, 40) is plan and probed == [(24, 40, threads)]
    torch.set_num_threads(other)
    try:
        assert int8.plan(24, 40) is not plan and int8.plan(24, 40) is int8.plan(24, 40)
    finally:
        torch.set_num_threads(threads)
    assert int8.plan(24, 40) is plan and probed == [(24, 40, threads), (24, 40, other)]
    made = probes.plans_made()
    assert set(made) == {f"24 x 40, {t} thread(s)" for t in (threads, other)}
    mine = made[f"24 x 40, {threads} thread(s)"]
    assert mine["fused_from_rows"] == plan.fused_from and mine["row_blocks"] == plan.blocks and mine["timings_us"]


def test_a_deep_copy_of_the_int8_weights_computes_the_same_products():
    """copy.deepcopy of a QuantizedWeight and of a JoinedWeight (whose oneDNN packed form is an opaque
    tensor deepcopy cannot copy) gives weights of their own that compute bitwise the same products."""
    g = torch.Generator().manual_seed(9)
    ws = [torch.randn(n, 192, generator=g) for n in (8000, 96)]
    qs = [QuantizedWeight(w.t(), w) for w in ws]
    joined = int8.JoinedWeight(qs)
    x = torch.randn(70, 192, generator=g)
    for w in (*qs, joined):
        other = copy.deepcopy(w)
        assert other.q is not w.q and torch.equal(other.q, w.q) and (other.packed is None) == (w.packed is None)
        assert torch.equal(int8.product(x, other), int8.product(x, w))


def test_lossless_decoders_on_int8_equal_int8_greedy_on_the_fused_product(fused_here, monkeypatch):
    """Products of 128 output values or more on oneDNN's fused form, the others on torch._int_mm (a
    one-row greedy step takes both), whatever this machine's plans, float32 on the fast route: batched
    IAD (drafts uncapped and of at most 4), blockwise and speculative decoding write batch-1 int8
    greedy's tokens."""
    monkeypatch.setattr(int8, "plan", planned(lambda k, n: -(-128 // n), blocks=True))
    m = int8_copy(copy_model(), "fast", torch.float32)
    src = random_src(901, 8, 16, min_len=1, max_len=14)
    ref = batch1_greedy(m, src, 30)
    assert_rows_equal(decode_iad(m, src, max_len=30).tokens, ref, "iad fused")
    assert_rows_equal(decode_iad(m, src, max_len=30, max_draft=4).tokens, ref, "iad fused, drafts of 4")
    assert_rows_equal(
        decode_blockwise(m, random_heads(m, 3, 8).float(), src, max_len=30).tokens, ref, "blockwise fused"
    )
    assert_rows_equal(decode_speculative(m, m, src, max_len=30, gamma=4).tokens, ref, "speculative fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantizing_through_a_relu_equals_quantizing_the_relus_output(dtype):
    """int8.quantize_relu_rows(y) equals (torch.equal) quantize_rows(relu(y)), values and scales: rows
    of mixed signs, all negative, all zero, negative zeros, one positive value among negatives."""
    y = torch.randn(6, 768, generator=torch.Generator().manual_seed(3), dtype=dtype) * 4
    y[1] = -y[1].abs()
    y[2] = 0
    y[3] = -0.0
    y[4] = -y[4].abs()
    y[4, 100] = 1e-3
    got, want = int8.quantize_relu_rows(y), int8.quantize_rows(torch.relu(y))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not got[0][1:4].any() and got[0][4, 100] == int8.LEVELS


@pytest.mark.parametrize("rows", [1, 5, 40, 1200])
def test_products_of_one_input_side_by_side_equal_the_products_one_by_one(rows):
    """int8.linears (one product of the weights side by side, or for many rows one per weight)
    equals int8.linear weight by weight bitwise, and each of its rows equals that row alone; the
    side-by-side weights are made again when a weight is."""
    g = torch.Generator().manual_seed(rows)
    ws = [torch.randn(n, 48, generator=g) for n in (48, 16, 48)]
    bs = [torch.randn(n, generator=g) for n in (48, 16, 48)]
    qs = [QuantizedWeight(w.t(), w) for w in ws]
    x = torch.randn(rows, 48, generator=g) * 3
    kept: dict = {}  # a route's

    together = int8.linears(x, qs, bs, kept, "qkv")
    for y, q, b in zip(together, qs, bs):
        assert torch.equal(y, int8.linear(x, q, b))
    for i in {0, rows // 2, rows - 1}:
        assert all(
            torch.equal(a, b[i : i + 1]) for a, b in zip(int8.linears(x[i : i + 1], qs, bs, kept, "qkv"), together)
        )
    first = int8.joined(kept, "qkv", qs)
    assert int8.joined(kept, "qkv", qs) is first
    qs[1] = QuantizedWeight(ws[1].t() * 2, ws[1])
    assert int8.joined(kept, "qkv", qs) is not first
    assert torch.equal(int8.linears(x, qs, bs, kept, "qkv")[1], int8.linear(x, qs[1], bs[1]))


# -- the model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["fast", "invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rows_logits_do_not_depend_on_the_other_rows_of_a_call(route, dtype):
    """The decoder's logits for a batch row alone equal its logits within a call of 8 rows (sources
    of one length), bitwise: for one new token, for 5 at once (a verification call), and on the
    next step over the cache each call wrote; the encoder's states too. On the fast route (its
    fused attention works batch row by batch row) and in row-invariant mode; the reference
    route's attention products (torch.matmul over the batch) may round by the batch's size."""
    model = tiny_model(21, norm_first=route == "fast").to(dtype)
    m = on_route(model, "invariant", int8=True) if route == "invariant" else on_route(model, "fast", int8=True)
    src = random_src(21, 8, 40, min_len=7, max_len=7)
    tgt = torch.randint(5, 40, (8, 5), generator=torch.Generator().manual_seed(21))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        mem8, cache8 = m.encode(src), m.new_cache(8)
        first8, next8 = m.decode(tgt, mem8, cache8), m.decode(tgt[:, :1], mem8, cache8)
        one8 = m.decode(tgt[:, :1], mem8, m.new_cache(8))
        for b in (0, 3, 7):
            mem, cache = m.encode(src[b : b + 1]), m.new_cache(1)
            assert torch.equal(mem.states, mem8.states[b : b + 1])
            assert torch.equal(m.decode(tgt[b : b + 1], mem, cache), first8[b : b + 1])
            assert torch.equal(m.decode(tgt[b : b + 1, :1], mem, cache), next8[b : b + 1])
            assert torch.equal(m.decode(tgt[b : b + 1, :1], mem, m.new_cache(1)), one8[b : b + 1])


def test_a_ragged_calls_real_positions_do_not_depend_on_its_padding():
    """A batched verification call of drafts of different lengths (right-padded, `real` tokens per
    row, over a ragged cache) on the fast int8 route, whose linear maps read the real positions
    alone: each row's logits at its real positions, and its cache there, equal (torch.equal) that
    row decoded alone with its real tokens only over the same cache. In float32, where attention's
    float64 result is rounded back (a float64 model keeps the mask's last-bit roundings)."""
    m = on_route(tiny_model(23, norm_first=True).to(torch.float32), "fast", int8=True)
    src = random_src(23, 4, 40, min_len=6, max_len=6)
    g = torch.Generator().manual_seed(23)
    start, tgt = torch.randint(5, 40, (4, 3), generator=g), torch.randint(5, 40, (4, 4), generator=g)
    start[:, 0] = BOS_ID
    lengths, real = torch.tensor([1, 3, 2, 3]), torch.tensor([4, 1, 3, 2])
    with torch.no_grad():
        mem4, cache4 = m.encode(src), m.new_cache(4)
        m.decode(start, mem4, cache4)
        cache4.truncate(lengths)
        logits4 = m.project(m.decode_hidden(tgt, mem4, cache4, real=real))
        for b in range(4):
            mem, cache = m.encode(src[b : b + 1]), m.new_cache(1)
            m.decode(start[b : b + 1, : int(lengths[b])], mem, cache)
            n = int(real[b])
            assert torch.equal(m.decode(tgt[b : b + 1, :n], mem, cache)[0], logits4[b, :n])
            used = int(lengths[b]) + n
            assert torch.equal(cache.k[:, 0, :, :used], cache4.k[:, b, :, :used])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sources_encoding_does_not_depend_on_its_batch_in_float32(threads):
    """On the fast int8 route in float32, whose encoder attends in float32, each source alone per
    source (refdec.routes.fast.attend_each): a source's states and cross-attention keys and values
    alone equal (torch.equal) its own within a batch of sources of other lengths (padded, in input
    order and sorted by length) and within a batch of sources of its own length, for lengths of 1 to
    141 tokens on both sides of the attention kernel's blocks and vector widths, on 1 and 2 threads,
    with neighbours of one length in one call where this machine's probe found that it holds
    (probes.grouping_holds; on an AMD EPYC at 2 threads it does not for odd lengths of 9 to 31)."""
    m = on_route(tiny_model(31, max_positions=160).to(torch.float32), "fast", int8=True)
    g = torch.Generator().manual_seed(31)
    lengths = torch.tensor([33, 1, 141, 16, 2, 65, 17, 128, 31, 64, 15, 32])  # eos included
    src = torch.full((len(lengths), int(lengths.max())), PAD_ID)
    for b, n in enumerate(lengths.tolist()):
        src[b, : n - 1], src[b, n - 1] = torch.randint(5, 40, (n - 1,), generator=g), EOS_ID
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            order = lengths.argsort(stable=True)
            batches = [(torch.arange(len(lengths)), m.encode(src)), (order, m.encode(src[order]))]
            for b, n in enumerate(lengths.tolist()):
                one = m.encode(alone(src, b))
                same = m.encode(alone(src, b).expand(3, n))
                for rows, mem in batches + [(torch.tensor([b, b, b]), same)]:
                    i = int((rows == b).nonzero()[0])
                    assert torch.equal(mem.states[i, :n], one.states[0]), (b, n)
                    for (k, v), (k1, v1) in zip(mem.cross_kv, one.cross_kv):
                        assert torch.equal(k[i, :, :n], k1[0]) and torch.equal(v[i, :, :n], v1[0])
    finally:
        torch.set_num_threads(before)


def encode_counting(monkeypatch, held: bool | None, src):
    """The fast int8 route's encoding (float32) of `src` and of each source alone, with
    probes.grouping_holds forced to `held` (None: this machine's probe), and the row counts of the
    attention calls made."""
    m = on_route(tiny_model(32, max_positions=64).to(torch.float32), "fast", int8=True)
    if held is not None:
        monkeypatch.setattr(probes, "grouping_holds", lambda *key: held)
    calls = []
    together = fast.attend_together

    def counted(q, k, v, n, out):
        calls.append(q.shape[0] // n)
        together(q, k, v, n, out)

    monkeypatch.setattr(fast, "attend_together", counted)
    with torch.no_grad():
        batch = m.encode(src)
        made = list(calls)
        ones = [m.encode(alone(src, b)) for b in range(src.shape[0])]
    return batch, ones, made


@pytest.mark.parametrize("held", [True, False])
def test_the_encoders_grouped_attention_follows_the_probe_both_ways(held, monkeypatch):
    """Where probes.grouping_holds says so, the sources of one length share an attention call; where it
    does not, each source attends in a call of its own, and its states then equal (torch.equal) its
    own alone, whatever the machine's kernel does. Both outcomes forced, on every machine; grouped, the
    states are within float32 rounding of each alone."""
    lengths = [15, 15, 15, 9, 9, 4]
    src = torch.full((6, 15), PAD_ID)
    for b, n in enumerate(lengths):
        src[b, : n - 1], src[b, n - 1] = torch.arange(5, 4 + n), EOS_ID
    batch, ones, calls = encode_counting(monkeypatch, held, src)
    layers = 2
    assert calls == ([3, 2, 1] if held else [1] * 6) * layers
    for b, n in enumerate(lengths):
        if held:
            assert torch.allclose(batch.states[b, :n], ones[b].states[0], atol=1e-5)
        else:
            assert torch.equal(batch.states[b, :n], ones[b].states[0])


def test_the_grouping_probe_finds_a_kernel_that_rounds_by_batch_size(monkeypatch):
    """An attention kernel whose results move with the call's batch size (a last-bit offset per extra
    sequence) fails probes.grouping_holds; every source then attends alone and equals (torch.equal) its
    encoding alone. What the probe found is kept per (length, count, heads, head size, dtype, threads):
    with the true kernel back, that shape is not checked again and still attends alone; a new count is
    checked once (one call of all its sources, then one each), and groupings_found reports both."""
    monkeypatch.setattr(probes, "decided", probes.Decisions(environment_read=True))
    sdpa, together = F.scaled_dot_product_attention, fast.attend_together

    def by_batch(q, k, v, **kw):
        return sdpa(q, k, v, **kw) * (1 + 2**-20 * (q.shape[0] - 1))

    src = torch.full((4, 7), PAD_ID)
    src[:, :6], src[:, 6] = torch.arange(5, 29).view(4, 6), EOS_ID
    with monkeypatch.context() as mp:
        mp.setattr(fast.F, "scaled_dot_product_attention", by_batch)
        assert not probes.grouping_holds(7, 4, 4, 8, torch.float32, fast.attend_together)  # 4 of 7 tokens, 4 heads of 8
        batch, ones, calls = encode_counting(mp, None, src)
        assert calls == [1] * 8
        for b in range(4):
            assert torch.equal(batch.states[b], ones[b].states[0])
    batch, ones, calls = encode_counting(monkeypatch, None, src)  # the true kernel: the outcome kept
    assert calls == [1] * 8
    checked = []

    def attend(q, k, v, n, out):
        checked.append(q.shape[0] // n)
        together(q, k, v, n, out)

    held = probes.grouping_holds(7, 3, 4, 8, torch.float32, attend)
    assert checked == [3, 1, 1, 1] and probes.grouping_holds(7, 3, 4, 8, torch.float32, attend) is held
    assert checked == [3, 1, 1, 1]  # kept: checked once
    found = probes.groupings_found()[f"{torch.get_num_threads()} thread(s)"]
    assert found == {"tried": 2, "held": int(held), "failed_lengths": [7]}


def test_the_fast_int8_routes_forward_computes_what_its_decoding_computes():
    """Case: on the fast int8 route in float32, teacher forcing went to the route's `reference`, whose
    encoder attends in float64 with padding masked, while decoding encodes each source alone in float32:
    two functions, and the uncached forward wrote another token than the route's own greedy. Now the
    route's forward encodes as its decoding does (the same states, torch.equal) and its logits on greedy's
    output pick greedy's tokens; with gradients on it computes the model's floating-point products."""
    m = int8_copy(copy_model(), "fast", torch.float32)
    src = random_src(905, 6, 16, min_len=1, max_len=14)
    with torch.no_grad():
        for b in range(src.shape[0]):
            one = alone(src, b)
            out = decode_greedy(m, one, max_len=20).tokens[0]
            tgt = torch.cat([torch.tensor([BOS_ID]), out])[None, :-1] if len(out) else torch.tensor([[BOS_ID]])
            hidden = m.forward_hidden(one, tgt)
            assert torch.equal(hidden, m.forward_hidden(one, tgt, memory=m.encode(one)))
            assert torch.equal(m(one, tgt).argmax(-1)[0], out[: tgt.shape[1]]), b
    logits = m(src[:2], torch.full((2, 3), BOS_ID))
    assert logits.requires_grad  # gradients on: the model's own layers, float products
    assert torch.equal(logits, m.model(src[:2], torch.full((2, 3), BOS_ID)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_and_row_invariant_mode_make_every_position_independent_of_the_call(dtype):
    """With row-invariant mode's attention and norms, a verification call of 6 tokens computes
    bitwise what 6 one-token steps compute, in float32 too."""
    m = on_route(tiny_model(22).to(dtype), "invariant", int8=True)
    src = random_src(22, 3, 40)
    tgt = torch.randint(5, 40, (3, 6), generator=torch.Generator().manual_seed(22))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        mem = m.encode(src)
        whole = m.decode(tgt, mem, m.new_cache(3))
        cache = m.new_cache(3)
        steps = torch.cat([m.decode(tgt[:, i : i + 1], mem, cache) for i in range(6)], 1)
    assert torch.equal(whole, steps)


@pytest.mark.parametrize("route", ROUTES)
def test_the_routes_agree_and_stay_near_floating_point(route):
    """The int8 route on the reference and on the fast route computes the same products (float64:
    within rounding of each other, the same greedy tokens), near the floating-point model's logits."""
    m = tiny_model(23, norm_first=route == "fast")
    q_ref, q = int8_copy(m), int8_copy(m, route)
    src = random_src(23, 6, 40)
    tgt = torch.randint(5, 40, (6, 4), generator=torch.Generator().manual_seed(23))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        a, b, f = (mm.decode(tgt, mm.encode(src), mm.new_cache(6)) for mm in (q_ref, q, m))
    assert (a - b).abs().max() < 1e-9
    assert (a - f).abs().max() < 0.1 * f.std()
    assert_rows_equal(
        decode_greedy(q, src, max_len=15).tokens,
        decode_greedy(q_ref, src, max_len=15).tokens,
        "int8 greedy, fast vs reference route",
    )


# -- every lossless decoder on the route equals greedy on the route -------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_lossless_decoders_on_int8_equal_int8_greedy(route, batch, monkeypatch):
    """Batched IAD on a copying model (long drafts accepted and rejected), GAD with a real and an
    adversarial drafter, blockwise with random heads, speculative decoding (self-drafted and with a
    random small model) and BiLD at its greedy limit, on the int8 route, each equal row by row to
    batch-1 greedy on the int8 route (float64, torch.equal)."""
    copying = int8_copy(copy_model(), route)
    src = random_src(400 + batch, batch, 16, min_len=1, max_len=14)
    check_batched_iad(copying, src, 30)
    check_batched_iad(copying, src, 30, max_draft=3, match="longest")

    vocab = 12 if batch % 2 else 40
    m = int8_copy(tiny_model(batch + 30, vocab=vocab), route)
    small = int8_copy(tiny_model(batch + 130, vocab=vocab, d_model=16, layers=(1, 1)), route)
    drafter = Drafter(int8_copy(tiny_model(batch + 80, vocab=vocab, layers=(1, 2)), route), k=1 + batch % 5)
    src = ragged_src(700 + batch, batch, vocab)
    max_len = 20
    ref = batch1_greedy(m, src, max_len)
    assert_rows_equal(decode_gad(m, drafter, src, max_len=max_len).tokens, ref, "gad")
    refs = [t.tolist() + [EOS_ID] for t in ref]
    with monkeypatch.context() as mp:
        mp.setattr(gad_module, "draft_blocks", adversarial_drafter(refs, batch + max_len, vocab))
        assert_rows_equal(
            decode_gad(m, Drafter(drafter.model, k=6), src, max_len=max_len).tokens, ref, "gad adversarial"
        )
    assert_rows_equal(decode_blockwise(m, random_heads(m, 3, batch), src, max_len=max_len).tokens, ref, "blockwise")
    assert_rows_equal(decode_speculative(m, m, src, max_len=max_len, gamma=4).tokens, ref, "speculative self")
    assert_rows_equal(
        decode_speculative(m, small, src, max_len=max_len, gamma=1 + batch % 4).tokens, ref, "speculative"
    )
    assert_rows_equal(decode_bild(m, small, src, max_len=max_len, fallback_threshold=1.5).tokens, ref, "bild")


def test_lossless_decoders_on_int8_equal_int8_greedy_in_float32():
    """In float32 on the fast route (where the attention's roundings depend on the call's shape),
    IAD, blockwise and speculative decoding still write int8 greedy's tokens on these models; with
    row-invariant mode the verification calls equal the steps bitwise (the test above)."""
    m = int8_copy(copy_model(), "fast", torch.float32)
    src = random_src(900, 8, 16, min_len=1, max_len=14)
    ref = batch1_greedy(m, src, 30)
    assert_rows_equal(decode_iad(m, src, max_len=30).tokens, ref, "iad float32")
    assert_rows_equal(
        decode_blockwise(m, random_heads(m, 3, 8).float(), src, max_len=30).tokens, ref, "blockwise float32"
    )
    assert_rows_equal(decode_speculative(m, m, src, max_len=30, gamma=4).tokens, ref, "speculative float32")


# -- the wrapper -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_the_model_stays_float_training_stays_float_and_weight_writes_are_followed(route):
    """The route leaves the model in floating point (its float logits as before); with gradients on
    the route computes the floating-point products; after an SGD step, a fused Adam step (which
    advances no version counter) and load_state_dict, int8 greedy equals a fresh int8 route's on the
    same weights."""
    m = tiny_model(24)
    model = copy.deepcopy(m)
    q = on_route(model, route, int8=True)
    assert is_int8(q) and not is_int8(model) and type(model.decoder[0].ff.w1) is torch.nn.Linear
    src = random_src(24, 3, 40)
    tgt = torch.randint(5, 40, (3, 6))

    def logits(route_, grad=False):
        with torch.set_grad_enabled(grad):
            return route_.decode(tgt[:, :1], route_.encode(src), route_.new_cache(3)).detach()

    assert (logits(q, True) - logits(m, True)).abs().max() < 1e-9  # gradients on: the floating-point products
    before = logits(q)
    assert not torch.equal(before, logits(m)) and torch.equal(logits(model), logits(m))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1, fused=True)):
        decode_greedy(q, src, max_len=8)  # int8 weights made before the step
        model.train()
        opt.zero_grad()
        model(src, tgt).logsumexp(-1).mean().backward()
        opt.step()
        model.eval()
        fresh = int8_copy(model, route)
        after = logits(q)
        assert not torch.equal(after, before) and torch.equal(after, logits(fresh))
        assert_rows_equal(
            decode_greedy(q, src, max_len=8).tokens,
            decode_greedy(fresh, src, max_len=8).tokens,
            f"int8 greedy after {type(opt).__name__}",
        )
    model.load_state_dict(state)
    assert torch.equal(logits(q), before)


def test_int8_is_a_run_option_of_compare():
    a, b, c = parse_compare("greedy,greedy:int8,iad:max-draft=4:int8")
    assert (a.int8, b.int8, c.int8) == (False, True, True) and c.options == {"max_draft": 4}
    with pytest.raises(UsageError, match="NAME=VALUE"):
        parse_compare("greedy:int9")


def test_decode_compares_int8_runs_with_float_runs_in_one_process(tmp_path, capsys):
    """decode.py --compare greedy:int8,iad:int8: the int8 runs on one int8 copy of the model (IAD
    checked against int8 greedy), int8 greedy checked against float greedy line by line, and
    --int8 puts every run on the route."""
    import decode

    ckpt = random_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:4]) + "\n", encoding="utf-8")
    common = [
        "--task",
        "mt-en-de",
        "--model",
        str(ckpt),
        "--input",
        str(tmp_path / "in.txt"),
        "--max-len",
        "12",
        "--warmup",
        "0",
        "--quiet",
        "--output",
        str(tmp_path / "out.txt"),
        "--overwrite",
        "--report",
        str(tmp_path / "r.json"),
    ]
    assert decode.main(["--algo", "greedy", "--compare", "greedy:int8,iad:int8", "--fast", *common]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [r["algo"] for r in rep["runs"]] == ["greedy", "greedy:int8", "iad:int8"] and rep["int8"] is False
    checks = {(c["algo"], c["greedy"]): c for c in rep["lossless_checks"]}
    assert checks["iad:int8", "greedy:int8"]["identical"] == 1.0
    against_float = checks["greedy:int8", "greedy"]
    assert against_float["int8_against_float"] and len(against_float["divergences"]) == round(
        4 * (1 - against_float["identical"])
    )
    assert "greedy:int8 vs greedy:" in capsys.readouterr().out
    assert decode.main(["--algo", "iad", "--compare", "greedy", "--int8", *common]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["int8"] is True and rep["lossless_checks"][0]["identical"] == 1.0


SLOW_INT8 = "warning: torch's int8 products are slow on this CPU"


@pytest.mark.parametrize("cpu, warned", [(("AVX2", ZEN3_FLAGS), True), (("AVX512", AVX512_FLAGS), False)])
def test_decode_warns_once_where_int8_is_slower_than_float32(cpu, warned, tmp_path, capsys, monkeypatch):
    """Guards against the int8 route running several times slower than float32 without a word: on a CPU
    without fast int8 products (torch reports AVX2, no AVX-512), --int8 and --compare ...:int8 print one
    warning line on stderr naming the capability and what to run instead, however many runs are on the
    route; a run without int8 is not warned, nor a CPU with AVX-512; the report records the CPU; a
    refused command still prints one line."""
    import decode

    fake_cpu(monkeypatch, *cpu)
    ckpt = random_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:2]) + "\n", encoding="utf-8")
    common = [
        "--task",
        "mt-en-de",
        "--model",
        str(ckpt),
        "--input",
        str(tmp_path / "in.txt"),
        "--max-len",
        "6",
        "--warmup",
        "0",
        "--quiet",
        "--output",
        str(tmp_path / "out.txt"),
        "--overwrite",
        "--report",
        str(tmp_path / "r.json"),
    ]
    for route in (["--int8"], ["--compare", "greedy:int8,iad:int8"], ["--fast"]):
        capsys.readouterr()
        assert decode.main(["--algo", "iad", *route, *common]) == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith(SLOW_INT8)]
        assert len(lines) == (1 if warned and route != ["--fast"] else 0), (route, err)
        if lines:
            assert f"CPU capability {cpu[0]}" in lines[0] and "slower than float32" in lines[0]
            assert lines[0].endswith("decode with --fast, without --int8 and :int8")
        env = json.loads((tmp_path / "r.json").read_text())["environment"]
        assert env["cpu_capability"] == cpu[0] and env["cpu_int8_products"] == ("slow" if warned else "fast")
    # a usage error is still one line: the warning comes once every check has passed
    assert "graphed route has no int8 form" in error_of(
        decode.main, ["--algo", "iad", "--int8", "--graphed", *common], capsys, monkeypatch
    )


@pytest.mark.parametrize("cpu, warned", [(("AVX2", ZEN3_FLAGS), True), (("AVX512", AVX512_FLAGS), False)])
def test_int8bench_warns_where_int8_is_slow_and_reports_the_machine(cpu, warned, tmp_path, capsys, monkeypatch):
    """python -m refdec int8bench: the warning where int8 products are slow, the machine in its printed
    header and in its report."""
    from refdec.commands.int8bench import main

    fake_cpu(monkeypatch, *cpu)
    ckpt = random_checkpoint(tmp_path / "ckpt")
    assert (
        main(
            [
                "--task",
                "mt-en-de",
                "--model",
                str(ckpt),
                "--rows",
                "1,2",
                "--rounds",
                "1",
                "--reps",
                "1",
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert err.count(SLOW_INT8) == warned and f"CPU capability {cpu[0]}" in out and "1 thread(s)" in out
    env = json.loads((tmp_path / "r.json").read_text())["environment"]
    assert (env["cpu_capability"], env["threads"], env["torch"]) == (cpu[0], 1, torch.__version__)


def test_int8bench_finds_the_routes_product_row_invariant():
    """python -m refdec int8bench's figures on a tiny model's shapes: every candidate timed at each row
    count, and the route's per-row product the same for row 0 alone and within more rows."""
    from refdec.commands.int8bench import measure, table

    results = measure(tiny_model(25), [1, 5], rounds=1, reps=1)
    assert {r["candidate"] for r in results} == {"float32", "weight-only", "per-tensor", "per-row"}
    assert all(r["us"][1] > 0 and r["us"][5] > 0 for r in results)
    assert all(r["row_0_same"][5] for r in results if r["candidate"] == "per-row")
    assert "vocabulary" in table(results, [1, 5])


def test_int8_and_the_graphed_route_are_refused_together_in_one_line():
    """Guards against an int8 run silently taking the graphed route, which has no int8 form."""
    from refdec.app.loading import load_models
    from refdec.app.plan import plan_runs
    from refdec.errors import UsageError

    specs = plan_runs(
        "greedy", "gec-en", model=None, given={}, compares=[], batch_size=None, sizes=None, batch_tokens=None, int8=True
    )
    with pytest.raises(UsageError, match="graphed route has no int8 form"):
        load_models(specs, {}, task="gec-en", device="cpu", dtype=torch.float32, route="graphed")
