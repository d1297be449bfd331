"""What this machine does with refdec's routes: for an auditor on their own hardware, before they trust a
figure measured there.

    python -m refdec machine --model checkpoints/gec-uk-6x6/model.pt --report machine.json

A kernel fast on one CPU can be a thousand times slower on another, and a kernel that rounds the same way
whatever the batch on one can round differently on another. refdec's routes decide such things by
probes run on the machine, once per process (the first call that needs one runs it); this command runs
them all now, on a model's shapes (random values: the shapes and the thread count decide which
instructions run), and prints what each found, at each thread count:

  int8 products      refdec.routes.probes' plan for each weight shape of the fast int8 route: whether
                     oneDNN's fused int8 product is taken, and from how many rows (only where it is faster
                     here than torch._int_mm with a rescaling, and bitwise the same), whether a large plain
                     product goes in blocks of rows; microseconds per call of each kernel as the probe timed
                     them. None of these choices changes a value.
  int8 vs float32    the products of one decoder step (every layer's six and the vocabulary projection) on
                     the int8 route's kernels against float32's, at 1 row (greedy) and at 32 (a batch, a
                     verification call): whether the int8 route pays here. Products alone: attention,
                     norms and dispatch come on top, the same for both (decode.py --compare, and `refdec
                     ctranslate2`, time whole runs); and torch._int_mm's time against float32's on one
                     product, the figure the int8 route's warning quotes on a CPU without AVX-512.
  grouped attention  whether the fast route's encoder may attend over sources of one length in one call
                     (refdec.routes.fast.attend_each): where the kernel's results for one sequence depend
                     on how many share its call, each source attends alone (the encoding of a source is
                     then the same alone and in any batch, by construction).
  float32 products   which kernel computes the fast route's float32 products at each class of row counts
                     (refdec.routes.products: torch's, oneDNN's on a packed weight, numpy's OpenBLAS): what
                     a run takes here without a machine report (a rule on the CPU's vendor and instructions,
                     which times nothing), and the kernels timed now on the model's step products, fastest
                     first, which this command's report records for later runs to take. The kernels sum in
                     different orders: a run never chooses among them by a timing of its own.
  few-row product    where the fast route hands a call to the model's own layers (an early exit, a
                     drafter's block of masks, a model family it does not write), products of 2 to 16 rows
                     are (W @ x.T).T: faster on some CPUs, slower on others. It changes how a sum rounds,
                     so it is not switched by a timing (two runs of one command would differ); this line
                     says what it costs or saves here.

Every timing report of refdec's commands records, beside the machine, the probes its run made
(`environment.probes`). This command's report (--report FILE) also records every decision its probes
made, exactly ("decisions"), with the CPU and torch they were made on: a later process run with
REFDEC_MACHINE_REPORT=FILE in its environment takes them as they are and probes only what FILE lacks
(another shape, another thread count; docs/machines.md). This command itself reads no such file: it
probes everything now.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..app.inputs import add_threads, check_outputs, check_threads, checkpoint_files, shown_path
from ..checkpoint import load_model
from ..config import ModelConfig
from ..errors import run_command
from ..machine import cpu_capability, cpu_model, environment, reported_flags, usable_cores
from ..routes import fast, int8, kernels, probes, products
from ..timing import interleaved
from .harness import columns, command_parser, report_option, write_report

ROUNDS = 5  # interleaved timing rounds of the int8 / float32 and few-row comparisons; the median counts
LENGTHS = (*range(1, 129), 141, 192, 256)  # source lengths the grouped-attention probe tries
COUNTS = (2, 3, 8, 32)  # sources of one length per call it tries
SHIPPED = ModelConfig(vocab_size=8000, d_model=192, n_heads=4, d_ff=768, enc_layers=6, dec_layers=6)


def build_parser():
    p = command_parser(__doc__, "machine")
    p.add_argument(
        "--model",
        help="a refdec model.pt whose shapes are probed (default: the shapes of the shipped "
        "gec-uk-6x6, d_model 192, d_ff 768, vocabulary 8000, 6+6 layers)",
    )
    add_threads(p, several=True, says="1 and this machine's usable cores; the counts to probe at")
    report_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args))


def thread_counts(text: str | None) -> list[int]:
    """The thread counts to probe at: --threads (refdec.app.inputs.check_threads), else 1 and the usable cores."""
    return sorted({1, usable_cores()}) if text is None else check_threads(text, several=True)


def step_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, in, out, how many per decoder step) of the fast int8 route's products, and the encoder's and
    cross-attention's (probed as the route would first meet them, counted 0: not a step's)."""
    D, F_, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.dec_layers
    return [
        ("self-attention q, k, v", D, 3 * D, L),
        ("attention outputs, cross queries", D, D, 3 * L),
        ("feed-forward in", D, F_, L),
        ("feed-forward out", F_, D, L),
        ("vocabulary", D, V, 1),
        ("cross-attention keys, values", D, 2 * L * D, 0),
    ]


def plans(shapes, threads: int) -> list[list[str]]:
    rows = [["product", "in x out", "fused product", "row blocks", "probe's timings (us per call)"]]
    for name, k, n, _ in shapes:
        plan = int8.plan(k, n)
        fused = f"from {plan.fused_from} row(s)" if plan.fused_from is not None else "no"
        timed = "; ".join(f"{a} {ta:.0f} vs {b} {tb:.0f} at {m}" for a, m, ta, b, tb in plan.timings)
        rows.append([name, f"{k} x {n}", fused, "yes" if plan.blocks else "no", timed])
    return rows


def summed_medians(pairs: list[tuple[int, Callable[[], object], Callable[[], object]]]) -> tuple[float, float]:
    """Microseconds of two forms of a step's products, each (count, first form, second form) timed
    interleaved over ROUNDS rounds (refdec.timing.interleaved), the medians times the count summed."""
    first = second = 0.0
    for count, a, b in pairs:
        ta, tb = interleaved([a, b], ROUNDS)
        first, second = first + count * statistics.median(ta), second + count * statistics.median(tb)
    return first * 1e6, second * 1e6


def int8_against_float32(shapes, levels_rows=(1, 32)) -> list[dict]:
    """Microseconds of one decoder step's products on the int8 route's kernels and in float32."""
    g = torch.Generator().manual_seed(0)
    out = []
    for m in levels_rows:
        pairs = []
        for _, k, n, count in shapes:
            if not count:
                continue
            w, b = torch.randn(n, k, generator=g) * k**-0.5, torch.randn(n, generator=g) * 0.1
            qw, w_in_out, x = int8.QuantizedWeight(w.t(), w), w.t().contiguous(), torch.randn(m, k, generator=g)
            pairs.append(
                (
                    count,
                    lambda qw=qw, x=x, b=b: int8.product(x, qw, b),
                    lambda w=w_in_out, x=x, b=b: torch.addmm(b, x, w),
                )
            )
        t8, t32 = summed_medians(pairs)
        out.append({"rows": m, "float32_us": round(t32, 1), "int8_us": round(t8, 1), "int8_faster": round(t32 / t8, 2)})
    return out


def grouping(cfg: ModelConfig) -> dict:
    """probes.grouping_holds over LENGTHS x COUNTS at the model's heads, in float32, on the fast route's
    encoder's attention call (fast.attend_together)."""
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    tried, failed = 0, []
    for n in (n for n in LENGTHS if n <= cfg.max_positions):
        for r in COUNTS:
            tried += 1
            if not probes.grouping_holds(n, r, H, Dh, torch.float32, fast.attend_together) and n not in failed:
                failed.append(n)
    return {"tried": tried, "failed_lengths": failed}


def float_products(cfg: ModelConfig) -> str:
    """The float32 products' plan a run takes here without a report (probes.cpu_rule) and the one timed now
    on the model's step products (products.measure_plan, kept for this command's report), in words."""
    model, dtype = (cfg.d_model, cfg.d_ff, cfg.vocab_size), torch.float32
    rule = probes.cpu_rule(dtype, products.available(dtype))
    timed = products.measure_plan(model, dtype)

    def kernels(plan) -> str:
        return ", ".join(f"{rows} row(s) {k}" for rows, k in zip(probes.ROW_CLASSES, plan.kernels))

    times = "; ".join(
        f"{rows} row(s): " + ", ".join(f"{k} {us:.0f}" for k, us in by_kernel) for rows, by_kernel in timed.timings
    )
    return (
        f"float32 products (refdec.routes.products): without a machine report, {rule.why}: {kernels(rule)}\n"
        f"  timed now on a step's products (us, medians of {probes.FLOAT_ROUNDS} interleaved rounds): {times}\n"
        f"  fastest here, what this command's report records: {kernels(timed)}"
    )


def few_rows(shapes) -> list[dict]:
    """The few-row product against F.linear at 4 and 16 rows, summed over a step's products (float32)."""
    g = torch.Generator().manual_seed(1)
    out = []
    with torch.inference_mode():
        for m in (4, 16):
            pairs = []
            for _, k, n, count in shapes:
                if not count:
                    continue
                w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
                pairs.append(
                    (count, lambda w=w, x=x: kernels.linear(x, w, None, True), lambda w=w, x=x: F.linear(x, w))
                )
            t_few, t_plain = summed_medians(pairs)
            out.append(
                {
                    "rows": m,
                    "few_row_us": round(t_few, 1),
                    "plain_us": round(t_plain, 1),
                    "few_row_faster": round(t_plain / t_few, 2),
                }
            )
    return out


def run(args) -> int:
    counts = thread_counts(args.threads)
    check_outputs({"--report": args.report}, checkpoint_files("--model", args.model))
    cfg, what = SHIPPED, "the shipped gec-uk-6x6's shapes"
    if args.model:
        cfg, what = load_model(args.model)[0].cfg, shown_path(args.model)
    flags = reported_flags()
    print(
        f"{cpu_model()}: torch {torch.__version__}, CPU capability {cpu_capability()}, {usable_cores()} usable "
        f"core(s); flags {' '.join(flags) if flags is not None else 'not listed by this system'}"
    )
    print(
        f"shapes: {what} (d_model {cfg.d_model}, d_ff {cfg.d_ff}, vocabulary {cfg.vocab_size}, "
        f"{cfg.dec_layers} decoder layers, {cfg.n_heads} heads)"
    )
    probes.forget(read_report=False)  # every decision probed now, whatever REFDEC_MACHINE_REPORT says
    levels = probes.weight_levels()
    print(
        f"int8 products exact here: torch._int_mm sums int8 rows exactly with weights of +-{levels}"
        + ("" if levels == 127 else " (7-bit weights: this CPU's int8 product saturates at full range)")
    )
    shapes = step_shapes(cfg)
    before = torch.get_num_threads()
    found = {}
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            print(f"\n-- {threads} thread(s) --")
            print("int8 products' plans (refdec.routes.probes):")
            print(columns(plans(shapes, threads)))
            versus = int8_against_float32(shapes)
            slowdown, (m, k, n) = probes.int8_slowdown(), probes.SLOWDOWN_SHAPE
            print("int8 against float32, one decoder step's products (us, medians of interleaved rounds):")
            print(
                columns(
                    [["rows", "float32", "int8", "int8 faster"]]
                    + [
                        [str(v["rows"]), f"{v['float32_us']:.0f}", f"{v['int8_us']:.0f}", f"{v['int8_faster']:.2f}x"]
                        for v in versus
                    ]
                )
            )
            print(
                f"torch._int_mm alone, one {m} x {k} by {k} x {n} product: {slowdown:.2f}x float32's time "
                "(the figure the int8 warning quotes where a CPU has no AVX-512)"
            )
            groups = grouping(cfg)
            failed = groups["failed_lengths"]
            print(
                f"grouped attention (refdec.routes.fast.attend_each): {groups['tried'] - len(failed)} of "
                f"{groups['tried']} (length, count) shapes "
                + (
                    "hold: sources of one length share a call"
                    if not failed
                    else f"tried; it does not hold at lengths {', '.join(map(str, failed))}: sources of those "
                    "lengths attend one by one (their encoding is the same alone and in any batch)"
                )
            )
            print(float_products(cfg))
            few = few_rows(shapes)
            print(
                "few-row product (refdec.routes.kernels, fixed: it changes rounding): "
                + ", ".join(f"{v['few_row_faster']:.2f}x F.linear's speed at {v['rows']} rows" for v in few)
            )
            found[str(threads)] = {
                "int8_vs_float32": versus,
                "int8_mm_times_float32": round(slowdown, 2),
                "grouped_attention": groups,
                "few_row_product": few,
            }
    finally:
        torch.set_num_threads(before)
    if args.report:
        write_report(
            args.report,
            {
                "command": probes.MACHINE_REPORT,
                "shapes": what,
                "d_model": cfg.d_model,
                "d_ff": cfg.d_ff,
                "vocab": cfg.vocab_size,
                "dec_layers": cfg.dec_layers,
                "n_heads": cfg.n_heads,
                "weight_levels": levels,
                "by_threads": found,
                "environment": environment(counts, "cpu", torch.float32),
                "decisions": probes.recorded(),
            },
        )
        print(f"\nreport: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
