"""Decode a task's test set (or any file) with one of refdec's algorithms.

    python decode.py --algo greedy --task mt-en-de                    # shipped model, real test set
    python decode.py --algo beam --task mt-en-de --compare greedy --report r.json
    echo "The file could not be opened." | python decode.py --algo greedy --task mt-en-de --input -

Prints one output line per input line (stdout, or --output FILE) and a summary table (stderr when the
outputs go to stdout). With --compare ALGO the second algorithm runs on the same inputs in the same
process, interleaved, and the table adds speedup (its seconds / ours) and identical (fraction of
outputs token-for-token equal). --compare greedy means greedy decoding of the model the algorithm
reproduces. --report FILE writes every figure as JSON.

--compare takes several algorithms, and each may name its own checkpoint (same tokenizer):

    python decode.py --algo iad --task gec-uk --model checkpoints/gec-uk-9x3/model.pt \
        --compare greedy,beam@checkpoints/gec-uk-6x6/model.pt,iad@checkpoints/gec-uk-6x6/model.pt

Each may also set its own algorithm options and second model after colons, so that one process
sweeps a trade-off (the first run takes the command line's options; a compared run starts from them):

    python decode.py --algo greedy --task mt-en-de \
        --compare bild:fallback-threshold=0.3,bild:fallback-threshold=0.7:small=checkpoints/mt-en-de-small/model.pt

Then a matrix gives every row's speedup over every other. A lossless algorithm run beside greedy of
the same checkpoint also gets: the lines where it differs from greedy, each with the first divergent
position and the model's top-1/top-2 logit margin there (a near-tie, or a bug), and, with batch size
1, its speedup over greedy by edit ratio of the output (how much of the input the output keeps).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    from refdec.data import TASKS
    from refdec.decoding import ALGORITHMS
    algos = "\n".join(f"  {a.name:10s} {a.summary}" for a in ALGORITHMS.values())
    p = argparse.ArgumentParser(description=__doc__ + "\nalgorithms:\n" + algos,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", required=True, choices=sorted(ALGORITHMS), help="decoding algorithm")
    p.add_argument("--task", required=True, choices=sorted(TASKS),
                   help="task: picks the default test set, checkpoint and metrics (GEC tasks add F0.5)")
    add_input_output(p.add_argument_group("input and output"))
    add_models(p.add_argument_group("models"))
    add_running(p.add_argument_group("running"))
    add_algorithm_options(p.add_argument_group("algorithm options"))
    return p


def add_input_output(io) -> None:
    io.add_argument("--input", metavar="FILE|-", help="source sentences, one per line, UTF-8 ('-' = stdin; "
                    "default: the task's test set with its references)")
    io.add_argument("--output", metavar="FILE", help="write outputs here instead of stdout")
    io.add_argument("--ref", metavar="FILE", action="append",
                    help="reference file aligned with --input (repeat for several references)")
    io.add_argument("--limit", type=int, metavar="N", help="decode only the first N lines")
    io.add_argument("--report", metavar="FILE", help="write all figures as JSON")
    io.add_argument("--trace", action="store_true", help="print how each sentence was decoded (stderr; coloured "
                    "in a terminal unless NO_COLOR is set)")
    io.add_argument("--html", metavar="FILE", help="write a self-contained HTML page: the table, charts, and every "
                    "sentence's decoding drawn step by step (collects traces; needs matplotlib)")
    io.add_argument("--quiet", action="store_true", help="no progress lines")


def add_models(m) -> None:
    m.add_argument("--model", metavar="PATH", help="checkpoint whose output is produced "
                   "(default: the task's best shipped model, checkpoints/<task>/model.pt, for gec-uk "
                   "checkpoints/gec-uk-9x3/model.pt; tokenizer.json must sit beside it), or a Hugging Face "
                   "transformers model folder (M2M100, NLLB; docs/hf.md)")
    m.add_argument("--src-lang", metavar="TOKEN", help="with a transformers folder: the source-language token forced "
                   "before every source (NLLB: eng_Latn)")
    m.add_argument("--tgt-lang", metavar="TOKEN", help="with a transformers folder: the target-language token forced "
                   "after the decoder's start token (NLLB: deu_Latn; default: the folder's forced_bos_token_id)")
    m.add_argument("--drafter", metavar="PATH", help="drafter checkpoint, for algorithms that draft with a second model")
    m.add_argument("--small", metavar="PATH", help="small-model checkpoint, for big-little decoding and speculative "
                   "sampling (default: checkpoints/<task>-small-aligned/model.pt); 'early-exit' uses the first "
                   "layers of --model, trained with train.py --early-exit")


def add_running(r) -> None:
    r.add_argument("--max-len", type=int, metavar="N", help="most output tokens per sentence, eos included "
                   "(default: 2 x the longest source of the batch + 10, within the model's positions)")
    r.add_argument("--batch-size", type=int, metavar="N", help="sentences per decoder call (default 1); above 1 the "
                   "inputs are bucketed by length (batches of neighbours in length, outputs in input order)")
    r.add_argument("--batch-sizes", metavar="N,N,...", help="run every algorithm (--algo and each --compare) at each "
                   "of these batch sizes, interleaved in one process: a throughput table (sent/s) with every row's "
                   "identical rate against the first (docs/benchmarks.md, 'Batched decoding')")
    r.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    r.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype (default float32)")
    r.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    r.add_argument("--compare", metavar="ALGO[@CKPT][:OPTION=VALUE...],...",
                   help="also run these algorithms on the same inputs, interleaved, and report speedups and "
                   "identical rates; ALGO@CKPT runs ALGO on another checkpoint with the same tokenizer; "
                   ":OPTION=VALUE sets one of that run's algorithm options (e.g. :fallback-threshold=0.3), "
                   "its second model (:small=PATH|early-exit, :drafter=PATH) or its batch size (:batch-size=N)")
    r.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed warm-up batches (default 2)")
    r.add_argument("--invariant", action="store_true", help="row-invariant compute for every model: each position's "
                   "logits bitwise the same whatever the call shape, so lossless algorithms equal greedy exactly, "
                   "ties included (slower; docs/algorithms.md, 'Row-invariant mode')")


def add_algorithm_options(k) -> None:
    from refdec.decoding.blockwise import BLOCK_RULES
    from refdec.decoding.iad import MATCH_POLICIES
    k.add_argument("--beam-size", type=int, metavar="K", help="beams for beam search (default 5)")
    k.add_argument("--length-penalty", type=float, metavar="A", help="beam score = log p / length^A (default 1.0)")
    k.add_argument("--match", choices=MATCH_POLICIES, help="iad: which source position to draft from. unique "
                   "(default, the paper's): shortest output suffix that occurs once in the source; leftmost: "
                   "as unique, but a repeated n-gram drafts from its leftmost occurrence; longest: longest "
                   "suffix that occurs, leftmost occurrence (prompt-lookup's rule)")
    k.add_argument("--max-suffix", type=int, metavar="N", help="iad: longest output suffix matched, in tokens "
                   "(default 0 = no limit)")
    k.add_argument("--max-draft", type=int, metavar="N", help="iad: most tokens drafted per verifier call, "
                   "the papers' L_max (default 0 = up to the end of the source)")
    k.add_argument("--top-beta", type=int, metavar="B", help="gad: GAD++ accepts a drafted token within the "
                   "verifier's top B (default 1: GAD, lossless)")
    k.add_argument("--tau", type=float, metavar="T", help="gad: ... and within T of the top-1 log-probability (default 0)")
    k.add_argument("--block-rule", choices=BLOCK_RULES, help="blockwise: exact (default, "
                   "lossless), top-k (a proposal within p_1's top --top-k), distance (numbers within --epsilon)")
    k.add_argument("--top-k", type=int, metavar="K", help="blockwise --block-rule top-k: K (default 2)")
    k.add_argument("--epsilon", type=float, metavar="E", help="blockwise --block-rule distance: E (default 0)")
    k.add_argument("--min-block", type=int, metavar="L", help="blockwise: accept at least L tokens per call "
                   "(default 1; more is lossy)")
    k.add_argument("--block-size", type=int, metavar="K", help="gad, blockwise: tokens drafted per verifier call "
                   "(default 0 = the k the drafter or heads were trained for; blockwise: 2 .. that k, using the "
                   "first K - 1 heads; lossless at any K)")
    k.add_argument("--fallback-threshold", type=float, metavar="P", help="bild: the small model writes while its "
                   "max probability is at least P (default 0.4, the README's recommendation for the shipped pair)")
    k.add_argument("--rollback-threshold", type=float, metavar="D", help="bild: roll back at the first small-model "
                   "token with -log p_large above D (default 2.0, with the fallback default)")
    k.add_argument("--max-window", type=int, metavar="N", help="bild: the small model writes at most N tokens "
                   "between large-model calls (default 10)")
    k.add_argument("--gamma", type=int, metavar="N", help="speculative: tokens drafted per large-model call "
                   "(default 3, the fastest measured; README)")
    k.add_argument("--sample", action="store_const", const=True, help="bild, speculative: sample instead of argmax")
    k.add_argument("--top-p", type=float, metavar="P", help="bild, speculative: nucleus sampling mass "
                   "(default 0.9; speculative sampling then follows the large model's nucleus distribution)")
    k.add_argument("--temperature", type=float, metavar="T", help="speculative: sampling temperature (default 1)")
    k.add_argument("--seed", type=int, metavar="N", help="bild, speculative: sampling seed (default 0)")


KNOB_DEFAULTS = {"beam_size": 5, "length_penalty": 1.0, "match": "unique", "max_suffix": 0, "max_draft": 0,
                 "top_beta": 1, "tau": 0.0, "block_rule": "exact", "top_k": 2, "epsilon": 0.0, "min_block": 1, "block_size": 0,
                 "fallback_threshold": 0.4, "rollback_threshold": 2.0, "max_window": 10, "gamma": 3,
                 "sample": False, "top_p": 0.9, "temperature": 1.0, "seed": 0}


def check_knobs(knobs: dict, given: set[str]) -> None:
    """Refuse option values out of range, and options that only matter under another option without it."""
    from refdec.decoding.blockwise import BLOCK_RULES
    from refdec.decoding.iad import MATCH_POLICIES
    from refdec.runner import UsageError
    if knobs["beam_size"] < 1:
        raise UsageError("--beam-size must be at least 1")
    if knobs["max_suffix"] < 0 or knobs["max_draft"] < 0:
        raise UsageError("--max-suffix and --max-draft must be at least 0 (0 = no limit)")
    if min(knobs["top_beta"], knobs["top_k"], knobs["min_block"], knobs["max_window"], knobs["gamma"]) < 1:
        raise UsageError("--top-beta, --top-k, --min-block, --max-window and --gamma must be at least 1")
    if knobs["block_size"] < 0:
        raise UsageError("--block-size must be at least 0 (0 = the k the drafter or heads were trained for)")
    for knob in ("length_penalty", "tau", "epsilon", "fallback_threshold", "rollback_threshold", "top_p", "temperature"):
        if not math.isfinite(knobs[knob]):
            raise UsageError(f"--{knob.replace('_', '-')} must be a finite number, not {knobs[knob]}")
    if abs(knobs["length_penalty"]) > 10:  # length ** A overflows long before; 0.6-1 is the usual range
        raise UsageError(f"--length-penalty must be between -10 and 10, not {knobs['length_penalty']}")
    if knobs["tau"] < 0 or knobs["epsilon"] < 0 or knobs["temperature"] <= 0:
        raise UsageError("--tau and --epsilon must be at least 0, --temperature above 0")
    if knobs["fallback_threshold"] < 0 or knobs["rollback_threshold"] < 0:
        raise UsageError("--fallback-threshold (a probability; above 1 the large model writes every token) and "
                         "--rollback-threshold (a distance in nats) must be at least 0")
    if not 0 < knobs["top_p"] <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if knobs["match"] not in MATCH_POLICIES or knobs["block_rule"] not in BLOCK_RULES:
        raise UsageError(f"--match must be one of {', '.join(MATCH_POLICIES)}; --block-rule one of {', '.join(BLOCK_RULES)}")
    # Options that only matter under another option are refused without it, never ignored.
    for opt, needs, ok in (("top_k", "--block-rule top-k", knobs["block_rule"] == "top-k"),
                           ("epsilon", "--block-rule distance", knobs["block_rule"] == "distance"),
                           ("temperature", "--sample", knobs["sample"]),
                           ("seed", "--sample", knobs["sample"]),
                           ("top_p", "--sample", knobs["sample"])):
        if opt in given and not ok:
            raise UsageError(f"--{opt.replace('_', '-')} has no effect without {needs}")


def main(argv: list[str] | None = None) -> int:
    from refdec.interrupt import raise_if_interrupted, remember_sigint
    remember_sigint()
    try:
        args = build_parser().parse_args(argv)
        args.argv = sys.argv[1:] if argv is None else list(argv)  # the --html page's header quotes it
        raise_if_interrupted()
        return run(args)
    except KeyboardInterrupt:  # before decoding started, or while the figures were computed
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `decode.py ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # every failure is one line; REFDEC_DEBUG=1 shows the traceback
        if os.environ.get("REFDEC_DEBUG"):
            raise
        from refdec.checkpoint import CheckpointError  # refdec.loading's LoadError is one
        from refdec.runner import UsageError
        known = isinstance(e, (UsageError, CheckpointError))
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}" if known else f"error: {type(e).__name__}: {msg} (REFDEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 2 if known else 1


def run(args) -> int:
    import torch

    from refdec import runner
    from refdec.data import DATA_DIR
    from refdec.decoding import ALGORITHMS
    from refdec.interrupt import raise_if_interrupted
    raise_if_interrupted()

    algo = ALGORITHMS[args.algo]
    compares = parse_compare(args.compare) if args.compare else []
    sizes = batch_sizes(args)
    args.batch_size = 1 if args.batch_size is None else args.batch_size
    if sizes:  # every run at every size: --algo at the first size first, the rest in order
        if any("batch_size" in over for _, _, over in compares):
            raise runner.UsageError("--batch-sizes sets every run's batch size: a --compare run cannot set its own")
        everyone = [(args.algo, None, {})] + compares
        compares = [(name, path, {**over, "batch_size": n}) for n in sizes for name, path, over in everyone][1:]
    if not args.model:  # ALGO without @CKPT runs on the checkpoint --algo ALGO would use (blockwise: the heads)
        compares = [(name, path or own_default(ALGORITHMS[name], algo, args.task), over) for name, path, over in compares]
    knobs, run_knobs = check_options(args, algo, compares)
    check_machine(args)
    lines, refs = read_input(args)
    dtype = getattr(torch, args.dtype)
    loader, runs = load_runs(args, algo, compares, knobs, run_knobs, dtype, sizes)
    models = runs[0].models
    ids = runner.source_ids(loader.tokenizer, lines, loader.max_positions)
    for r in runs:
        check_fits(r, ids, args, loader.max_positions, dtype)

    busy = runner.BusyCores()
    complete = decode_to_output(args, runs, models, ids, loader, busy)
    interrupted = complete < len(lines)
    if interrupted:  # the figures cover the lines every run finished, which are also the lines written
        bucketed = max(r.batch_size for r in runs) > 1  # batches of neighbours in length, not in input order
        runner.warn(f"interrupted after {complete} of {len(lines)} input lines: those lines are written"
                    + (f" to {args.output}" if args.output else "")
                    + ("; the scores below cover them alone, the times and counts every batch finished (batches are "
                       "formed by length, so some of those lines come later in the input)" if bucketed
                       else "; the figures below cover them alone"))
        lines, ids, refs = lines[:complete], ids[:complete], [r[:complete] for r in refs]
        for r in runs:
            r.outputs, r.traces = r.outputs[:complete], r.traces[:complete]
            r.times, r.calls = r.times[:complete], r.calls[:complete]

    rows, matrix, checks, text = summarise(args, runs, lines, refs, ids, loader.tokenizer)
    if args.report:
        report = runner.build_report(
            args.task, rows, [r.knobs for r in runs], [r.algo for r in runs], n_lines=len(lines),
            extra={"model": str(loader.main_path), "model_step": loader.ckpt.get("step"),
                   "input": args.input or f"{DATA_DIR / args.task}/test.src.gz", "batch_size": args.batch_size if not sizes else sizes,
                   "max_len": args.max_len, "runs": rows, "speedup_matrix": matrix, "lossless_checks": checks,
                   "interrupted": interrupted, "lines_decoded": complete, "row_invariant": args.invariant,
                   "environment": {**runner.environment(torch.get_num_threads(), args.device, dtype),
                                   "other_busy_cores": busy.others()}})
        runner.write_report(args.report, report)
    if args.trace:
        from refdec.trace import colour_enabled, trace_text
        colour = colour_enabled(sys.stderr)
        for i, steps in enumerate(runs[0].traces):
            if steps is not None:
                print(trace_text(args.algo, i, steps, loader.tokenizer, colour=colour), file=sys.stderr)
    if args.html:
        from refdec import htmlreport
        htmlreport.write_page(args.html, title=f"refdec: {' vs '.join(r['algo'] for r in rows)} on {args.task}",
                              facts=page_facts(args, loader, len(lines), interrupted), rows=rows, matrix=matrix, checks=checks,
                              sources=lines, refs=refs, ids=ids, runs=runs, tokenizer=loader.tokenizer,
                              batch_size=args.batch_size)
    print(text, file=sys.stderr if not args.output else sys.stdout)
    return 130 if interrupted else 0


def check_options(args, algo, compares: list) -> tuple[dict, list[dict]]:
    """Refuse options no run reads and values out of range; return the first run's options and each
    compared run's (the command line's with its own on top)."""
    from refdec.decoding import ALGORITHMS
    from refdec.runner import UsageError
    others = [ALGORITHMS[name] for name, _, _ in compares]
    # Options an algorithm does not read are refused, never silently ignored.
    used = set(algo.knobs).union(*(o.knobs for o in others))
    for knob in KNOB_DEFAULTS:
        if getattr(args, knob) is not None and knob not in used:
            raise UsageError(f"--{knob.replace('_', '-')} is not used by --algo {args.algo}"
                             + (f" or --compare {args.compare}" if others else ""))
    for role in ("drafter", "small"):
        if getattr(args, role) and role not in shared_roles(algo, compares):
            raise UsageError(f"--{role} is not used by --algo {args.algo}")
    if (args.batch_size is not None and args.batch_size < 1) or (args.max_len is not None and args.max_len < 1):
        raise UsageError("--batch-size and --max-len must be at least 1")
    if (args.limit is not None and args.limit < 0) or args.warmup < 0:
        raise UsageError("--limit and --warmup must be at least 0")
    if args.ref and not args.input:
        raise UsageError("--ref needs --input (the default test set brings its own references)")
    knobs = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in KNOB_DEFAULTS.items()}
    knobs["trace"] = args.trace or bool(args.html)  # the page draws every sentence from its trace
    given = {k for k in KNOB_DEFAULTS if getattr(args, k) is not None}
    check_knobs(knobs, given)
    run_knobs = []
    for name, _, over in compares:
        own = {k: v for k, v in over.items() if k in KNOB_DEFAULTS}
        try:
            check_knobs({**knobs, **own}, given | set(own))
        except UsageError as e:
            raise UsageError(f"--compare {name}: {e}") from None
        run_knobs.append({**knobs, **own})
    return knobs, run_knobs


def shared_roles(algo, compares: list) -> set[str]:
    """Second models the runs share: those of the first run, and of compared runs that name none of their own."""
    from refdec.decoding import ALGORITHMS
    return set(algo.roles).union(*({r for r in ALGORITHMS[name].roles if r not in over} for name, _, over in compares))


def check_machine(args) -> None:
    """Device and threads this machine has; output paths checked now, so that a run never decodes
    for an hour to fail on its output."""
    import torch

    from refdec import runner
    from refdec.runner import UsageError
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    if args.threads is not None:
        if not 1 <= args.threads <= runner.usable_cores():
            raise UsageError(f"--threads must be between 1 and the {runner.usable_cores()} cores this machine gives "
                             f"the run (more threads than cores only slows decoding down)")
        torch.set_num_threads(args.threads)
    read = {"input": args.input, **{f"--ref file {r}": r for r in args.ref or []}}
    if args.output:
        runner.check_writable(args.output, "--output", not_paths=read)
    if args.report:
        runner.check_writable(args.report, "--report", not_paths={**read, "--output": args.output})
    if args.html:
        from refdec.htmlreport import check_available
        check_available()
        runner.check_writable(args.html, "--html", not_paths={**read, "--output": args.output, "--report": args.report})


def read_input(args) -> tuple[list[str], list[list[str]]]:
    """The input lines and their reference streams (the task's test set unless --input)."""
    from refdec import runner
    from refdec.data import DATA_DIR, read_lines
    from refdec.runner import UsageError
    task_dir = DATA_DIR / args.task
    if args.input:
        lines = runner.read_text_lines(args.input)
        refs = [runner.read_text_lines(r) for r in (args.ref or [])]
        for path, r in zip(args.ref or [], refs):
            if len(r) != len(lines):
                raise UsageError(f"--ref {path} has {len(r)} lines but the input has {len(lines)}")
    else:
        if not (task_dir / "test.src.gz").exists():
            raise UsageError(f"{task_dir}/test.src.gz not found; rebuild it with python data/build.py")
        lines = read_lines(task_dir / "test.src.gz")
        refs = [read_lines(task_dir / name) for name in ("test.tgt.gz", "test.tgt2.gz") if (task_dir / name).exists()]
    if args.limit is not None:
        lines, refs = lines[: args.limit], [r[: args.limit] for r in refs]
    return lines, refs


def load_runs(args, algo, compares: list, knobs: dict, run_knobs: list[dict], dtype, sizes: list[int]):
    """Every checkpoint the runs need, each loaded once (refdec.loading), and the runs themselves."""
    from refdec import runner
    from refdec.decoding import ALGORITHMS
    from refdec.loading import SECOND_MODEL_DIRS, RunLoader
    from refdec.runner import UsageError
    model_path = Path(args.model) if args.model else REPO / "checkpoints" / algo.checkpoint_dir(args.task) / "model.pt"
    if not args.model and not model_path.exists():
        raise UsageError(f"no checkpoint at {model_path}; {shipped_for(algo)}; train one (README, 'Training') "
                         f"or pass --model")
    loader = RunLoader(model_path, task=args.task, device=args.device, dtype=dtype, languages=(args.src_lang, args.tgt_lang))
    for _, path, _ in compares:
        if path is not None:
            loader.add(path)
    for role in ("drafter", "small"):
        if role in shared_roles(algo, compares):
            value = getattr(args, role) or str(REPO / "checkpoints" / SECOND_MODEL_DIRS[role].format(task=args.task)
                                               / "model.pt")
            if value != "early-exit" and not Path(value).exists():
                raise UsageError(f"no {role} checkpoint at {value}; {shipped_for(algo)}; pass --{role} or train one "
                                 f"(README, 'Training')")
            loader.share(role, value)
    several = len(loader.loaded) > 1
    first = {"batch_size": sizes[0]} if sizes else {}
    runs = [runner.Run(algo, knobs, models=loader.models_for(model_path, algo.name),
                       label=label(args.algo, model_path, several, first), batch_size=sizes[0] if sizes else args.batch_size)]
    for (name, path, over), own_knobs in zip(compares, run_knobs):
        ckpt_path = Path(path) if path else model_path
        own_models = {r: v for r, v in over.items() if r in ("small", "drafter")}
        runs.append(runner.Run(ALGORITHMS[name], own_knobs, models=loader.models_for(ckpt_path, name, own_models),
                               label=label(name, ckpt_path, several, over), batch_size=over.get("batch_size", args.batch_size)))
    if args.invariant:  # every model the runs use, second models and proposal heads included
        import torch

        from refdec.drafter import Drafter
        from refdec.model import set_row_invariant
        for r in runs:
            for m in r.models.values():
                if isinstance(m, Drafter):
                    m = m.model
                if isinstance(m, torch.nn.Module):
                    set_row_invariant(m)
    return loader, runs


def decode_to_output(args, runs: list, models: dict, ids: list, loader, busy) -> int:
    """Decode every line with every run, writing the first run's outputs as they are finished (one
    line per input line, UTF-8 whatever the locale); returns how many leading lines every run finished."""
    import torch

    from refdec import runner
    if not args.output:
        sys.stdout.reconfigure(encoding="utf-8")
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    invalid = {}  # output line -> bytes that are not valid UTF-8

    def render(i: int, tokens) -> str:
        text, dropped = runner.text_line(loader.tokenizer, tokens)
        if dropped:
            invalid[i + 1] = dropped
        return text

    try:
        threads, others_busy = torch.get_num_threads(), busy.others()
        if others_busy is not None and others_busy >= 0.5 and others_busy + threads > runner.usable_cores() + 0.25:
            runner.warn(f"other processes keep about {others_busy:.1f} of this machine's {runner.usable_cores()} cores "
                        f"busy and this run uses {threads} thread(s): timings will not be reliable, and threads that "
                        f"wait for a busy core can make decoding many times slower; run alone, or with --threads 1")
        complete = runner.decode_lines(runs, models, ids, batch_size=args.batch_size, max_len=args.max_len,
                                       max_positions=loader.max_positions, device=args.device, warmup=args.warmup,
                                       progress=not args.quiet, on_line=runner.OutputLines(out, render).put)
    finally:
        if args.output:
            out.close()
    if invalid:
        runner.warn(f"{len(invalid)} output line(s) hold bytes that are not valid UTF-8 (the model wrote part of a "
                    f"character, shown as U+FFFD, the replacement character): line(s) "
                    f"{', '.join(map(str, list(invalid)[:20]))}" + (" ..." if len(invalid) > 20 else ""))
    return complete


def summarise(args, runs: list, lines: list[str], refs: list, ids: list, tokenizer):
    """The table's rows, the speedup matrix, the lossless checks (every line where a lossless run
    differs from greedy of the same model, with the margin there; at batch size 1 the speedup by edit
    ratio) and the printed text."""
    from refdec import runner
    from refdec.data import TASKS
    rows = []
    for r in runs:
        rows.append(runner.summary_row(r, runner.scores(TASKS[args.task], lines, runner.texts(tokenizer, r.outputs), refs)))
        rows[-1]["options"] = {k: v for k, v in r.knobs.items() if k in r.algo.knobs}
    for row, r in zip(rows[1:], runs[1:]):
        row["speedup"] = row["seconds"] / rows[0]["seconds"] if rows[0]["seconds"] else float("nan")
        row["identical"] = runner.identical_rate(runs[0].outputs, r.outputs)
    notes, matrix, checks = [], None, []
    if len(runs) > 2:
        matrix, text = runner.speedup_matrix(rows)
        notes.append(text)
    for fast in runs:
        base = min((r for r in runs if r.algo.name == "greedy" and r.models["model"] is fast.models["model"]),
                   key=lambda r: r.batch_size, default=None)  # batch-1 greedy where there is one
        if base is None or fast is base or not fast.algo.is_lossless(fast.knobs):
            continue
        div = runner.divergences(fast.models["model"], ids, base.outputs, fast.outputs, args.device)
        check = {"algo": fast.name, "greedy": base.name,
                 "identical": runner.identical_rate(base.outputs, fast.outputs), "divergences": div}
        notes.append(f"{fast.name} vs {base.name}: {check['identical']:.4f} identical, {len(div)} line(s) differ"
                     + "".join(f"\n  line {d['line']}: first divergence at token {d['position']} "
                               f"(greedy {tokenizer.tokens([d['greedy_token']])[0]!r}, "
                               f"{fast.name} {tokenizer.tokens([d['other_token']])[0]!r}); top-1/top-2 logit "
                               f"margin {d['margin_top1_top2']:.3g}" for d in div))
        if fast.batch_size == 1 and base.batch_size == 1:
            buckets, text = runner.edit_buckets(lines, runner.texts(tokenizer, base.outputs), fast, base)
            check["edit_buckets"] = buckets
            notes.append(text)
        checks.append(check)
    return rows, matrix, checks, "\n\n".join([runner.format_table(rows)] + notes)


def own_default(other, first, task: str) -> str | None:
    """The default checkpoint of a compared algorithm that needs its own (blockwise: a checkpoint with
    proposal heads), or None: the first run's checkpoint (greedy beside blockwise runs on the heads'
    file, whose base model it is, so the lossless check compares the two on one model)."""
    if other.model_dir in (first.model_dir, "{task}"):
        return None
    path = REPO / "checkpoints" / other.checkpoint_dir(task) / "model.pt"
    if not path.exists():
        from refdec.runner import UsageError
        raise UsageError(f"--compare {other.name}: no checkpoint at {path}; {shipped_for(other)}")
    return str(path)


def shipped_for(algo) -> str:
    """Which tasks have a shipped checkpoint for `algo` (and its second models): said when one is missing."""
    from refdec.data import TASKS
    second = {"drafter": "{task}-drafter", "small": "{task}-small-aligned"}
    tasks = [t for t in TASKS if all((REPO / "checkpoints" / d / "model.pt").exists() for d in
                                     [algo.checkpoint_dir(t)] + [second[r].format(task=t) for r in algo.roles if r in second])]
    return (f"--algo {algo.name} has shipped models for --task {' and '.join(tasks)}" if tasks
            else f"no task has shipped models for --algo {algo.name}")


def check_fits(run, ids: list, args, max_positions: int, dtype) -> None:
    """Refuse, before decoding, what this run's models or this machine cannot do: a block size the
    proposal heads were not trained for, and batches (beams counted as rows) that would not fit in
    the memory the machine has available."""
    from refdec import runner
    from refdec.runner import UsageError
    models = run.models
    if run.algo.name == "blockwise" and run.knobs["block_size"] and not 2 <= run.knobs["block_size"] <= models["heads"].k:
        raise UsageError(f"--block-size must be between 2 and the {models['heads'].k} the proposal heads were "
                         f"trained for, not {run.knobs['block_size']}")
    free = runner.available_memory()
    if free is None:
        return
    beams = run.knobs["beam_size"] if run.algo.name == "beam" else 1
    todo = [s for s in ids if s is not None]
    cfg, itemsize = models["model"].cfg, torch_itemsize(dtype)
    need, worst = 0, 0
    size = run.batch_size or args.batch_size
    for i in range(0, len(todo), size):
        batch = todo[i:i + size]
        src_len = max(map(len, batch)) + 1
        b = runner.decode_bytes(cfg, len(batch) * beams, src_len, runner.max_len_for(batch, args.max_len, max_positions),
                                itemsize)
        if b > need:
            need, worst = b, len(batch)
    if need > 0.8 * free:
        per_row = need / (worst * beams)
        fit = int(0.8 * free / per_row)
        what = (f"--beam-size {beams} with --batch-size {size}" if beams > 1
                else f"--batch-size {size}")
        advice = (f"use at most {max(fit // worst, 0)} beams" if beams > 1 and fit >= worst
                  else f"use at most {max(fit // beams, 1)} sentences per batch" + (" with one beam" if beams > 1 else ""))
        raise UsageError(f"{run.name}: {what} needs about {need / 2**30:.1f} GiB for its caches and scores, more than "
                         f"the {0.8 * free / 2**30:.1f} GiB (80% of what is free) this machine can give it; {advice}")


def torch_itemsize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()


def parse_compare(spec: str) -> list[tuple[str, str | None, dict]]:
    """"greedy,beam@ckpt.pt:beam-size=4" -> [("greedy", None, {}), ("beam", "ckpt.pt", {"beam_size": 4})].

    An option's value is read as its command-line flag reads it; "small" and "drafter" name a
    run's own second model."""
    from refdec.decoding import ALGORITHMS
    from refdec.runner import UsageError
    out = []
    for item in spec.split(","):
        head, *options = item.strip().split(":")
        name, _, path = head.partition("@")
        if name not in ALGORITHMS:
            raise UsageError(f"--compare: unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
        if path and not Path(path).exists():
            raise UsageError(f"--compare: no checkpoint at {path}")
        algo, overrides = ALGORITHMS[name], {}
        for opt in options:
            key, eq, value = opt.partition("=")
            knob = key.replace("-", "_")
            if not eq or not value:
                raise UsageError(f"--compare {item}: write an option as NAME=VALUE, not {opt!r}")
            if knob == "batch_size":
                if not value.isdigit() or int(value) < 1:
                    raise UsageError(f"--compare {item}: batch-size must be a whole number of at least 1, not {value!r}")
                overrides[knob] = int(value)
                continue
            if knob in ("small", "drafter"):
                if knob not in algo.roles:
                    raise UsageError(f"--compare {item}: {name} uses no {knob} model")
                if not (knob == "small" and value == "early-exit") and not Path(value).exists():
                    raise UsageError(f"--compare {item}: no checkpoint at {value}")
                overrides[knob] = value
                continue
            if knob not in algo.knobs:
                raise UsageError(f"--compare {item}: {key} is not an option of {name} "
                                 f"(its options: {', '.join(k.replace('_', '-') for k in algo.knobs) or 'none'})")
            default = KNOB_DEFAULTS[knob]
            try:
                overrides[knob] = (value.lower() in ("1", "true", "yes", "on") if isinstance(default, bool)
                                   else type(default)(value))
            except ValueError:
                raise UsageError(f"--compare {item}: {key}={value} is not a {type(default).__name__}") from None
        out.append((name, path or None, overrides))
    return out


def batch_sizes(args) -> list[int]:
    """--batch-sizes as numbers (empty without it); refused beside --batch-size, which it replaces."""
    from refdec.runner import UsageError
    if not args.batch_sizes:
        return []
    if args.batch_size is not None:
        raise UsageError("--batch-sizes sets every run's batch size: leave out --batch-size")
    try:
        sizes = [int(v) for v in args.batch_sizes.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes takes whole numbers separated by commas, not {args.batch_sizes!r}") from None
    if min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise UsageError("--batch-sizes must be different numbers, each at least 1")
    return sizes


def label(algo: str, path: Path, with_model: bool, over: dict | None = None) -> str:
    """Row name: the algorithm, plus the checkpoint's folder when the runs use several checkpoints,
    plus the run's own options (a second model by its folder)."""
    name = f"{algo}@{path.parent.name}" if with_model else algo
    for k, v in (over or {}).items():
        v = (Path(v).parent.name if k in ("small", "drafter") and v != "early-exit"
             else f"{v:g}" if isinstance(v, float) else v)
        name += f":{k.replace('_', '-')}={v}"
    return name


def page_facts(args, loader, n: int, interrupted: bool) -> dict:
    """The --html page's header: what was decoded, with which model and command."""
    import shlex

    import torch

    from refdec.data import DATA_DIR
    return {"task": args.task, "model": str(loader.main_path), "input": args.input or f"{DATA_DIR / args.task}/test.src.gz",
            "sentences": f"{n}" + (" (interrupted: the lines every run finished)" if interrupted else ""),
            "batch size": args.batch_size, "device": f"{args.device}, {args.dtype}, {torch.get_num_threads()} thread(s)",
            "command": shlex.join(["python", "decode.py", *args.argv])}


if __name__ == "__main__":
    sys.exit(main())
