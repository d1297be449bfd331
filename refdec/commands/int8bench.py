"""Why the int8 route (refdec.routes.int8) is made the way it is: each candidate product timed on a model's
own linear shapes, and whether row 0 of a call comes out bitwise the same alone and within more rows.

    python -m refdec int8bench --task gec-uk --model checkpoints/gec-uk-6x6/model.pt --rows 1,8,32 \\
        --report reports/int8-products-gec-uk-6x6.json

Candidates, each x (M, in) -> (M, out) with a bias, on random rows (|values| like a layer norm's):
  float32      torch.addmm on the (in, out) weight (the fast route's product)
  weight-only  torch.ops.aten._weight_int8pack_mm: int8 weights with one scale per output, float rows
  per-tensor   torch.ao's dynamically quantized Linear (quantize_dynamic): one activation scale per call
  per-row      refdec.routes.int8.linear: one activation scale per row, the int32 product exact (the route)
Microseconds per call (medians of interleaved rounds, one thread unless --threads), and "same": row 0
of an M-row call torch.equal to row 0 computed alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings

import torch

from ..app.inputs import add_threads, check_outputs, check_threads, checkpoint_files, shown_path
from ..checkpoint import load_model
from ..errors import run_command
from ..machine import environment, machine_line, warn_if_int8_slow
from ..routes import int8
from ..timing import seconds
from . import as_typed
from .harness import columns, report_option, write_report


def shapes(model) -> list[tuple[str, int, int]]:
    """(name, in, out) of each distinct product a decoder step makes, and the vocabulary projection."""
    cfg = model.cfg
    D, F_, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    return [
        ("queries-keys-values", D, 3 * D),
        ("attention output", D, D),
        ("feed-forward in", D, F_),
        ("feed-forward out", F_, D),
        ("vocabulary", D, V),
    ]


def candidates(w: torch.Tensor, b: torch.Tensor) -> dict:
    """name -> f(x) for the weight w (out, in) and bias b."""
    w_in_out = w.t().contiguous()
    q = int8.QuantizedWeight(w.t(), w)
    packed_q = (
        torch.round(w / q.scale[:, None]).to(torch.int8).contiguous()
    )  # (out, in), as _weight_int8pack_mm takes it
    layer = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated: timed here for comparison only
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(layer), {torch.nn.Linear}, dtype=torch.qint8
        )
    return {
        "float32": lambda x: torch.addmm(b, x, w_in_out),
        "weight-only": lambda x: torch.ops.aten._weight_int8pack_mm(x, packed_q, q.scale).add_(b),
        "per-tensor": dynamic,
        "per-row": lambda x: int8.linear(x, q, b),
    }


def measure(model, rows: list[int], rounds: int, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for name, n_in, n_out in shapes(model):
        w = torch.randn(n_out, n_in, generator=g) * n_in**-0.5
        b = torch.randn(n_out, generator=g) * 0.1
        fs = candidates(w, b)
        xs = {m: torch.randn(m, n_in, generator=g) for m in rows}
        times = {(c, m): [] for c in fs for m in rows}
        with torch.inference_mode():
            for _ in range(rounds + 1):  # the first round warms up
                for m in rows:
                    for c, f in fs.items():
                        times[c, m].append(seconds(lambda f=f, x=xs[m]: [f(x) for _ in range(reps)]) / reps)
            for c, f in fs.items():
                alone = f(xs[max(rows)][:1])
                out.append(
                    {
                        "product": name,
                        "in": n_in,
                        "out": n_out,
                        "candidate": c,
                        "us": {m: 1e6 * statistics.median(times[c, m][1:]) for m in rows},
                        "row_0_same": {m: bool(torch.equal(f(xs[max(rows)][:m])[:1], alone)) for m in rows if m > 1},
                    }
                )
    return out


def table(results: list[dict], rows: list[int]) -> str:
    head = (
        ["product", "in x out", "candidate"]
        + [f"{m} row{'s' if m > 1 else ''} us" for m in rows]
        + [f"row 0 same at {m}" for m in rows if m > 1]
    )
    cells = [head] + [
        [r["product"], f"{r['in']} x {r['out']}", r["candidate"]]
        + [f"{r['us'][m]:.1f}" for m in rows]
        + ["yes" if r["row_0_same"][m] else "no" for m in rows if m > 1]
        for r in results
    ]
    return columns(cells)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=as_typed("int8bench"), description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="the checkpoint's task")
    p.add_argument("--model", required=True, help="a refdec model.pt: its shapes are timed (random weights)")
    p.add_argument("--rows", default="1,8,32", help="rows per call, comma-separated (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    p.add_argument("--reps", type=int, default=20, help="calls per candidate per round (default 20)")
    report_option(p)
    add_threads(p, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args))


def run(args) -> int:
    from ..errors import UsageError

    try:
        rows = sorted({int(v) for v in args.rows.split(",")})
    except ValueError:
        raise UsageError(f"--rows takes whole numbers separated by commas, not {args.rows!r}") from None
    if rows[0] < 1 or args.rounds < 1 or args.reps < 1:
        raise UsageError("--rows, --rounds and --reps must be at least 1")
    check_threads(args.threads)
    check_outputs({"--report": args.report}, checkpoint_files("--model", args.model))
    torch.set_num_threads(args.threads)
    model, _, _ = load_model(args.model, task=args.task)
    warn_if_int8_slow("cpu", "its per-row figures show what the route costs here; decode with --fast, without --int8")
    results = measure(model, rows, args.rounds, args.reps)
    print(
        f"{shown_path(args.model)}: d_model {model.cfg.d_model}, d_ff {model.cfg.d_ff}, vocabulary "
        f"{model.cfg.vocab_size}; {machine_line(args.threads)}"
    )
    print(table(results, rows))
    if args.report:
        write_report(
            args.report,
            {
                "model": shown_path(args.model),
                "task": args.task,
                "rows": rows,
                "environment": environment(args.threads, "cpu", torch.float32),
                "results": results,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
