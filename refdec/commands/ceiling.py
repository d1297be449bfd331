"""What a drafter that guesses right would buy on this machine: the ceiling of draft-then-verify
decoding, measured with the model's own output as the draft.

    python -m refdec ceiling --task mt-en-de --limit 500                  # shipped model and drafter
    python -m refdec ceiling --task mt-en-de --k 4,8,16 --accept 1,0.8,0.6 --report ceiling.json
    python -m refdec ceiling --task mt-en-de --k 3,10 --small checkpoints/mt-en-de-small-aligned/model.pt

First, untimed, greedy decoding gives each sentence's output y. Then, sentence by sentence and
interleaved (the order rotates), it times greedy decoding again and the GAD loop (the shared
verification step, refdec.decoding.verify) whose draft is y itself:

    repeat until eos:   draft  the next k tokens of y, each kept with probability --accept
                               (the first one not kept is replaced by a wrong token)
                        verify one call over the draft; commit up to and including the bifurcation

With --accept 1 every drafted token passes (up to a float32 near-tie between the two runs), so each
call commits k + 1 tokens (fewer where the sentence ends): no drafter with blocks of k can do
better. Lower rates give the speed of
a drafter that reaches that many tokens per call. Each setting runs once per cost model:

    free drafts   drafting costs nothing: the ceiling of GAD with a costless drafter, and of
                  blockwise parallel decoding less its heads' cost (its proposals ride on the
                  verification call itself)
    + drafter     the GAD drafter (--drafter; default: the task's shipped one) also drafts k
                  tokens every iteration, as in `--algo gad`, and its draft is thrown away: the
                  ceiling of GAD with that drafter's cost (it drafts k masks whatever k it was
                  trained with: only its cost counts here)
    + small model with --small: an autoregressive small model (speculative decoding, BiLD) takes
                  one step per drafted token, as it would to write the draft; its tokens are
                  thrown away: the ceiling of those decoders with that small model's cost when
                  the large model is called every k tokens (BiLD's window, speculative's gamma)

--device cuda runs it on a GPU, each time read after a device synchronisation; --fast and --graphed
run every model on the fast route (refdec.routes.fast) or the graphed route (refdec.routes.graphed) instead of the
reference route.

Every run's output is checked against greedy's (the verification step is lossless, so they agree
unless a float32 near-tie falls differently). Prints one row per run: calls per sentence, tokens
per call, seconds, and speed over greedy (greedy's seconds / the run's); --report writes them as JSON.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from .. import data as data_mod
from ..app.inputs import check_outputs, checkpoint_files, input_files, max_len_for, shown_path, source_ids
from ..app.loading import Models, RunLoader, routed
from ..decoding.scripted import greedy_output, scripted_gad
from ..errors import UsageError, first_line, run_command
from ..machine import device_name, environment, machine_line
from ..progress import ProgressLine
from ..repo import REPO, repo_file
from ..timing import clock
from ..tokenizer import Tokenizer
from .harness import command_parser, machine_options, report_option, set_up_machine, write_report


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__doc__, "ceiling")
    p.add_argument(
        "--task",
        default="mt-en-de",
        choices=sorted(data_mod.TASKS),
        help="task whose test set and shipped checkpoints to use (default mt-en-de)",
    )
    p.add_argument("--model", help="the verifier (default: checkpoints/<task>/model.pt)")
    p.add_argument(
        "--drafter",
        help="GAD drafter for the '+ drafter' rows (default: checkpoints/<task>-drafter/model.pt where "
        "the task ships one; 'none' = free drafts only)",
    )
    p.add_argument(
        "--small",
        help="autoregressive small model for '+ small model' rows (e.g. "
        "checkpoints/<task>-small-aligned/model.pt; default: none)",
    )
    p.add_argument("--limit", type=int, default=200, help="first N test sentences (default 200)")
    p.add_argument("--k", default="2,4,8,16", help="block sizes (default 2,4,8,16)")
    p.add_argument("--accept", default="1", help="probabilities that a drafted token is the model's own (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up sentences (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the scripted drafts' choices (default 0)")
    machine_options(p)
    route = p.add_mutually_exclusive_group()
    route.add_argument("--fast", action="store_true", help="every model on the fast route (refdec.routes.fast)")
    route.add_argument(
        "--graphed",
        action="store_true",
        help="every model on the graphed route (refdec.routes.graphed; "
        "CUDA graphs on a GPU, its static-shape steps as they are on a CPU)",
    )
    report_option(p)
    return p


def route_name(args) -> str:
    return "graphed" if args.graphed else "fast" if args.fast else "reference"


def drafter_file(args) -> Path | None:
    """The drafter the run reads: --drafter, or the task's shipped one where it exists; None (free
    drafts only) with --drafter none or no shipped drafter."""
    shipped = REPO / "checkpoints" / f"{args.task}-drafter" / "model.pt"
    if args.drafter == "none" or (args.drafter is None and not shipped.exists()):
        return None
    return Path(args.drafter) if args.drafter else shipped


def load_models(args, path: Path) -> tuple[Models, Tokenizer]:
    """The verifier with the drafter (None: free drafts only) and the small model (or None) the run
    reads, as refdec.app.loading loads a decode.py run's (one tokenizer; a drafter that is one), on the
    route --fast or --graphed chooses; and the verifier's tokenizer. CheckpointError,
    FileNotFoundError or ValueError on a file that cannot serve."""
    loader = RunLoader(path, task=args.task, device=args.device, dtype=torch.float32)
    own = {role: str(p) for role, p in (("drafter", drafter_file(args)), ("small", args.small)) if p is not None}
    models = loader.models_for(path, tuple(own), own)
    if args.fast or args.graphed:
        models = routed(models, "graphed" if args.graphed else "fast", False)
    return models, loader.tokenizer


def time_runs(
    runs: list[tuple], ids: list[list[int]], models: Models, warmup: int, rng: random.Random
) -> tuple[dict, int]:
    """Each run on every sentence, the order rotating sentence by sentence: per run its seconds,
    calls, tokens and outputs identical to greedy's, summed over the sentences after the first
    `warmup`; and how many those are.

    Not refdec.app.runner.decode_lines, the loop decode.py times with: each scripted run needs the
    sentence's greedy output y, decoded untimed before the runs; the scripted drafts of every run
    draw on one generator in the order the runs go, so another interleaving would draw other drafts
    at --accept below 1 for the same --seed; and the warm-up sentences are left out of the figures,
    where decode_lines times them again."""
    model, small = models.model, models.small
    drafter, layout = (models.drafter.model, models.drafter.layout) if models.drafter else (None, "causal")
    totals = {r[0]: {"seconds": 0.0, "calls": 0, "tokens": 0, "same": 0} for r in runs}
    n = 0
    progress = ProgressLine(len(ids), "sentences")
    for i, s in enumerate(ids):
        src = data_mod.source_tensor([s]).to(next(model.parameters()).device)
        max_len = max_len_for([s], None, model.cfg.max_positions)
        y, _ = greedy_output(model, src, max_len)
        timed = i >= warmup
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for name, k, rate, cost in order:
            t0 = clock(src.device)
            if k is None:
                out, c = greedy_output(model, src, max_len)
            else:
                out, c = scripted_gad(
                    model,
                    src,
                    y,
                    k=k,
                    accept=rate,
                    max_len=max_len,
                    rng=rng,
                    drafter=drafter if cost == "drafter" else None,
                    layout=layout,
                    small=small if cost == "small" else None,
                )
            dt = clock(src.device) - t0
            if timed:
                t = totals[name]
                t["seconds"] += dt
                t["calls"] += c
                t["tokens"] += len(out)
                t["same"] += int(out == y)
        n += int(timed)
        progress.update(i + 1)
    return totals, n


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(build_parser().parse_args(argv)), known=(FileNotFoundError,))


def run(args: argparse.Namespace) -> int:
    try:
        ks = [int(x) for x in args.k.split(",")]
        if min(ks) < 1:
            raise ValueError
    except ValueError:
        raise UsageError(f"--k {args.k}: give whole numbers of at least 1, separated by commas") from None
    try:
        rates = [float(x) for x in args.accept.split(",")]
        if not all(0 <= r <= 1 for r in rates):
            raise ValueError
    except ValueError:
        raise UsageError(f"--accept {args.accept}: give numbers in [0, 1], separated by commas") from None
    bounds = (("--limit", args.limit, 1), ("--warmup", args.warmup, 0))
    for flag, value, least in bounds:
        if value < least:
            raise UsageError(f"{flag} {value}: must be at least {least}")
    args.device = str(set_up_machine(args))
    path = Path(args.model) if args.model else repo_file("checkpoints", args.task, "model.pt", flag="--model")
    repo_file("data", args.task)  # its test set: the repository's
    check_outputs(
        {"--report": args.report},
        input_files(args.task, None)
        | checkpoint_files("the model", path)
        | checkpoint_files("the drafter", drafter_file(args))
        | checkpoint_files("--small", args.small),
    )
    try:
        models, tokenizer = load_models(args, path)
    except ValueError as e:
        raise UsageError(first_line(e)) from None
    sources = data_mod.load_split(args.task, "test").src[: args.limit + args.warmup]
    ids = [s for s in source_ids(tokenizer, sources, models.model.cfg.max_positions) if s]
    costs = (
        [("free drafts", None)]
        + ([("+ drafter", "drafter")] if models.drafter is not None else [])
        + ([("+ small model", "small")] if models.small is not None else [])
    )
    runs = [("greedy", None, None, None)] + [
        (f"k={k} accept={r:g} {name}", k, r, cost) for k in ks for r in rates for name, cost in costs
    ]
    totals, n = time_runs(runs, ids, models, args.warmup, random.Random(args.seed))
    if n == 0:
        raise UsageError("no sentence left to time after the warm-up (raise --limit)")
    report(args, path, models, runs, totals, n)
    return 0


def report(args, path: Path, models: Models, runs: list[tuple], totals: dict, n: int) -> None:
    """One row per run on stdout; with --report, the same as JSON."""
    g = totals["greedy"]["seconds"]
    rows = [
        {
            "run": name,
            "k": k,
            "accept": rate,
            "drafter": cost == "drafter",
            "small": cost == "small",
            "seconds": totals[name]["seconds"],
            "calls_per_sentence": totals[name]["calls"] / n,
            "tokens_per_call": totals[name]["tokens"] / max(totals[name]["calls"], 1),
            "speed_over_greedy": g / totals[name]["seconds"] if totals[name]["seconds"] else 0.0,
            "identical": totals[name]["same"] / n,
        }
        for name, k, rate, cost in runs
    ]
    drafter, drafter_path, small = models.drafter, drafter_file(args), models.small
    print(
        f"{n} sentences of the {args.task} test set, {args.threads} threads, {device_name(args.device)}, "
        f"{route_name(args)} route, model {shown_path(path)}"
        + (f", drafter {shown_path(drafter_path)}" if drafter is not None else "")
        + (f", small {shown_path(args.small)}" if small else "")
    )
    print(machine_line(args.threads))
    print(f"{'run':>32}  {'seconds':>8}  {'calls/sent':>10}  {'tokens/call':>11}  {'speed':>6}  {'identical':>9}")
    for r in rows:
        print(
            f"{r['run']:>32}  {r['seconds']:8.2f}  {r['calls_per_sentence']:10.2f}  {r['tokens_per_call']:11.2f}"
            f"  {r['speed_over_greedy']:5.2f}x  {r['identical']:9.4f}"
        )
    print("speed = greedy's seconds / the run's (above 1 = faster than greedy)")
    if args.report:
        write_report(
            args.report,
            {
                "task": args.task,
                "model": shown_path(path),
                "drafter": shown_path(drafter_path) if drafter is not None else None,
                **({"small": shown_path(args.small)} if small is not None else {}),
                "sentences": n,
                "threads": args.threads,
                "seed": args.seed,
                "rows": rows,
                "device": device_name(args.device),
                "route": route_name(args),
                "environment": environment(args.threads, args.device, torch.float32),
            },
        )


if __name__ == "__main__":
    sys.exit(main())
