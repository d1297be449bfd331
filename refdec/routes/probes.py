"""The probes: every choice the routes make by what this machine does, found on the machine, kept for the
process, reported, and readable back from a machine report.

What depends on the CPU a run is on, not on the code (docs/machines.md), is decided here, each decision by
a probe on random operands of the shape in question (the values do not decide which instructions run; the
shape and the thread count do), at the first call that needs it:

    plan_for            which kernel computes an int8 product with a weight of a given shape fastest:
                        oneDNN's fused product, from how many rows, or torch._int_mm with a rescaling, whole
                        or in blocks of rows (timed: `probe_plan`, `race`)
    weight_levels       whether torch._int_mm sums int8 products exactly at full range, or with 7-bit weights
                        only (checked: `exact_products`)
    fused_kernel_exact  whether oneDNN's fused product is bitwise the plain one (checked: `check_fused`)
    grouping_holds      whether the fast route's encoder may attend over sources of one length in one call,
                        each coming out bitwise as it does alone (checked: `check_grouping`)
    int8_slowdown       torch._int_mm's time against float32's on one product (timed), the figure the int8
                        warning quotes (refdec.machine.int8_warning)

None of them changes a value: a kernel is taken only where it computes what the other would, and the
grouped attention only where it equals the single calls. The probes import nothing of the routes they
decide for: refdec.routes.int8 hands over its kernels (`Int8Kernels`) and refdec.routes.fast its attention
call, so that what is timed and checked is what the route runs.

Every decision is kept for the process under what it holds for (shape, dtype, thread count: `decided`).
`found` says what was decided, for every timing report (refdec.machine.environment's `probes`); `recorded`
gives the same decisions exactly, with the machine they were made on, which `refdec machine --report FILE`
writes. Decisions fixed up front: a process whose environment holds REFDEC_MACHINE_REPORT=FILE reads every
decision FILE records at the first decision it needs (`read_environment`), and takes them as they are:
no probe runs for them; a decision FILE lacks (another shape, another thread count) is probed as without
it. A file that is not a machine report, or one made on another CPU or with another torch, is refused in
one line (`read_machine_report`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import UsageError
from ..timing import interleaved

REPORT_VARIABLE = "REFDEC_MACHINE_REPORT"  # the machine report a process reads its decisions from
MACHINE_REPORT = "refdec machine"  # what a machine report records as its "command"
INT8_MAX = 127  # the largest magnitude of the int8 route's activations (refdec.routes.int8.LEVELS)
CHECKS = ("weight_levels", "fused_kernel_exact")  # the properties checked once per process (Decisions.checks)


@dataclass(frozen=True)
class Plan:
    """How this machine computes the int8 products of one weight shape, found by `probe_plan`:
    `fused_from` the row count from which oneDNN's fused product is taken (None: never), `blocks`
    whether a large plain product goes in blocks of rows (refdec.routes.int8.row_blocks), `timings`, what
    the probe measured (kernel, rows, microseconds per call, the kernel it was timed against, its
    microseconds), and `why`, the fused product's outcome in words."""

    fused_from: int | None
    blocks: bool
    timings: tuple = ()
    why: str = ""


@dataclass
class Decisions:
    """What this process has decided about the machine, each under what it holds for: `plans` ((in, out,
    threads) -> Plan), `grouping` ((length, count, heads, head size, dtype, threads) -> whether it holds),
    `slowdowns` (threads -> int8_slowdown), `float_plans` ((d_model, d_ff, vocabulary, threads,
    dtype) -> FloatPlan), `checks` ("weight_levels", "fused_kernel_exact" -> what was
    found); `source`, the machine report decisions were read from (None: none was), and `environment_read`,
    whether REFDEC_MACHINE_REPORT has been read (or is not to be)."""

    plans: dict = field(default_factory=dict)
    grouping: dict = field(default_factory=dict)
    slowdowns: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    float_plans: dict = field(default_factory=dict)
    source: str | None = None
    environment_read: bool = False


decided = Decisions()
revision = [0]  # how many times the decisions have been dropped, read or measured: kept choices are stale after


def kept(table: dict, key, probe: Callable[[], object]):
    """table[key]: read first from the machine report REFDEC_MACHINE_REPORT names (once per process), else
    found now by `probe` and kept."""
    if key not in table:
        read_environment()
        if key not in table:
            table[key] = probe()
    return table[key]


def forget(read_report: bool = True) -> None:
    """Drops every decision this process has made or read, so that the next ones are probed again; with
    `read_report` False, REFDEC_MACHINE_REPORT is not read either (`refdec machine`: every probe now)."""
    global decided
    decided = Decisions(environment_read=not read_report)
    revision[0] += 1


# -- the int8 product's exactness on this CPU -----------------------------------------------------------
def weight_levels() -> int:
    """127, or 63 if this CPU's int8 product saturates at full range (x86 without VNNI sums pairs of
    u8 x s8 products in int16; 7-bit weights keep those sums in range, as fbgemm's reduce_range does):
    a property of the machine, found once per process."""
    return kept(decided.checks, "weight_levels", find_levels)


def find_levels() -> int:
    """The widest weight range whose int8 products torch._int_mm sums exactly here (`exact_products`)."""
    levels = next((n for n in (127, 63) if exact_products(n)), 0)
    if not levels:
        raise RuntimeError(
            "torch._int_mm does not compute int8 products exactly on this machine; "
            "the int8 route cannot run here (decode without --int8)"
        )
    return levels


def exact_products(levels: int) -> bool:
    """Whether torch._int_mm equals the int64 product on extreme and random int8 operands, weights
    within +-levels, for a few shapes (one row, a few rows, many)."""
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 768, 24), (5, 256, 40), (64, 1024, 16)):
        x = torch.randint(-INT8_MAX, INT8_MAX + 1, (m, k), generator=g, dtype=torch.int8)
        w = torch.randint(-levels, levels + 1, (k, n), generator=g, dtype=torch.int8)
        x[0], w[:, 0] = INT8_MAX, -levels  # the largest sums
        x[-1, ::2], x[-1, 1::2] = -INT8_MAX, INT8_MAX
        if not torch.equal(torch._int_mm(x, w).long(), x.long() @ w.long()):
            return False
    return True


class Int8Kernels(NamedTuple):
    """The kernels an int8 product may be computed by, handed over by refdec.routes.int8 (its KERNELS), so
    that the probes time and check what its product() runs:

        rescale(p, sx, sw, add)         torch._int_mm's int32 sums p converted, times sw and sx, plus add
        fused(xq, packed, zeros, sw)    the same without sx and add, in one call of oneDNN's fused product
        pack(q)                         an int8 (in, out) weight packed for `fused`: (packed, zeros)
        fused_available()               whether this torch build has the fused product at all
        row_blocks(m, n)                the blocks of rows an (m, n) plain product goes in where blocks are taken
        blocked_from(n)                 the fewest rows from which an (m, n) plain product goes in blocks"""

    rescale: Callable
    fused: Callable
    pack: Callable
    fused_available: Callable[[], bool]
    row_blocks: Callable
    blocked_from: Callable[[int], int]


def fused_kernel_exact(kernels: Int8Kernels) -> bool:
    """Whether oneDNN's fused int8 kernel is there and computes exactly what torch._int_mm and the
    rescaling compute, bitwise: found once per process (`check_fused`), and only where a plan would take
    it (on a CPU where it is slow, these calls take seconds)."""
    return kept(decided.checks, "fused_kernel_exact", lambda: check_fused(kernels))


def check_fused(kernels: Int8Kernels) -> bool:
    """The fused kernel against torch._int_mm and the rescaling (the int32 sums, converted, times the
    channel scales) on extreme and random operands of a few shapes, weights within +-weight_levels()."""
    if not kernels.fused_available():
        return False
    g, levels = torch.Generator().manual_seed(0), weight_levels()
    try:
        for m, k, n in ((1, 768, 4096), (64, 256, 1024), (300, 1024, 256)):
            x = torch.randint(-INT8_MAX, INT8_MAX + 1, (m, k), generator=g, dtype=torch.int8)
            q = torch.randint(-levels, levels + 1, (n, k), generator=g, dtype=torch.int8).t()
            x[0], q[:, 0] = INT8_MAX, -levels  # the largest sums
            x[-1, ::2], x[-1, 1::2] = -INT8_MAX, INT8_MAX
            scale = torch.rand(n, generator=g) * 1e-3 + 1e-6
            got = kernels.fused(x, *kernels.pack(q), scale)
            if not torch.equal(got, kernels.rescale(torch._int_mm(x, q), torch.ones(m, 1), scale, None)):
                return False
    except RuntimeError:  # a build or CPU whose oneDNN has no such kernel
        return False
    return True


# -- which kernel computes an int8 product fastest on this CPU --------------------------------------------
# The fused product is first tried from this many output values on, or for outputs this wide (the
# vocabulary): the row counts the probe times it at (below, a call costs more than it could save).
FUSED_ELEMENTS = 1 << 16
FUSED_WIDTH = 1 << 12
PROBE_ROUNDS = 5  # timed calls of each kernel per row count, interleaved; the fastest of each counts
GIVE_UP = 10  # a kernel this many times slower than the other at the first round is timed no further
BLOCKS_MARGIN = 0.95  # row blocks are taken where they took less than this share of the whole product's time


def plan_for(k: int, n: int, kernels: Int8Kernels) -> Plan:
    """This machine's plan for products with a (k, n) int8 weight at the current thread count: read from
    a machine report, or probed (`probe_plan`) at the first call of each (shape, thread count) in a
    process, then kept."""
    key = (k, n, torch.get_num_threads())
    plan = decided.plans.get(key)
    return plan if plan is not None else kept(decided.plans, key, lambda: probe_plan(k, n, kernels))


def probe_plan(k: int, n: int, kernels: Int8Kernels) -> Plan:
    """Times both kernels on random int8 operands of the weight's shape, interleaved, after a warm-up: the
    fused product at one row, then at the row counts where product() would first take it (FUSED_ELEMENTS,
    FUSED_WIDTH) and four times that; it is taken from the smallest of those from which it is faster at
    every count timed, where it agrees bitwise with the plain form (`fused_kernel_exact`). Where it is
    GIVE_UP times slower at one row it is timed no further (on a CPU where it is a thousand times slower, a
    larger call would take seconds). Then, where a plain product of that many rows would go in blocks
    (`blocked_from`) and is computed by torch._int_mm, one such product whole and in blocks: blocks where
    they were clearly faster (BLOCKS_MARGIN), not where the two differ by the timing's noise."""
    g = torch.Generator().manual_seed(k * 8191 + n)
    levels = weight_levels()
    q = torch.randint(-levels, levels + 1, (n, k), generator=g, dtype=torch.int8).t()  # laid out as the route's
    scale = torch.rand(n, generator=g) * 1e-3 + 1e-6

    def operands(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(-INT8_MAX, INT8_MAX + 1, (m, k), generator=g, dtype=torch.int8), torch.ones(m, 1)

    def plain(x, ones):
        return kernels.rescale(torch._int_mm(x, q), ones, scale, None)

    timings, fused_from, why = [], None, "this torch build has no oneDNN fused int8 product"
    if kernels.fused_available():
        packed = kernels.pack(q)

        def fused_call(x, ones):
            return kernels.fused(x, *packed, scale)

        m0 = 1 if n >= FUSED_WIDTH else -(-FUSED_ELEMENTS // n)
        t_fused, t_plain = race(fused_call, plain, operands(1), give_up=GIVE_UP)
        timings.append(("fused", 1, t_fused, "plain", t_plain))
        faster = {1: t_fused < t_plain}
        if t_fused > GIVE_UP * t_plain:
            why = f"{t_fused / t_plain:.0f}x slower than torch._int_mm and a rescaling at one row here"
        else:
            for m in (m0, 4 * m0):
                if m not in faster:
                    t_fused, t_plain = race(fused_call, plain, operands(m))
                    timings.append(("fused", m, t_fused, "plain", t_plain))
                    faster[m] = t_fused < t_plain
            counts = [m for m in faster if m >= m0]
            start = next((m for i, m in enumerate(counts) if all(faster[c] for c in counts[i:])), None)
            if start is None:
                why = "slower than torch._int_mm and a rescaling here"
            elif not fused_kernel_exact(kernels):
                why = "faster here, but not bitwise the plain form"
            else:
                fused_from, why = start, f"faster here from {start} row(s) on"
    mb = kernels.blocked_from(n)
    blocks = False
    if fused_from is None or mb < fused_from:
        x, ones = operands(mb)

        def in_blocks(x, ones):
            return [plain(x[b], ones[b]) for b in kernels.row_blocks(mb, n)]

        t_blocks, t_whole = race(in_blocks, plain, (x, ones))
        timings.append(("blocks", mb, t_blocks, "whole", t_whole))
        blocks = t_blocks < BLOCKS_MARGIN * t_whole
    return Plan(fused_from, blocks, tuple(timings), why)


def race(f, g, args: tuple, give_up: float | None = None) -> tuple[float, float]:
    """Microseconds per call of f(*args) and g(*args): the fastest of PROBE_ROUNDS calls each, interleaved
    (refdec.timing.interleaved), after one call of each; once f's fastest is `give_up` times g's, no more
    rounds. Every timing the probes make is made here."""
    stop = None if give_up is None else (lambda times: min(times[0]) > give_up * min(times[1]))
    with torch.inference_mode():
        times_f, times_g = interleaved([lambda: f(*args), lambda: g(*args)], PROBE_ROUNDS, give_up=stop)
    return min(times_f) * 1e6, min(times_g) * 1e6


# The product int8_slowdown times: docs/int8.md's, (rows, in, out), a verification call's few rows on a
# shipped-size layer.
SLOWDOWN_SHAPE = (17, 256, 1024)


def int8_slowdown() -> float:
    """How many times longer torch._int_mm takes here than the float32 product of the same shape
    (SLOWDOWN_SHAPE, random operands), the fastest of interleaved calls (`race`, which stops after one
    round where int8 is GIVE_UP times slower: on a CPU where it is hundreds of times slower each call takes
    milliseconds). Found once per process and thread count, so that the int8 warning reports what this
    machine did rather than a figure from another."""
    return kept(decided.slowdowns, torch.get_num_threads(), measure_slowdown)


def measure_slowdown() -> float:
    """int8_slowdown's figure, timed now on SLOWDOWN_SHAPE."""
    m, k, n = SLOWDOWN_SHAPE
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-INT8_MAX, INT8_MAX + 1, (m, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-INT8_MAX, INT8_MAX + 1, (n, k), generator=g, dtype=torch.int8).t()  # as the route's
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    t_int8, t_float = race(torch._int_mm, lambda _x, _w: x @ w, (xq, wq), give_up=GIVE_UP)
    return t_int8 / t_float


# -- which kernel computes a float product ------------------------------------------------------------------
ROW_CLASSES = ("1", "2-7", "8-31", "32+")  # the row counts a float plan chooses a kernel for, each class alone
CLASS_ROWS = (1, 4, 16, 64)  # the row count each class is timed at (`measure_float_plan`)
FLOAT_ROUNDS = 7  # interleaved rounds of a float probe; the median counts


@dataclass(frozen=True)
class FloatPlan:
    """Which kernel (refdec.routes.products.KERNELS) computes the float products of a model's decoder step and
    encoder, for each class of row counts (ROW_CLASSES); `why`, in words; `timings`, what a probe measured:
    (rows, ((kernel, microseconds per step's products), ...)) per class."""

    kernels: tuple[str, ...]
    why: str
    timings: tuple = ()


class FloatKernels(NamedTuple):
    """What refdec.routes.products hands over for `measure_float_plan` to time: `available` (dtype -> the
    kernels there), `weight` ((in, out) tensor -> the weight as its products take it) and `product`
    (kernel, x, weight -> x @ weight on that kernel)."""

    available: Callable
    weight: Callable
    product: Callable


def row_class(rows: int) -> int:
    """The index in ROW_CLASSES of a product of `rows` rows."""
    return 0 if rows <= 1 else 1 if rows < 8 else 2 if rows < 32 else 3


def step_products(d_model: int, d_ff: int, vocab: int, layers: int = 6) -> list[tuple[int, int]]:
    """The (in, out) of every float product of one decoder step of the fast route, in its order: per layer the
    self-attention's queries-keys-values and output, the cross-attention's queries and output, the two
    feed-forward products; then the vocabulary."""
    D = d_model
    return [(D, 3 * D), (D, D), (D, D), (D, D), (D, d_ff), (d_ff, D)] * layers + [(D, vocab)]


def float_plan(model: tuple[int, int, int], dtype: torch.dtype, available: tuple[str, ...]) -> FloatPlan:
    """The kernel of each row class for the float products of a model of `model` = (d_model, d_ff,
    vocabulary) in `dtype` at this thread count: as the machine report REFDEC_MACHINE_REPORT records it, else
    by `cpu_rule` (which times nothing: the choice changes how sums round, so it is never made by a fresh
    timing). A kernel the plan names that is not `available` here is torch's."""
    plan = kept(decided.float_plans, (*model, torch.get_num_threads(), dtype), lambda: cpu_rule(dtype, available))
    if all(kernel in available for kernel in plan.kernels):
        return plan
    return FloatPlan(tuple(k if k in available else "torch" for k in plan.kernels), plan.why, plan.timings)


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "vendor_id", "flags", ...); empty where
    there is none (refdec.machine reads the CPU through it too)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n")[0]  # processors are separated by blank lines
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def cpu_vendor() -> tuple[str, frozenset[str]]:
    """The CPU's vendor and flags as /proc/cpuinfo's first processor gives them (empty where it does not)."""
    fields = cpuinfo()
    return fields.get("vendor_id", ""), frozenset(fields.get("flags", "").split())


def cpu_rule(dtype: torch.dtype, available: tuple[str, ...]) -> FloatPlan:
    """The float products' kernels by the CPU alone (the same on every run of one machine): on an AMD CPU,
    numpy's OpenBLAS for one row (MKL's one-row products stream the weights slower there), and from two
    rows oneDNN where the CPU has AVX-512 (MKL does not use it on AMD), else OpenBLAS (faster than MKL at
    1 to 32 rows on an AMD EPYC with AVX2); on any other CPU, torch's own product (MKL on Intel's)."""
    vendor, flags = cpu_vendor()
    if vendor != "AuthenticAMD":
        return FloatPlan(("torch",) * 4, f"by the CPU ({vendor or 'vendor not listed'}): torch's product throughout")
    one = "openblas" if "openblas" in available else "torch"
    many = "onednn" if "onednn" in available and "avx512f" in flags else one
    isa = "AVX-512" if "avx512f" in flags else "no AVX-512"
    return FloatPlan((one, many, many, many), f"by the CPU (AuthenticAMD, {isa}): {one} for 1 row, {many} from 2")


def measure_float_plan(model: tuple[int, int, int], dtype: torch.dtype, kernels: FloatKernels) -> FloatPlan:
    """Times every available kernel on the products of one decoder step of a model of `model` = (d_model,
    d_ff, vocabulary) (`step_products`, six layers of random weights: as in a decoder step, a weight is not in
    the core's cache when its product starts) at each row class's CLASS_ROWS, FLOAT_ROUNDS interleaved
    rounds; takes for each class the kernel of the least median, and keeps the plan as this process's
    decision (`refdec machine` records it in its report, which later processes read back: no run decides it
    by timing)."""
    g = torch.Generator().manual_seed(0)
    available = kernels.available(dtype)
    weights = [kernels.weight(torch.randn(k, n, generator=g, dtype=dtype) * k**-0.5) for k, n in step_products(*model)]
    chosen, timings = [], []
    with torch.inference_mode():
        for rows in CLASS_ROWS:
            xs = {k: torch.randn(rows, k, generator=g, dtype=dtype) for k in {w.shape[0] for w in weights}}
            calls = [
                lambda name=name, xs=xs: [kernels.product(name, xs[w.shape[0]], w) for w in weights]
                for name in available
            ]
            medians = [statistics.median(t) * 1e6 for t in interleaved(calls, FLOAT_ROUNDS)]
            chosen.append(available[medians.index(min(medians))])
            timings.append((rows, tuple((name, round(us, 1)) for name, us in zip(available, medians))))
    plan = FloatPlan(tuple(chosen), f"timed here at {', '.join(map(str, CLASS_ROWS))} rows", tuple(timings))
    decided.float_plans[(*model, torch.get_num_threads(), dtype)] = plan
    revision[0] += 1
    return plan


# -- whether sources of one length may share an attention call ----------------------------------------------
def grouping_holds(n: int, r: int, H: int, Dh: int, dtype: torch.dtype, attend: Callable) -> bool:
    """Whether r sequences of n rows attended in one call by `attend` (refdec.routes.fast.attend_together)
    each come out bitwise as that sequence attended alone, on this machine at the current thread count:
    read from a machine report, or checked (`check_grouping`) once per process for each (n, r, H, Dh,
    dtype, thread count)."""
    key = (n, r, H, Dh, dtype, torch.get_num_threads())
    held = decided.grouping.get(key)
    return held if held is not None else kept(decided.grouping, key, lambda: check_grouping(n, r, H, Dh, dtype, attend))


def check_grouping(n: int, r: int, H: int, Dh: int, dtype: torch.dtype, attend: Callable) -> bool:
    """r random sequences laid out as the encoder's, attended together and one by one: a few attention
    calls."""
    g = torch.Generator().manual_seed(n * 131 + r)
    q, k, v = (torch.randn(r * n, H, Dh, generator=g).to(dtype) for _ in range(3))
    together, alone = torch.empty_like(q), torch.empty_like(q)
    attend(q, k, v, n, together)
    for i in range(0, r * n, n):
        attend(q[i : i + n], k[i : i + n], v[i : i + n], n, alone[i : i + n])
    return torch.equal(together, alone)


# -- what was decided: the report, and the record a later process reads back ------------------------------
def found() -> dict:
    """What the probes decided in this process, for a report (refdec.machine.environment's `probes`): each
    int8 weight shape's plan with its timings (`plans_made`), where the fast route's encoder may attend over
    sources of one length in one call (`groupings_found`), and the machine report the decisions were read
    from (`read_from`, None where none was)."""
    return {
        "int8_plans": plans_made(),
        "float_products": float_plans_made(),
        "grouped_attention": groupings_found(),
        "read_from": decided.source,
    }


def float_plans_made() -> dict[str, dict]:
    """Every float plan this process has decided or read: "d_model D, d_ff F, vocabulary V, DTYPE, T thread(s)"
    -> the kernel of each row class, why, and a probe's timings (refdec machine's)."""
    out = {}
    for (d, f, v, threads, dtype), plan in sorted(decided.float_plans.items(), key=lambda item: str(item[0])):
        out[f"d_model {d}, d_ff {f}, vocabulary {v}, {dtype_name(dtype)}, {threads} thread(s)"] = {
            "kernels": dict(zip(ROW_CLASSES, plan.kernels)),
            "why": plan.why,
            "timings_us": [{"rows": rows, **dict(by_kernel)} for rows, by_kernel in plan.timings],
        }
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def plans_made() -> dict[str, dict]:
    """Every plan this process has found or read: "K x N, T thread(s)" -> its choices and timings."""
    out = {}
    for (k, n, threads), plan in sorted(decided.plans.items()):
        out[f"{k} x {n}, {threads} thread(s)"] = {
            "fused_from_rows": plan.fused_from,
            "row_blocks": plan.blocks,
            "why": plan.why,
            "timings_us": [
                {"kernel": a, "rows": m, "us": round(ta, 1), "against": b, "against_us": round(tb, 1)}
                for a, m, ta, b, tb in plan.timings
            ],
        }
    return out


def groupings_found() -> dict:
    """What `grouping_holds` has found or read in this process: how many (length, count) shapes it tried
    and held, per thread count, and the lengths where it did not hold (their sequences then attend alone)."""
    out: dict = {}
    for threads, n, held in sorted((key[5], key[0], held) for key, held in decided.grouping.items()):
        entry = out.setdefault(f"{threads} thread(s)", {"tried": 0, "held": 0, "failed_lengths": []})
        entry["tried"] += 1
        entry["held"] += held
        if not held and n not in entry["failed_lengths"]:
            entry["failed_lengths"].append(n)
    return out


def this_machine() -> dict[str, str]:
    """What the decisions hold on, as a machine report records it: the CPU by name (the first model name in
    /proc/cpuinfo, as refdec.machine.cpu_model reads it, else the platform's word for it), the vector
    instructions torch's kernels use there (its CPU capability) and torch's version."""
    return {
        "cpu": cpuinfo().get("model name") or platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def recorded() -> dict:
    """Every decision this process has made or read, exactly, and the machine they hold on: what a machine
    report keeps (`refdec machine --report FILE`: its "decisions") and `read_machine_report` takes back.
    Grouped attention is recorded per (heads, head size, dtype, threads): for each count of sources, the
    lengths where it held and those where it did not."""
    groups: dict = {}
    for (n, r, H, Dh, dtype, threads), held in decided.grouping.items():
        group = groups.setdefault((threads, H, Dh, str(dtype).replace("torch.", "")), {"held": {}, "not_held": {}})
        group["held" if held else "not_held"].setdefault(r, []).append(n)
    return {
        "machine": this_machine(),
        "checks": dict(decided.checks),
        "int8_plans": [
            {"in": k, "out": n, "threads": t, "fused_from_rows": p.fused_from, "row_blocks": p.blocks, "why": p.why}
            for (k, n, t), p in sorted(decided.plans.items())
        ],
        "int8_slowdown": [{"threads": t, "times_float32": ratio} for t, ratio in sorted(decided.slowdowns.items())],
        "float_products": [
            {
                "d_model": d,
                "d_ff": f,
                "vocab": v,
                "threads": t,
                "dtype": dtype_name(dt),
                "kernels": dict(zip(ROW_CLASSES, p.kernels)),
                "why": p.why,
            }
            for (d, f, v, t, dt), p in sorted(decided.float_plans.items(), key=lambda item: str(item[0]))
        ],
        "grouped_attention": [
            {
                "heads": H,
                "head_size": Dh,
                "dtype": dtype,
                "threads": t,
                **{side: {str(r): sorted(by_count[r]) for r in sorted(by_count)} for side, by_count in sides.items()},
            }
            for (t, H, Dh, dtype), sides in sorted(groups.items())
        ],
    }


def read_environment() -> None:
    """Reads the machine report REFDEC_MACHINE_REPORT names (`read_machine_report`), once per process, at
    the first decision a process needs; nothing where the variable is not set."""
    if decided.environment_read:
        return
    path = os.environ.get(REPORT_VARIABLE)
    if path:
        read_machine_report(path, f"{REPORT_VARIABLE}={path}")
    decided.environment_read = True


def read_machine_report(path: str, named: str | None = None) -> int:
    """Takes every decision the machine report at `path` records (`recorded`) as this process's, in place of
    any made before, and returns how many it took. Refuses in one line (UsageError, `named`: how the user
    named the file) a file that is not a machine report, or one made on another CPU or with another torch
    (`this_machine`): its plans would not be this machine's."""
    named = named or path
    again = "python -m refdec machine --report FILE writes one"
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{named}: cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"{named}: not a machine report, not even JSON ({again})") from None
    decisions = report.get("decisions") if isinstance(report, dict) else None
    if not isinstance(decisions, dict) or report.get("command") != MACHINE_REPORT:
        raise UsageError(f"{named}: not a machine report ({again}, with the decisions a run reads back)")
    made_on, here = decisions.get("machine"), this_machine()
    if made_on != here:
        raise UsageError(
            f"{named}: its decisions were made on {described(made_on)}, not on this machine ({described(here)}); "
            f"run python -m refdec machine --report FILE here"
        )
    try:
        taken = take(decisions, path)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UsageError(f"{named}: its decisions cannot be read ({again})") from None
    decided.source = path
    return taken


def described(machine) -> str:
    """A recorded machine (`this_machine`) in words, for a refusal."""
    if not isinstance(machine, dict):
        return "a machine it does not name"
    return f"{machine.get('cpu')}, CPU capability {machine.get('cpu_capability')}, torch {machine.get('torch')}"


def take(decisions: dict, path: str) -> int:
    """Every decision of a machine report's `decisions` into this process's tables; how many."""
    checks = {name: value for name, value in decisions.get("checks", {}).items() if name in CHECKS}
    plans = {
        (int(p["in"]), int(p["out"]), int(p["threads"])): Plan(
            None if p["fused_from_rows"] is None else int(p["fused_from_rows"]),
            bool(p["row_blocks"]),
            why=f"as {path} records: {p['why']}",
        )
        for p in decisions.get("int8_plans", [])
    }
    slowdowns = {int(s["threads"]): float(s["times_float32"]) for s in decisions.get("int8_slowdown", [])}
    float_plans = {
        (int(p["d_model"]), int(p["d_ff"]), int(p["vocab"]), int(p["threads"]), named_dtype(p["dtype"])): FloatPlan(
            tuple(known_kernel(p["kernels"][c]) for c in ROW_CLASSES), f"as {path} records: {p['why']}"
        )
        for p in decisions.get("float_products", [])
    }
    grouping = {}
    for group in decisions.get("grouped_attention", []):
        dtype = named_dtype(group["dtype"])
        for held in (True, False):
            for r, lengths in group.get("held" if held else "not_held", {}).items():
                for n in lengths:
                    key = (int(n), int(r), int(group["heads"]), int(group["head_size"]), dtype, int(group["threads"]))
                    grouping[key] = held
    decided.checks.update(checks)
    decided.plans.update(plans)
    decided.slowdowns.update(slowdowns)
    decided.float_plans.update(float_plans)
    decided.grouping.update(grouping)
    revision[0] += 1
    return len(checks) + len(plans) + len(slowdowns) + len(float_plans) + len(grouping)


FLOAT_KERNEL_NAMES = ("torch", "onednn", "openblas")  # refdec.routes.products.KERNELS, as a report names them


def known_kernel(name) -> str:
    if name not in FLOAT_KERNEL_NAMES:
        raise ValueError(name)
    return name


def named_dtype(name) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(name)
    return dtype
