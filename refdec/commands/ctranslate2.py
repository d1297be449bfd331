"""refdec against CTranslate2 on the same weights: the engine people pick for fast seq2seq decoding on
a CPU, as the baseline refdec's decoders are measured against.

    python -m refdec ctranslate2 --task gec-uk --model checkpoints/gec-uk-6x6/model.pt \\
        --batch-sizes 1,32 --limit 500 --threads 1,2 [--iad] [--fast] [--int8] --report reports/ct2.json
    (--batch-tokens N,N: also in batches by a token budget; --max-draft 0,16: IAD once per value)

The checkpoint goes through refdec.hf's export (a Pegasus folder that stock transformers loads, checked
against refdec's float64 logits) and then CTranslate2's own converter, TransformersConverter, with two
of its stock Pegasus loader's settings made right for refdec's models:
  * the loader reads `normalize_before` from the config to choose pre-norm layers; transformers 5's
    Pegasus config no longer carries it (Pegasus is always pre-norm), and refdec exports pre-norm
    models only, so it is set to True on the loaded model before the loader reads it (and
    `normalize_embedding`, read the same way, to False: Pegasus has no LayerNorm on its embeddings);
  * the loader starts the decoder at the pad token (Pegasus's own convention); refdec's decoders start
    at bos, so the converted model's decoder_start_token is refdec's bos token.
The converted model (float32 weights; int8 is CTranslate2's quantisation of them at load time) is
cached in a folder named by the checkpoint's sha256 and the CTranslate2 version, under --cache-dir
(default: $XDG_CACHE_HOME/refdec/ctranslate2, else ~/.cache/refdec/ctranslate2), never in the repository.

Each CTranslate2 compute type is a run of refdec.app.runner's timing loop like any refdec decoder: one translate_batch
call (beam_size 1, no minimum length, the same output budget as refdec's, eos returned so that it is counted) per batch.
For each thread count, refdec greedy, optionally refdec IAD, with --fast both again on refdec's fast route
(refdec.routes.fast), with --int8 both again on refdec's int8 route (refdec.routes.int8; on the fast route with --fast),
and CTranslate2 greedy in float32 and int8, each at batch 1 and at every --batch-sizes value, decode the same lines
interleaved after a warm-up; the table gives ms per output token (eos included), sentences per second and the identical
rate against refdec greedy at batch 1 (token ids equal), and every differing line's first divergent position with
refdec's top-1/top-2 margin there; each refdec int8 run's identical rate against refdec int8 greedy at batch 1, with the
int8 model's margin at every line that differs; then, for each CTranslate2 run, how far its scores (the mean
log-probability per output token of its own output) lie from refdec's log-probabilities of the same tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ..app import exactness
from ..app.algorithms import ALGORITHMS, Algorithm
from ..app.inputs import (
    add_threads,
    check_outputs,
    check_threads,
    checkpoint_files,
    input_files,
    read_input,
    shown_path,
    source_ids,
)
from ..app.loading import Models
from ..app.report import format_table, summary_row, write_report
from ..app.runner import Run, decode_lines
from ..checkpoint import file_sha256, load_model
from ..data import source_rows, source_tensor
from ..decoding.result import DecodeResult, DecodeStats, result_of
from ..errors import UsageError, run_command
from ..hf import PEGASUS, check_export, export_route, write_folder
from ..machine import allocator_option, environment, machine_line, set_allocator, warn_if_int8_slow
from ..progress import ProgressLine
from ..repo import cache_folder, check_not_shipped, repo_file
from ..routes import on_route
from ..timing import seconds
from . import as_typed
from .harness import report_option, time_decode, time_products

PINNED = "4.8.5"  # the version requirements.txt pins
COMPUTE_TYPES = ("float32", "int8")
ROW_KEYS = ("algo", "batch_size", "batch_tokens", "n", "seconds", "sent_per_s", "ms_per_token", "tokens", "hit_max_len")


def _ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise UsageError(
            f"this needs the ctranslate2 package (pip install ctranslate2=={PINNED}, listed in requirements.txt)"
        ) from None
    return ctranslate2


def converter(ctranslate2, folder: Path, start_token: str):
    """CTranslate2's TransformersConverter on refdec's Pegasus export, its stock loader's two settings
    made right (module docstring)."""

    class PegasusFromRefdec(ctranslate2.converters.TransformersConverter):
        def load_model(self, model_class, model_name_or_path, **kwargs):
            model = super().load_model(model_class, model_name_or_path, **kwargs)
            model.config.normalize_before = True  # refdec exports pre-norm models only
            model.config.normalize_embedding = False  # Pegasus has no LayerNorm on the embeddings
            return model

        def _load(self):
            spec = super()._load()
            spec.config.decoder_start_token = start_token  # refdec's decoders start at bos, not pad
            return spec

    return PegasusFromRefdec(str(folder))


def convert(ckpt: str | Path, model, tokenizer, cache_dir: Path) -> tuple[Path, dict]:
    """The CTranslate2 model folder for a refdec checkpoint (`model`, `tokenizer`: it, loaded), from the
    cache or converted now; and what the conversion did ({"cached": True} or the export's check)."""
    ctranslate2 = _ctranslate2()
    if export_route(model.cfg) != PEGASUS:
        raise UsageError(f"{ckpt}: only models exported as Pegasus (refdec's sinusoidal positions) are converted")
    folder = cache_dir / f"{file_sha256(ckpt)[:20]}-ctranslate2-{ctranslate2.__version__}"
    if (folder / "model.bin").is_file():
        return folder, {"cached": True}
    print(f"converting {ckpt} for CTranslate2 (once: kept in {folder})", file=sys.stderr, flush=True)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache_dir))
    except OSError as e:
        raise UsageError(f"--cache-dir {cache_dir} cannot be written: {e.strerror}") from None
    try:
        hf_dir = write_folder(model, tokenizer, work / "hf")
        checked = check_export(model, hf_dir, tokenizer.encode("A short sentence to check the export."))
        start = tokenizer.tokens([model.cfg.bos_id])[0]
        converter(ctranslate2, hf_dir, start).convert(str(work / "ct2"), quantization="float32")
        try:
            os.replace(work / "ct2", folder)  # whole or absent: a run killed midway leaves no half model
        except OSError:
            if not (folder / "model.bin").is_file():  # another run's conversion got there first: keep it
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder, {"cached": False, **checked}


def vocabulary(folder: Path, vocab_size: int) -> list[str]:
    """The converted model's tokens, by id: the converter writes the tokenizer's vocabulary in id order."""
    import json

    tokens = json.loads((folder / "shared_vocabulary.json").read_text(encoding="utf-8"))
    if len(tokens) != vocab_size:
        raise UsageError(f"{folder}: {len(tokens)} tokens in the converted vocabulary, the model has {vocab_size}")
    return tokens


def ct2_algorithm(translator, tokens: list[str], name: str) -> Algorithm:
    """A CTranslate2 translator as an Algorithm of refdec.app.runner's timing loop: greedy decoding of a
    batch of refdec source rows in one translate_batch call, returned as refdec's decoders return it.
    Each line's output and CTranslate2's score of it (the mean log-probability per output token, eos
    included) are kept in the decoder's `scored`, by source."""
    index = {t: i for i, t in enumerate(tokens)}

    def decode_ct2(model, src: torch.Tensor, *, max_len: int, trace: bool = False) -> DecodeResult:
        cfg = model.cfg
        sources = source_rows(src, cfg.eos_id, cfg.pad_id)
        rows = [[tokens[t] for t in s + [cfg.eos_id]] for s in sources]
        results = translator.translate_batch(
            rows,
            beam_size=1,
            max_decoding_length=max_len,
            min_decoding_length=0,
            max_input_length=0,
            return_end_token=True,
            return_scores=True,
        )
        outs = [[index[t] for t in r.hypotheses[0]] for r in results]  # eos included where produced
        decode_ct2.scored.update({tuple(s): (o, r.scores[0]) for s, o, r in zip(sources, outs, results)})
        return result_of(outs, cfg.eos_id, DecodeStats(sentences=len(rows), encoder_calls=1), None, src.device)

    decode_ct2.scored = {}
    return Algorithm(name, decode_ct2, f"CTranslate2 greedy ({name})")


def logprob_gaps(model, ids: list, scored: dict) -> dict | None:
    """CTranslate2's score of each line's output against refdec's for the same tokens (teacher-forced,
    the mean log-probability per output token, eos included): the number of lines, and the largest
    and the median absolute difference."""
    gaps = []
    cfg = model.cfg
    with torch.inference_mode():
        for src in ids:
            out, score = scored.get(tuple(src), (None, None)) if src is not None else (None, None)
            if not out:
                continue
            tgt = torch.tensor([[cfg.bos_id] + out])
            logp = torch.log_softmax(model(source_tensor([src], cfg.eos_id, cfg.pad_id), tgt[:, :-1]).double(), -1)[0]
            gaps.append(abs(logp.gather(1, tgt[0, 1:, None]).mean().item() - score))
    return {"lines": len(gaps), "max": max(gaps), "median": statistics.median(gaps)} if gaps else None


def make_runs(
    args,
    models: Models,
    ct2: dict[str, object],
    tokens: list[str],
    fast: Models | None = None,
    int8: Models | None = None,
) -> list[Run]:
    """Every method at batch 1, at each --batch-sizes value and at each --batch-tokens budget; refdec
    greedy at batch 1 first (the reference of the identical rate). IAD once per --max-draft value.
    With `fast` (the same model on the fast route), refdec's methods again on it; with `int8` (on the
    int8 route), again on that."""
    refdec = [(ALGORITHMS["greedy"], {}, "refdec-greedy")]
    if args.iad:
        iad = ALGORITHMS["iad"]
        refdec += [
            (iad, {**iad.defaults(), "max_draft": n}, "refdec-iad" + (f"-draft{n}" if n else ""))
            for n in args.max_draft
        ]
    methods = [(algo, options, label, models) for algo, options, label in refdec]
    if fast is not None:
        methods += [(algo, options, f"{label}-fast", fast) for algo, options, label in refdec]
    if int8 is not None:
        route = "-fast-int8" if args.fast else "-int8"  # --int8 puts it on the fast route with --fast
        methods += [(algo, options, f"{label}{route}", int8) for algo, options, label in refdec]
    runs = []
    batchings = [(size, 0, f"b{size}") for size in args.batch_sizes] + [(0, n, f"t{n}") for n in args.batch_tokens]
    for size, budget, tag in batchings:  # a CTranslate2 algorithm per batching: each keeps its own lines' scores
        ct2_methods = [
            (ct2_algorithm(translator, tokens, f"ct2-greedy-{c}"), {}, f"ct2-greedy-{c}", models)
            for c, translator in ct2.items()
        ]
        runs += [
            Run(algo, options, run_models, f"{label} {tag}", size, batch_tokens=budget, int8=run_models is int8)
            for algo, options, label, run_models in methods + ct2_methods
        ]
    return runs


def compare(
    args,
    models: Models,
    folder: Path,
    tokens: list[str],
    ids: list,
    threads: int,
    fast: Models | None = None,
    int8: Models | None = None,
) -> tuple[list[dict], int, dict | None]:
    """One thread count: every run decodes every line, interleaved; a row of figures per run, how
    many leading lines every run finished (all of them unless Ctrl-C stopped the loop), and with
    --step-cost one decoder step's cost per route and compute type. An int8 run's row also holds its
    identical rate against int8 greedy at batch 1 and the lines where it differs from it."""
    ctranslate2 = _ctranslate2()
    ct2_threads = threads if args.ct2_threads is None else args.ct2_threads
    ct2 = {
        c: ctranslate2.Translator(str(folder), device="cpu", compute_type=c, intra_threads=ct2_threads, inter_threads=1)
        for c in COMPUTE_TYPES
    }
    # After the translators: making one sets the OpenMP thread count of the calling thread, which
    # torch's own operations read too (CTranslate2 keeps its count in its own worker thread).
    torch.set_num_threads(threads)
    runs = make_runs(args, models, ct2, tokens, fast, int8)
    model = models.model
    int8_greedy = next((r for r in runs if int8 is not None and r.models is int8), None)  # int8 greedy at batch 1
    done = decode_lines(
        runs, ids, max_len=None, max_positions=model.cfg.max_positions, device="cpu", warmup=args.warmup, progress=True
    )
    finished = done == len(ids)
    ran_threads = torch.get_num_threads()  # what refdec's runs had (threads, unless something set it since)
    ids = ids[:done]
    base = runs[0].outputs[:done]
    rows = []
    for run in runs:
        row = summary_row(run, {})
        outs = run.outputs[:done]
        scored = getattr(run.algo.decoder, "scored", None)
        rows.append(
            {
                **{k: row.get(k) for k in ROW_KEYS},
                "threads": ran_threads if scored is None else ct2_threads,
                "identical": exactness.identical_rate(base, outs),
                "differing": exactness.divergences(model, ids, base, outs, "cpu"),
                **({"logprob_gap": logprob_gaps(model, ids, scored)} if scored is not None else {}),
                **(
                    {
                        "int8_greedy": int8_greedy.name,
                        "identical_int8_greedy": exactness.identical_rate(int8_greedy.outputs[:done], outs),
                        "differing_int8_greedy": exactness.divergences(
                            int8.model, ids, int8_greedy.outputs[:done], outs, "cpu"
                        ),
                    }
                    if int8_greedy is not None and run.models is int8 and run is not int8_greedy
                    else {}
                ),
            }
        )
    steps = None
    if args.step_cost and finished:
        routes = (
            [("refdec", model)]
            + ([("refdec-fast", fast.model)] if fast is not None else [])
            + ([("refdec" + "-fast" * args.fast + "-int8", int8.model)] if int8 is not None else [])
        )
        steps = step_costs(routes, ct2, tokens, None if fast is None else fast.model)
    return rows, done, steps


def step_costs(
    models: list[tuple[str, torch.nn.Module]],
    ct2: dict[str, object],
    tokens: list[str],
    fast=None,
    prefix: int = 30,
    src_len: int = 30,
    more: int = 20,
    rounds: int = 15,
) -> dict[str, float]:
    """Milliseconds of one decoder step (one row, a cache of about `prefix` tokens, a source of
    `src_len`) for each refdec route (`models`: name, model; refdec.commands.harness.time_decode, the
    vocabulary projection included) and each CTranslate2 compute type: translate_batch forced to
    write prefix + `more` tokens against prefix tokens (min_decoding_length), the difference over
    `more` (its steps include its search bookkeeping, refdec's do not include the argmax). With `fast`
    (the float fast route, one of `models`), also its step's matrix products alone
    (refdec.commands.harness.time_products): the floor of that step in PyTorch's products. Medians over
    interleaved rounds after one warm-up round."""
    src = torch.full((1, src_len - 1), 11)
    src = torch.cat([src, torch.full((1, 1), models[0][1].cfg.eos_id)], 1)
    names = [n for n, _ in models] + (["refdec-fast-products"] if fast is not None else []) + [f"ct2-{c}" for c in ct2]
    times: dict[str, list[float]] = {name: [] for name in names}
    progress = ProgressLine(rounds + 1, "rounds of one decoder step")
    with torch.inference_mode():
        memories = {name: m.encode(src) for name, m in models}
        for r in range(rounds + 1):
            progress.update(r)
            for name, m in models:
                cost = time_decode(m, memories[name], prefix, 1, 5)
                times[name].append(cost)
            if fast is not None:
                times["refdec-fast-products"].append(time_products(fast, 5))
            for c, translator in ct2.items():
                ends = []
                for n in (prefix, prefix + more):
                    call = lambda n=n, translator=translator: translator.translate_batch(  # noqa: E731
                        [[tokens[t] for t in src[0].tolist()]],
                        beam_size=1,
                        min_decoding_length=n,
                        max_decoding_length=n,
                        max_input_length=0,
                    )
                    ends.append(seconds(call))
                times[f"ct2-{c}"].append((ends[1] - ends[0]) / more)
    return {name: 1000 * statistics.median(v[1:]) for name, v in times.items()}


def table(rows: list[dict]) -> str:
    """The printed figures of one thread count, and every line that differs from refdec greedy."""
    out = [format_table(rows)]
    for r in rows:
        if r.get("logprob_gap"):
            g = r["logprob_gap"]
            out.append(
                f"{r['algo']}: its score (mean log-probability per token) against refdec's for the same tokens "
                f"on {g['lines']} lines: largest difference {g['max']:.2g}, median {g['median']:.2g}"
            )
    for r in rows:
        for d in r["differing"]:
            out.append(
                f"{r['algo']}: line {d['line']} differs from refdec greedy at position {d['position']} "
                f"(refdec's top-1/top-2 margin there {d['margin_top1_top2']:.3g})"
            )
    for r in rows:
        if "int8_greedy" in r:
            out.append(f"{r['algo']}: identical to {r['int8_greedy']} {r['identical_int8_greedy']:.4f}")
            for d in r["differing_int8_greedy"]:
                out.append(
                    f"{r['algo']}: line {d['line']} differs from {r['int8_greedy']} at position {d['position']} "
                    f"(int8 top-1/top-2 margin there {d['margin_top1_top2']:.3g})"
                )
    return "\n".join(out)


def int_list(text: str, least: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of at least {least}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=as_typed("ctranslate2"), description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="the checkpoint's task; its data/<task>/test.src.gz is decoded")
    p.add_argument("--model", required=True, help="a refdec model.pt")
    p.add_argument("--input", help="decode this UTF-8 text file instead of the task's test set")
    p.add_argument("--limit", type=int, default=200, help="first N lines decoded (default 200)")
    p.add_argument(
        "--batch-sizes",
        type=int_list,
        default=[],
        metavar="B,B",
        help="batch sizes besides 1, comma-separated (default: batch 1 only)",
    )
    p.add_argument(
        "--batch-tokens",
        type=int_list,
        default=[],
        metavar="N,N",
        help="token budgets, comma-separated: every method again in batches of neighbours in length "
        "holding at most N source tokens with their padding (decode.py --batch-tokens)",
    )
    add_threads(p, default="1", several=True, says="1; each count a round of every run")
    p.add_argument(
        "--ct2-threads",
        type=int,
        metavar="T",
        help="CTranslate2's threads in every round, refdec's being each --threads count (default: the "
        "round's count). Where CTranslate2 is slower with more threads, its waiting workers also "
        "slow the refdec runs interleaved with them: T=1 keeps them out of refdec's rounds",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up batches per run (default 2)")
    allocator_option(p, "; for both libraries")
    p.add_argument("--iad", action="store_true", help="time refdec IAD too (GEC: drafts a copy of the input)")
    p.add_argument(
        "--max-draft",
        type=lambda text: sorted(set(int_list(text, 0))),
        default=[0],
        metavar="N,N",
        help="with --iad: most tokens drafted per verifier call (0 = up to the end of the source); "
        "several values, comma-separated: an IAD run for each (default 0)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="time refdec's methods on its fast route too (refdec.routes.fast), "
        "each against refdec greedy on the reference route",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="time refdec's methods on its int8 route too (refdec.routes.int8; "
        "on the fast route with --fast): its greedy against refdec greedy, its IAD against its greedy",
    )
    p.add_argument(
        "--step-cost",
        action="store_true",
        help="also time one decoder step on each refdec route and "
        "each CTranslate2 compute type (1 row, a cache of 30 tokens, a source of 30)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(cache_folder("ctranslate2")),
        help="where converted models are kept, one folder per checkpoint, outside the repository's "
        "checkpoints/ and data/ (default %(default)s)",
    )
    report_option(p)
    return p


def check_args(args) -> None:
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    if args.warmup < 0:
        raise UsageError("--warmup must be at least 0")
    if args.max_draft != [0] and not args.iad:
        raise UsageError("--max-draft has no effect without --iad")
    args.threads = check_threads(args.threads, several=True)
    check_threads(args.ct2_threads, flag="--ct2-threads")
    args.batch_sizes = sorted({1, *args.batch_sizes})
    check_outputs(
        {"--report": args.report},
        input_files(args.task, args.input)
        | checkpoint_files("--model", args.model)
        | {"the converted models' folder (--cache-dir)": args.cache_dir},
    )
    check_not_shipped("--cache-dir", args.cache_dir)


def run(args) -> int:
    check_args(args)
    set_allocator(args.allocator)
    ctranslate2 = _ctranslate2()
    model, tokenizer, _ = load_model(args.model, task=args.task)
    if not args.input:
        repo_file("data", args.task, "test.src.gz", flag="--input FILE")  # the task's test set: the repository's
    lines, _ = read_input(args.task, args.input, [], args.limit)
    ids = source_ids(tokenizer, lines, model.cfg.max_positions)
    if all(s is None for s in ids):
        raise UsageError("no line with text to decode")
    folder, conversion = convert(args.model, model, tokenizer, Path(args.cache_dir))
    tokens = vocabulary(folder, model.cfg.vocab_size)
    models = Models(model, Path(args.model))
    fast = None
    if args.fast:  # the same model wrapped: the reference runs read it as it is
        fast = Models(on_route(model, "fast"), Path(args.model))
    int8 = None
    if args.int8:  # the int8 route, on the fast route with --fast
        warn_if_int8_slow("cpu", "refdec's faster route here is --fast without --int8")
        int8 = Models(on_route(model, "fast" if args.fast else "reference", int8=True), Path(args.model))
    results, interrupted = [], False
    print(machine_line(",".join(map(str, args.threads))), flush=True)
    for threads in args.threads:
        rows, done, steps = compare(args, models, folder, tokens, ids, threads, fast, int8)
        interrupted = done < len(ids)
        print(
            f"{args.task}: {sum(s is not None for s in ids[:done])} lines{' (interrupted)' if interrupted else ''}, "
            f"{threads} thread(s){f' (CTranslate2 {args.ct2_threads})' if args.ct2_threads is not None else ''}, "
            f"warm-up {args.warmup}"
        )
        print(table(rows), flush=True)
        if steps:
            print(
                "one decoder step (1 row, a cache of 30, a source of 30): "
                + ", ".join(f"{name} {ms:.3f} ms" for name, ms in steps.items()),
                flush=True,
            )
        results.append({"threads": threads, "rows": rows, **({"step_ms": steps} if steps else {})})
        if interrupted:  # Ctrl-C: report what was finished, start no other thread count
            break
    if args.report:
        write_report(
            args.report,
            {
                "task": args.task,
                "model": shown_path(args.model),
                "input": args.input,
                "lines": len(ids),
                "limit": args.limit,
                "warmup": args.warmup,
                "batch_sizes": args.batch_sizes,
                "batch_tokens": args.batch_tokens,
                "threads": args.threads,
                "ct2_threads": args.ct2_threads,
                "interrupted": interrupted,
                "iad": args.iad,
                "fast": args.fast,
                "int8": args.int8,
                "step_cost": args.step_cost,
                "max_draft": args.max_draft,
                "compute_types": list(COMPUTE_TYPES),
                "checkpoint_sha256": file_sha256(args.model),
                "conversion": conversion,
                "ctranslate2": ctranslate2.__version__,
                "environment": environment(args.threads, "cpu", torch.float32),
                "results": results,
            },
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
