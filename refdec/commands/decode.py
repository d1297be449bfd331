r"""Decode a task's test set (or any file) with one of refdec's algorithms.

    python decode.py --algo greedy --task mt-en-de                    # shipped model, real test set
    python decode.py --algo beam --task mt-en-de --compare greedy --report r.json
    echo "The file could not be opened." | python decode.py --algo greedy --task mt-en-de --input -

Prints one output line per input line (stdout, or --output FILE) and a summary table (stderr when the
outputs go to stdout). With --compare ALGO the second algorithm runs on the same inputs in the same
process, interleaved, and the table adds its speed against the first ("1.21x faster": the first run's
seconds / its own, the report's speed_vs_first) and identical (fraction of outputs token-for-token
equal). --compare greedy means greedy decoding of the model the algorithm reproduces. --report FILE
writes every figure as JSON.

--compare takes several algorithms, and each may name its own checkpoint (same tokenizer):

    python decode.py --algo iad --task gec-uk --model checkpoints/gec-uk-9x3/model.pt \
        --compare greedy,beam@checkpoints/gec-uk-6x6/model.pt,iad@checkpoints/gec-uk-6x6/model.pt

Each may also set its own algorithm options and small model or drafter after colons, so that one process
sweeps a trade-off (the first run takes the command line's options; a compared run starts from them):

    python decode.py --algo greedy --task mt-en-de \
        --compare bild:fallback-threshold=0.3,bild:fallback-threshold=0.7:small=checkpoints/mt-en-de-small/model.pt

Then a matrix gives every row's speedup over every other. A lossless algorithm run beside greedy of
the same checkpoint also gets: the lines where it differs from greedy, each with the first divergent
position and the model's top-1/top-2 logit margin there (a near-tie, or a bug), and, on GEC at batch size
1, its speedup over greedy by edit ratio of the output (how much of the input the output keeps).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import as_typed

WINDOW = 1000  # input lines sorted by length together (docs/usage.md, "Decoding a large file", measures it)


def build_parser() -> argparse.ArgumentParser:
    from refdec.app.algorithms import ALGORITHMS
    from refdec.app.inputs import add_machine_flags
    from refdec.app.plan import add_option_flags, add_route_flags
    from refdec.data import TASKS

    algos = "\n".join(f"  {a.name:12s}{a.summary}" for a in ALGORITHMS.values())
    command = as_typed("decode")  # the examples read as the user typed the command
    p = argparse.ArgumentParser(
        prog=command,
        description=__doc__.replace("python decode.py", command) + "\nalgorithms:\n" + algos,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--algo", default="greedy", choices=sorted(ALGORITHMS), help="decoding algorithm (default greedy)")
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="task: picks the default test set, checkpoint and metrics (GEC tasks add F0.5); optional "
        "with --model (a checkpoint or a Hugging Face folder) and an --input (plain text in, text out)",
    )
    g = p.add_argument_group("input and output")
    g.add_argument(
        "--input",
        metavar="FILE|-",
        help="source sentences, one per line, UTF-8 ('-' = stdin; default: the task's test set with its references)",
    )
    g.add_argument(
        "--bad-lines",
        choices=["fail", "replace"],
        default="fail",
        help="bytes that are not valid UTF-8 in the input or a reference: fail refuses the file naming the "
        "line (default); replace decodes them as U+FFFD, with a warning naming every such line",
    )
    g.add_argument(
        "--output",
        metavar="FILE|-",
        help="write the outputs here, each line as soon as every line before it is done ('-' or none: stdout); "
        "a job record FILE.job.json beside it says what was decoded, so that --resume can continue it",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the job whose output --output holds (a stopped run): its whole lines are kept, the rest "
        "decoded; the result is byte-identical to an uninterrupted run (refused if the options differ)",
    )
    g.add_argument(
        "--overwrite", action="store_true", help="replace an --output that holds earlier work (refused without)"
    )
    g.add_argument(
        "--ref",
        metavar="FILE",
        action="append",
        default=[],
        help="reference file aligned with --input (repeat for several references)",
    )
    g.add_argument("--limit", type=int, metavar="N", help="decode only the first N lines")
    g.add_argument("--report", metavar="FILE", help="write all figures as JSON")
    g.add_argument(
        "--trace",
        action="store_true",
        help="print how each sentence was decoded (stderr; coloured in a terminal unless NO_COLOR is set)",
    )
    g.add_argument(
        "--html",
        metavar="FILE",
        help="write a self-contained HTML page: the table, charts, and every "
        "sentence's decoding drawn step by step (collects traces; needs matplotlib)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress lines, nor the note on fewer threads")
    g = p.add_argument_group("models")
    g.add_argument(
        "--model",
        metavar="PATH",
        help="checkpoint whose output is produced (default: the algorithm's "
        "shipped model for the task, checkpoints/<task>/model.pt, for gec-uk and gec-en "
        "checkpoints/<task>-9x3/, for "
        "blockwise checkpoints/<task>-blockwise/; tokenizer.json must sit beside it), or a Hugging Face "
        "transformers model folder (M2M100, NLLB, Marian, BART, mBART, Pegasus, T5; docs/hf.md)",
    )
    g.add_argument(
        "--src-lang",
        metavar="TOKEN",
        help="with a transformers folder: the source-language token forced before every source (NLLB: eng_Latn)",
    )
    g.add_argument(
        "--tgt-lang",
        metavar="TOKEN",
        help="with a transformers folder: the target-language token forced "
        "after the decoder's start token (NLLB: deu_Latn; default: the folder's forced_bos_token_id)",
    )
    g.add_argument("--drafter", metavar="PATH", help="gad: drafter checkpoint (default checkpoints/<task>-drafter/)")
    g.add_argument(
        "--small",
        metavar="PATH",
        help="bild, speculative: small-model checkpoint (default: "
        "checkpoints/<task>-small-aligned/); 'early-exit' uses the first layers of --model, trained with "
        "train.py --early-exit",
    )
    g = p.add_argument_group("running")
    g.add_argument(
        "--max-len",
        type=int,
        metavar="N",
        help="most output tokens per sentence, eos included "
        "(default: 2 x the sentence's own source + 10, within the model's positions, so that no batching "
        "changes an output)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="sentences per decoder call (default 1); above 1 the "
        "inputs are bucketed by length (batches of neighbours in length, outputs in input order)",
    )
    g.add_argument(
        "--batch-tokens",
        type=int,
        metavar="N",
        help="batches by a token budget instead: as many "
        "sentences, neighbours in length, as fit in N source tokens counted with their padding (sentences "
        "x longest source); --batch-size then caps the sentences (default: no cap)",
    )
    g.add_argument(
        "--batch-sizes",
        metavar="N,N,...",
        help="run every algorithm (--algo and each --compare) at each "
        "of these batch sizes, interleaved in one process: a throughput table (sent/s) with every row's "
        "identical rate against the first (docs/benchmarks.md, 'Batched decoding')",
    )
    add_machine_flags(g)
    g.add_argument(
        "--compare",
        metavar="ALGO[@CKPT][:OPTION=VALUE...],...",
        help="also run these algorithms on the same inputs, interleaved, and report speedups and identical "
        "rates; ALGO runs on the model --algo ALGO would use, ALGO@CKPT on another checkpoint with the same "
        "tokenizer; :OPTION=VALUE sets one of that run's algorithm options (e.g. :fallback-threshold=0.3), "
        "its small model or drafter (:small=PATH|early-exit, :drafter=PATH), its batches (:batch-size=N, "
        ":batch-tokens=N), :int8",
    )
    g.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        metavar="N",
        help=f"sort by length only within windows of N input lines (default {WINDOW}; 0: the whole input), so "
        "that outputs stream out in input order and a stopped run is at most one window behind what it decoded",
    )
    g.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed warm-up batches (default 2)")
    add_route_flags(g)
    add_option_flags(p.add_argument_group("algorithm options (read from the decoders' signatures)"))
    return p


def main(argv: list[str] | None = None) -> int:
    from refdec.errors import run_command
    from refdec.interrupt import hold_sigint, release_sigint

    hold_sigint(sigterm=True)  # a Ctrl-C (or SIGTERM) during imports waits for them to finish (refdec/interrupt.py)

    def body() -> int:
        args = build_parser().parse_args(argv)
        args.argv = sys.argv[1:] if argv is None else list(argv)  # the --html page's header quotes it
        return run(args)

    try:
        return run_command(body)  # Ctrl-C (SIGTERM) before decoding, or while the figures are computed: 130 (143)
    finally:
        release_sigint(raise_held=False)  # --help or a bad flag ends main before run() released it


def run(args) -> int:
    import torch

    from refdec.app import inputs, plan, report, runner
    from refdec.app.algorithms import OPTIONS
    from refdec.app.loading import load_models
    from refdec.data import DATA_DIR
    from refdec.errors import UsageError
    from refdec.interrupt import release_sigint, stopped_by
    from refdec.machine import (
        BusyCores,
        busy_warning,
        environment,
        fit_threads,
        set_allocator,
        usable_cores,
        warn_if_int8_slow,
    )

    release_sigint()  # every import is done: a Ctrl-C held so far stops here, later ones at once
    inputs.check_no_piped_text(args.input)  # piped text without --input - would go unread
    busy = BusyCores()  # other processes' CPU use from now on: it sees the machine while the models load
    if args.task is None and not (args.model and args.input):
        raise UsageError(
            "--task is needed unless --model names the checkpoint (or Hugging Face folder) and --input the text"
        )
    world, rank = runner.check_job_flags(args)  # torchrun's processes, or (1, 0)
    inputs.check_machine(args.device, args.threads)
    set_allocator(args.allocator)  # this process's malloc, as --allocator asks (refdec.machine)
    input_path = inputs.shown_path(args.input or DATA_DIR / (args.task or "") / "test.src.gz")
    plan.check_counts(
        batch_size=args.batch_size,
        max_len=args.max_len,
        limit=args.limit,
        warmup=args.warmup,
        refs=args.ref,
        input=args.input,
        batch_tokens=args.batch_tokens,
    )
    given = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
    compares = plan.parse_compare(args.compare) if args.compare else []
    specs = plan.plan_runs(
        args.algo,
        args.task,
        model=args.model,
        given=given,
        compares=compares,
        batch_size=args.batch_size,
        sizes=plan.parse_sizes(args.batch_sizes, args.batch_size),
        batch_tokens=args.batch_tokens,
        int8=args.int8,
    )
    shared = plan.shared_companions(specs, args.task, {"small": args.small, "drafter": args.drafter})
    inputs.check_outputs(
        {"--output": args.output, "--report": args.report, "--html": args.html},  # none a file read
        inputs.input_files(args.task, args.input, args.ref) | plan.checkpoints_read(specs, shared),
    )
    barrier = runner.start_processes(world)
    if args.output:
        runner.check_existing(Path(args.output), resume=args.resume, overwrite=args.overwrite)
    barrier()  # every process has looked at the output before the first one starts the job
    if args.html:
        from refdec.app.htmlreport import check_available

        check_available()
    lines, refs = inputs.read_input(args.task or "", args.input, args.ref, args.limit, bad_lines=args.bad_lines)
    dtype = getattr(torch, args.dtype)
    loader, models = load_models(
        specs,
        shared,
        task=args.task,
        device=args.device,
        dtype=dtype,
        route=plan.chosen_route(args),
        languages=(args.src_lang, args.tgt_lang),
    )
    if any(s.int8 for s in specs):  # once, however many runs are on the int8 route
        warn_if_int8_slow(args.device, "decode with --fast, without --int8 and :int8")
    if args.graphed and not str(args.device).startswith("cuda") and not args.quiet:
        print(
            "note: --graphed captures CUDA graphs on a GPU alone; on this device its static-shape steps run as they "
            "are (docs/graphed.md)",
            file=sys.stderr,
            flush=True,
        )
    others_at_start = busy.others()  # over the loading: the cores other processes leave this run
    note = fit_threads(others_at_start) if args.threads is None else None
    if note and not args.quiet:
        print(f"note: {note}", file=sys.stderr, flush=True)
    runs = runner.make_runs(specs, models, trace=args.trace or bool(args.html))
    ids = inputs.source_ids(loader.tokenizer, lines, loader.max_positions)
    for r in runs:
        runner.check_fits(r, ids, args.max_len, loader.max_positions, dtype)
    job = runner.start_job(args, specs[0], shared, input_path, lines, loader, world, rank, barrier)
    if job is not None and job.complete:
        return 0
    handed, finished = runner.decode_to_output(
        runs,
        ids,
        loader.tokenizer,
        output=args.output,
        max_len=args.max_len,
        max_positions=loader.max_positions,
        device=args.device,
        warmup=args.warmup,
        progress=not args.quiet,
        busy=busy,
        window=args.window,
        job=job,
    )
    others_busy = busy.others()  # over the whole run: said again under the table if they kept the cores
    runner.end_job(job, handed, finished, len(lines), runs, barrier)
    if (interrupted := not finished) or len(handed) < len(lines):  # the figures cover the lines this run wrote
        runner.keep_lines_of(runs, handed)
        lines, ids, refs = [lines[i] for i in handed], [ids[i] for i in handed], [[r[i] for i in handed] for r in refs]
    summary = report.summarise(
        args.task,
        runs,
        lines,
        refs,
        ids,
        loader.tokenizer,
        args.device,
        warning=busy_warning(others_busy, torch.get_num_threads(), usable_cores(), "kept") if world == 1 else None,
    )
    model_path = inputs.shown_path(loader.main_path)
    settings = {
        "batch_size": sorted({r.batch_size for r in runs}) if args.batch_sizes else runs[0].batch_size,
        "batch_tokens": args.batch_tokens,
        "window": args.window,
        "max_len": args.max_len,
        "row_invariant": args.invariant,
        "fast_route": args.fast,
        "graphed_route": args.graphed,
        "int8": args.int8,
    }
    if args.report:
        report.write_report(
            args.report,
            report.run_report(
                args.task,
                summary,
                runs,
                n_lines=len(lines),
                model=model_path,
                model_step=loader.checkpoint.get("step"),
                input=input_path,
                settings=settings,
                interrupted=interrupted,
                environment={
                    **environment(torch.get_num_threads(), args.device, dtype),
                    "threads_auto": args.threads is None,
                    "other_busy_cores_at_start": others_at_start,
                    "other_busy_cores": others_busy,
                },
            ),
        )
    if args.trace:
        from refdec.trace import print_traces

        print_traces(args.algo, runs[0].traces, loader.tokenizer)
    if args.html:
        from refdec.app.htmlreport import write_run_page

        write_run_page(
            args.html,
            summary,
            runs,
            loader.tokenizer,
            lines,
            refs,
            ids,
            task=args.task,
            model=model_path,
            input=input_path,
            interrupted=interrupted,
            device=f"{args.device}, {args.dtype}",
            batch_size=args.batch_size,
            batch_tokens=args.batch_tokens,
            command=shlex.join([*shlex.split(as_typed("decode")), *args.argv]),
        )
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        print(summary.text, file=sys.stderr if not args.output else sys.stdout)
    return stopped_by()[1] if interrupted else 0
