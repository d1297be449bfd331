"""Every GPU table in one command: the decoders on the reference, fast and graphed routes, the one-call
cost, the draft-then-verify ceiling and transformers' decoders on the same weights.

    python -m refdec bench --device cuda                  # every section, reports/gpu-*.json
    python -m refdec bench --device cuda --sections stepcost,ceiling --out /tmp/bench
    python -m refdec bench --files                        # the files it reads, and their total size
    python -m refdec bench --device cpu --limit 3         # the whole command in a few minutes on a CPU

Sections (--sections, default all; each prints its tables and writes its JSON report):

    mt-en-de      batch 1 on the mt-en-de test set: greedy beside GAD (shipped drafter), GAD++
                  (top-beta 3, tau 1), blockwise (shipped heads), speculative and BiLD (shipped small
                  model), as `decode.py --algo greedy --task mt-en-de --compare gad,gad:top-beta=3:tau=1,
                  blockwise,speculative,bild`
    gec-uk        batch 1 on UA-GEC with the 6+6 model: IAD beside greedy and beam-5
    batched       greedy and IAD of the UA-GEC 6+6 model at batch sizes 1, 8, 32 and 128 (sent/s)
    stepcost      python -m refdec stepcost of the mt-en-de model at 1 and 32 rows, q = 1-64, every route
    ceiling       python -m refdec ceiling on mt-en-de (the model's own output as the draft), every route
    transformers  python -m refdec hf audit on mt-en-de (with the small model: assisted generation) and
                  UA-GEC 6+6 (prompt lookup): transformers' greedy, assisted generation and prompt lookup
                  beside refdec's decoders on every route; left out, with a line saying so, when
                  transformers is absent

The three decoder sections run every decoder on the three routes in one process, interleaved
(refdec.app.runner.decode_lines, the loop decode.py times with, after 2 warm-up batches): the reference
route, the fast route (--fast) and the graphed route (--graphed; CUDA graphs on a GPU). Each prints
decode.py's table (speed and identical rate against the reference route's first run), each lossless
decoder's check against greedy on its own route, a table per route of every decoder against that
route's greedy (and beam), and each route's greedy against the reference route's: the identical rate
and the top-1/top-2 logit margin where a line differs.

The graphed route captures a CUDA graph for every new shape of call (rows, padded new tokens, cache
and source sizes), and 2 warm-up batches do not meet them all: a decoder that makes calls of many
shapes (IAD, batched decoding) pays some captures inside its timed run. --warm-all decodes every batch
once before the timed runs (twice the decoder sections' time), so that their figures are replays
alone.

Sizes. On a GPU: 100 sentences per batch-1 run, 256 in the batched section, 50 for the ceiling
(k = 4, 8, 16, 25, accept 1 and 0.8, with and without the drafter's cost), 40 for transformers, 15
rounds of stepcost: chosen to finish within 8 minutes on one H100-class GPU going by the reference
route's times there (docs/gpu.md); the run prints each section's time and the total. --limit N sets
every section's sentences.
On the CPU (--device cpu) or with --limit of 10 or less the inner settings are small, so that the
whole command runs in minutes: 1 warm-up batch (or sentence) instead of 2, 1 round of stepcost
after its warm-up round, the ceiling at k = 4 and 8 with accept 1, and only the batch sizes up to the
first that holds every sentence.

Reports: <out>/gpu-<section>.json (cpu-<section>.json from a --device cpu run; default out: the
repository's reports/), and the commands' own reports beside (gpu-stepcost-rows1.json, ...). No
report holds this machine's absolute paths.

--files prints, one per line, every repository file the command reads (the code, the test sets and
the checkpoints of the sections chosen) and on stderr their total size, checked against the 62 MiB a
copy may take: a machine with a GPU runs the command from a copy holding those files alone
(docs/gpu.md). Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..app import inputs, loading, plan, report, runner
from ..app.exactness import divergences, identical_rate
from ..errors import CheckpointError, UsageError, first_line, run_command
from ..machine import device_name, environment
from ..progress import duration
from ..repo import REPO, check_files, install_hint, list_files
from ..timing import clock
from . import as_typed
from .harness import columns, command_parser, invocation, machine_options, set_up_machine, write_report

ROUTES = ("reference", "fast", "graphed")
MAX_BYTES = 62 * 2**20  # what a copy of the repository for a GPU machine may hold: 62 MiB (du -h's M)
GEC_MODEL = "checkpoints/gec-uk-6x6/model.pt"
MT = ["mt-en-de", "mt-en-de-drafter", "mt-en-de-blockwise", "mt-en-de-small-aligned"]
TEST_SETS = {
    "mt-en-de": ("src", "tgt", "doc"),
    "gec-uk": ("src", "tgt", "tgt2"),
}  # the ceiling loads mt-en-de's doc ids


# The decoder sections: (task, --algo, --compare, model, batch sizes, baselines of the per-route table)
DECODERS = {
    "mt-en-de": ("mt-en-de", "greedy", "gad,gad:top-beta=3:tau=1,blockwise,speculative,bild", None, [], ("greedy",)),
    "gec-uk": ("gec-uk", "iad", "greedy,beam", GEC_MODEL, [], ("greedy", "beam")),
    "batched": ("gec-uk", "greedy", "iad", GEC_MODEL, [1, 8, 32, 128], ()),
}
SECTIONS = (*DECODERS, "stepcost", "ceiling", "transformers")
READS = {  # section -> (checkpoint folders, test sets) it reads
    "mt-en-de": (MT, ["mt-en-de"]),
    "gec-uk": (["gec-uk-6x6"], ["gec-uk"]),
    "batched": (["gec-uk-6x6"], ["gec-uk"]),
    "stepcost": (["mt-en-de"], []),
    "ceiling": (["mt-en-de", "mt-en-de-drafter"], ["mt-en-de"]),
    "transformers": (["mt-en-de", "mt-en-de-small-aligned", "gec-uk-6x6"], ["mt-en-de", "gec-uk"]),
}


def files(sections: list[str]) -> list[Path]:
    """The repository files (relative paths) a run of these sections reads: refdec's code, data/build.py
    (which marks a clone of the repository: refdec.repo.repo_file), the checkpoints (model and
    tokenizer) and the test sets."""
    code = sorted(p.relative_to(REPO) for p in (REPO / "refdec").rglob("*.py") if "__pycache__" not in p.parts)
    folders = sorted({f for s in sections for f in READS[s][0]})
    tasks = sorted({t for s in sections for t in READS[s][1]})
    return [
        *code,
        Path("data/build.py"),
        *(Path("checkpoints", f, name) for f in folders for name in ("model.pt", "tokenizer.json")),
        *(Path("data", t, f"test.{part}.gz") for t in tasks for part in TEST_SETS[t]),
    ]


def settings(args, device: torch.device) -> dict:
    """Sentences and inner settings of each section (the module docstring, 'Sizes')."""
    small = device.type == "cpu" or (args.limit is not None and args.limit <= 10)
    n = {"batch1": 100, "batched": 256, "ceiling": 50, "transformers": 40}
    if args.limit is not None:
        n = dict.fromkeys(n, args.limit)
    sizes = DECODERS["batched"][4]
    if small:  # the sizes below the sentences' count, and the first that holds them all
        sizes = [b for b in sizes if b < n["batched"]] + [b for b in sizes if b >= n["batched"]][:1]
    return {
        "sentences": n,
        "sizes": sizes,
        "rounds": 1 if small else 15,
        "warmup": 1 if small else 2,
        "warm_all": args.warm_all,
        "k": "4,8" if small else "4,8,16,25",
        "accept": "1" if small else "1,0.8",
    }


def decoder_runs(section: str, n: int, sizes: list[int], device: torch.device) -> tuple:
    """The runs of a decoder section on the three routes (each model loaded once per route), its lines,
    references, ids and tokenizer."""
    task, algo, compare, model, _, _ = DECODERS[section]
    specs = plan.plan_runs(
        algo,
        task,
        model=str(REPO / model) if model else None,
        given={},
        compares=plan.parse_compare(compare),
        batch_size=None,
        sizes=sizes,
    )
    shared = plan.shared_companions(specs, task, {})
    runs = []
    for route in ROUTES:
        labelled = [replace(s, label=f"{s.label} [{route}]") for s in specs]
        loader, models = loading.load_models(
            labelled,
            shared,
            task=task,
            device=str(device),
            dtype=torch.float32,
            route=route,
        )
        runs += runner.make_runs(labelled, models)
        tokenizer, max_positions = loader.tokenizer, loader.max_positions
    lines, refs = inputs.read_input(task, None, [], n)
    ids = inputs.source_ids(tokenizer, lines, max_positions)
    return runs, lines, refs, ids, tokenizer, max_positions


def route_of(run: runner.Run) -> str:
    return run.name.rsplit("[", 1)[1].rstrip("]")


def base_name(run: runner.Run) -> str:
    return run.name.rsplit(" [", 1)[0]


def route_tables(section: str, runs: list, rows: list[dict], ids: list, device) -> tuple[str, dict]:
    """Per route, every run against that route's baselines (greedy, beam), and each route's first
    greedy against the reference route's (identical rate, the logit margin where a line differs);
    the printed text and the figures."""
    baselines = DECODERS[section][5]
    by_route = {r: [(run, row) for run, row in zip(runs, rows) if route_of(run) == r] for r in ROUTES}
    text, figures = [], {"routes": {}, "greedy_against_reference": {}}
    for route, pairs in by_route.items():
        base = {b: next(row for run, row in pairs if run.algo.name == b) for b in baselines}
        cells = [["run", "ms/tok", "tok/call", *(f"speed vs {b}" for b in baselines), "identical to greedy"]]
        table = []
        for run, row in pairs:
            entry = {
                "run": base_name(run),
                "ms_per_token": row["ms_per_token"],
                "tokens_per_call": row["tokens_per_call"],
                **{f"speed_vs_{b}": base[b]["seconds"] / row["seconds"] if row["seconds"] else None for b in baselines},
                "sent_per_s": row["sent_per_s"],
            }
            greedy = next((r for r, _ in pairs if r.algo.name == "greedy" and r.batch_size == run.batch_size), None)
            entry["identical_to_greedy"] = identical_rate(greedy.outputs, run.outputs) if greedy else None
            table.append(entry)
            cells.append(
                [
                    entry["run"],
                    f"{row['ms_per_token']:.2f}",
                    f"{row['tokens_per_call']:.2f}",
                    *(report.relative_speed(entry[f"speed_vs_{b}"] or math.nan) for b in baselines),
                    "" if entry["identical_to_greedy"] is None else f"{entry['identical_to_greedy']:.4f}",
                ]
            )
        figures["routes"][route] = table
        text.append(f"{route} route\n" + columns(cells))
    ref_greedy = next(run for run in runs if run.algo.name == "greedy")
    for route in ROUTES[1:]:
        other = next(
            run
            for run in runs
            if run.algo.name == "greedy" and route_of(run) == route and run.batch_size == ref_greedy.batch_size
        )
        div = divergences(ref_greedy.models.model, ids, ref_greedy.outputs, other.outputs, device)
        same = identical_rate(ref_greedy.outputs, other.outputs)
        figures["greedy_against_reference"][route] = {"identical": same, "divergences": div}
        text.append(
            f"{route} route's greedy against the reference route's: {same:.4f} identical, {len(div)} line(s) "
            f"differ"
            + "".join(
                f"\n  line {d['line']}: first divergence at token {d['position']}, top-1/top-2 "
                f"logit margin {d['margin_top1_top2']:.3g}"
                for d in div
            )
        )
    return "\n\n".join(text), figures


def throughput(runs: list, rows: list[dict], sizes: list[int]) -> tuple[str, list[dict]]:
    """The batched section's sent/s: a row per route and algorithm, a column per batch size."""
    cells, table = [["sent/s", *(f"batch {b}" for b in sizes)]], []
    for route in ROUTES:
        for algo in dict.fromkeys(run.algo.name for run in runs):
            found = {
                run.batch_size: row["sent_per_s"]
                for run, row in zip(runs, rows)
                if route_of(run) == route and run.algo.name == algo
            }
            table.append({"route": route, "algo": algo, "sent_per_s": {str(b): found.get(b) for b in sizes}})
            cells.append([f"{algo} [{route}]", *(f"{found[b]:.1f}" if b in found else "" for b in sizes)])
    return columns(cells), table


def decoder_section(section: str, args, device: torch.device, plan_: dict) -> dict:
    """Decode with every run of the section on the three routes, interleaved; print the tables and
    return the report."""
    n = plan_["sentences"]["batched" if section == "batched" else "batch1"]
    sizes = plan_["sizes"] if section == "batched" else []
    runs, lines, refs, ids, tokenizer, max_positions = decoder_runs(section, n, sizes, device)
    task, algo, compare, model, _, _ = DECODERS[section]
    print(
        f"as python decode.py --algo {algo} --task {task}"
        + (f" --model {model}" if model else "")
        + f" --compare {compare} --limit {len(lines)}"
        + (f" --batch-sizes {','.join(map(str, sizes))}" if sizes else "")
        + "; every run on the reference route, the fast route (--fast) and the graphed route (--graphed), "
        "interleaved in one process"
        + ("; every batch decoded once before the timed runs (--warm-all)" if plan_["warm_all"] else ""),
        flush=True,
    )
    log(f"{section}: {len(runs)} runs ({len(runs) // len(ROUTES)} on each route), {len(lines)} sentences")
    runner.decode_lines(
        runs,
        ids,
        max_len=None,
        max_positions=max_positions,
        device=device,
        warmup=plan_["warmup"],
        warm_all=plan_["warm_all"],
        progress=True,
    )
    summary = report.summarise(task, runs, lines, refs, ids, tokenizer, device, matrix_text=False)
    print(summary.text)
    text, figures = route_tables(section, runs, summary.rows, ids, device)
    print("\n" + text)
    if section == "batched":
        text, figures["throughput"] = throughput(runs, summary.rows, sizes)
        print("\n" + text)
    return {
        "task": task,
        "model": inputs.shown_path(runs[0].models.path),
        "sentences": len(lines),
        "batch_sizes": sizes or [1],
        "runs": summary.rows,
        "speedup_matrix": summary.matrix,
        "lossless_checks": summary.checks,
        **figures,
    }


def command_sections(section: str, args, device: torch.device, plan_: dict, prefix: str) -> dict:
    """stepcost, ceiling and transformers: the repository's own commands, each writing its report
    beside the bench's; returns where they are and their exit statuses."""
    from . import command_main

    common = ["--device", str(device), "--threads", str(args.threads)]
    warmup = ["--warmup", str(plan_["warmup"])]
    out, commands = Path(args.out), []
    if section == "stepcost":
        for rows in (1, 32):
            commands.append(
                (
                    f"stepcost-rows{rows}",
                    command_main("stepcost"),
                    [
                        "--task",
                        "mt-en-de",
                        "--model",
                        str(REPO / "checkpoints/mt-en-de/model.pt"),
                        "--rows",
                        str(rows),
                        "--fast",
                        "--graphed",
                        "--rounds",
                        str(plan_["rounds"]),
                        *common,
                    ],
                )
            )
    elif section == "ceiling":
        for route in ROUTES:
            commands.append(
                (
                    f"ceiling-{route}",
                    command_main("ceiling"),
                    [
                        "--task",
                        "mt-en-de",
                        "--limit",
                        str(plan_["sentences"]["ceiling"]),
                        "--k",
                        plan_["k"],
                        "--accept",
                        plan_["accept"],
                        *([f"--{route}"] if route != "reference" else []),
                        *warmup,
                        *common,
                    ],
                )
            )
    elif importlib.util.find_spec("transformers") is None:
        print(
            "transformers is not installed: its greedy, assisted generation and prompt lookup are left out "
            f"({install_hint('hf')})"
        )
        return {"skipped": "transformers is not installed"}
    else:
        n = str(plan_["sentences"]["transformers"])
        for task, model, small in (("mt-en-de", "mt-en-de", "mt-en-de-small-aligned"), ("gec-uk", "gec-uk-6x6", None)):
            commands.append(
                (
                    f"transformers-{task}",
                    command_main("hf"),
                    [
                        "audit",
                        "--task",
                        task,
                        "--model",
                        str(REPO / "checkpoints" / model / "model.pt"),
                        *(["--small", str(REPO / "checkpoints" / small / "model.pt")] if small else []),
                        "--limit",
                        n,
                        "--routes",
                        ",".join(ROUTES),
                        *warmup,
                        *common,
                    ],
                )
            )
    reports = {}
    for name, main, argv in commands:
        path = out / f"{prefix}-{name}.json"
        command = shlex.join(
            [*shlex.split(invocation(main)), *(inputs.shown_path(a) if a.startswith("/") else a for a in argv)]
        )
        log(f"{name}: {command}")
        print(f"\n# {name}: {command}", flush=True)
        status = main([*argv, "--report", str(path)])
        sys.stdout.flush()
        reports[name] = {"report": path.name, "exit_status": status}
        if status:
            raise SectionError(f"{invocation(main)} exited with {status}")
    return {"reports": reports}


class SectionError(Exception):
    """A section's command failed (it said why on stderr): the others still run."""


def log(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__doc__, "bench")
    machine_options(p, device="cuda")
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="sentences per run in every section (default: 100 at batch "
        "1, 256 batched, 50 for the ceiling, 40 for transformers)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"sections to run, by name, separated by commas (default all: {', '.join(SECTIONS)})",
    )
    p.add_argument(
        "--warm-all",
        action="store_true",
        help="the decoder sections (mt-en-de, gec-uk, batched) decode "
        "every batch once, untimed, before the timed runs (about twice their time): the graphed route's "
        "captures, one per new shape, then fall outside the timed runs",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=str(REPO / "reports"),
        help="folder of the JSON reports "
        "(default: the repository's reports/; created if its parent exists; not in checkpoints/ or data/)",
    )
    p.add_argument(
        "--files",
        action="store_true",
        help="print the repository files the chosen sections read, one "
        "per line, and their total size on stderr (checked against 62 MiB); run nothing",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(build_parser().parse_args(argv)))


def chosen_sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise UsageError(f"--sections: {', '.join(unknown) or 'none given'}; choose from {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]


def run(args: argparse.Namespace) -> int:
    sections = chosen_sections(args.sections)
    if args.files:
        return list_files([p.as_posix() for p in files(sections)], as_typed("bench"), MAX_BYTES)
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    inputs.check_outputs({"--out": args.out}, {}, folders_made=True)
    device = set_up_machine(args)
    check_files([p.as_posix() for p in files(sections)], as_typed("bench"))
    out = Path(args.out)
    if not out.is_dir():
        if not out.parent.is_dir():
            raise UsageError(f"--out {args.out}: the folder {out.parent} does not exist")
        out.mkdir()
    plan_, prefix = settings(args, device), "gpu" if device.type == "cuda" else device.type
    env = {**environment(args.threads, device, torch.float32), "device_name": device_name(device)}
    log(f"{', '.join(sections)} on {device_name(device)}; reports to {inputs.shown_path(out.resolve())}")
    t_start, failed = clock(), []
    for section in sections:
        t0 = clock()
        print(f"\n## {section} ({device_name(device)}, torch {torch.__version__})", flush=True)
        try:
            body = (
                decoder_section(section, args, device, plan_)
                if section in DECODERS
                else command_sections(section, args, device, plan_, prefix)
            )
        except Exception as e:  # noqa: BLE001 -- one section's failure leaves the others to run
            if os.environ.get("REFDEC_DEBUG"):
                raise
            known = isinstance(e, (SectionError, UsageError, CheckpointError))
            print(
                f"error: {section}: {'' if known else type(e).__name__ + ': '}{first_line(e)}",
                file=sys.stderr,
                flush=True,
            )
            failed.append(section)
            continue
        seconds = clock() - t0
        write_report(
            str(out / f"{prefix}-{section}.json"),
            {"section": section, "seconds": round(seconds, 1), "settings": plan_, "environment": env, **body},
        )
        log(f"{section} done in {duration(seconds)}")
    print(
        f"\n{len(sections) - len(failed)} of {len(sections)} sections in {duration(clock() - t_start)}"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
