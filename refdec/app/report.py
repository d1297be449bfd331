"""What decode.py reports once the runs are done: the summary table (one row per run, each with its
speed and identical rate against the first), the speedup matrix, each lossless run's check against
greedy decoding of its model (refdec.app.exactness), the speedup by edit ratio, and the JSON report.
refdec.app.htmlreport draws the same figures as a page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .. import data as data_mod
from ..metrics import corpus_bleu, corpus_chrf, edit_ratio, gec_scores
from ..tokenizer import Tokenizer
from .exactness import divergences, identical_rate, same_model
from .inputs import shown_path
from .runner import Run, texts

NOTHING_DECODED = (
    "nothing was decoded: no line with text was finished (an empty input, blank lines only, or an "
    "interruption before the first); no figures to report"
)


def scores(task_kind: str, sources: list[str], hyps: list[str], refs: list[list[str]] | None) -> dict:
    if not refs:
        return {}
    out = {"bleu": corpus_bleu(hyps, refs), "chrf": corpus_chrf(hyps, refs)}
    if task_kind == "gec":
        per_sentence = [list(r) for r in zip(*refs)]
        g = gec_scores(sources, hyps, per_sentence)
        out.update(gec_precision=g["precision"], gec_recall=g["recall"], gec_f05=g["f05"])
    return out


def summary_row(run: Run, metrics: dict) -> dict:
    st = run.stats
    return {
        "algo": run.name,
        "n": st.sentences,
        "seconds": run.seconds,
        "batch_size": run.batch_size or None,
        **({"batch_tokens": run.batch_tokens} if run.batch_tokens else {}),
        "sent_per_s": st.sentences / run.seconds if run.seconds else float("nan"),
        "tokens": st.tokens,
        "ms_per_token": 1000 * run.seconds / max(st.tokens, 1),
        "verifier_calls": st.verifier_calls,
        "calls_per_sentence": st.verifier_calls / max(st.sentences, 1),
        "drafter_calls": st.drafter_calls,
        "tokens_per_call": st.mean_committed,
        "hit_max_len": st.hit_max_len,
        "encoder_calls": st.encoder_calls,
        **({"module_seconds": st.module_seconds} if st.module_seconds else {}),
        **metrics,
    }


def format_table(rows: list[dict]) -> str:
    return columns(table_cells(rows))


def columns(cells: list[list[str]]) -> str:
    """Text cells as right-aligned columns, a rule under the header (the first row): every command's
    tables."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def table_cells(rows: list[dict]) -> list[list[str]]:
    """The summary table as text cells, its header first: the columns some row has a figure for."""
    cols = [
        ("algo", "algo", "{}"),
        ("n", "sent", "{}"),
        ("seconds", "seconds", "{:.2f}"),
        ("sent_per_s", "sent/s", "{:.1f}"),
        ("ms_per_token", "ms/tok", "{:.2f}"),
        ("tokens", "tokens", "{}"),
        ("verifier_calls", "verif.calls", "{}"),
        ("calls_per_sentence", "calls/sent", "{:.2f}"),
        ("drafter_calls", "draft.calls", "{}"),
        ("tokens_per_call", "tok/call", "{:.2f}"),
        ("bleu", "BLEU", "{:.2f}"),
        ("chrf", "chrF", "{:.2f}"),
        ("gec_f05", "F0.5", "{:.4f}"),
        ("speed_vs_first", f"speed vs {rows[0]['algo']}", relative_speed),
        ("identical", f"identical to {rows[0]['algo']}", "{:.4f}"),
    ]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    show = lambda fmt, v: fmt(v) if callable(fmt) else fmt.format(v)  # noqa: E731
    return [[c[1] for c in cols]] + [[show(c[2], r[c[0]]) if c[0] in r else "" for c in cols] for r in rows]


def relative_speed(factor: float) -> str:
    """A row's speed_vs_first (the first row's seconds over the row's) in words: "1.50x faster", or
    "2.00x slower" (it took twice as long)."""
    if not math.isfinite(factor) or factor <= 0:
        return "n/a"
    if abs(factor - 1) < 0.005:
        return "same"
    return f"{factor:.2f}x faster" if factor > 1 else f"{1 / factor:.2f}x slower"


def speedup_matrix(rows: list[dict]) -> tuple[list[list[float]], str]:
    """m[i][j] = seconds of row j / seconds of row i: how many times faster row i ran than row j
    (all rows timed in one process, interleaved). Returns the matrix and its printed form."""
    names = [r["algo"] for r in rows]
    m = [[(c["seconds"] / r["seconds"]) if r["seconds"] else float("nan") for c in rows] for r in rows]
    cells = [["speedup of row over column"] + names] + [[n] + [f"{v:.2f}x" for v in line] for n, line in zip(names, m)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return m, "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


EDIT_BUCKETS = ((0.0, 0.0), (0.0, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, float("inf")))


def divergence_check(run: Run, base: Run, ids: list, tokenizer: Tokenizer, device, notes: list[str]) -> dict:
    """`run`'s outputs against greedy's (`base`): the identical rate and every line that differs, with
    the first divergent token and the top-1/top-2 logit margin there of `base`'s model; its text
    goes to `notes`."""
    div = divergences(base.models.model, ids, base.outputs, run.outputs, device)
    check = {
        "algo": run.name,
        "greedy": base.name,
        "identical": identical_rate(base.outputs, run.outputs),
        "divergences": div,
    }
    notes.append(
        f"{run.name} vs {base.name}: {check['identical']:.4f} identical, {len(div)} line(s) differ"
        + "".join(
            f"\n  line {d['line']}: first divergence at token {d['position']} "
            f"(greedy {tokenizer.tokens([d['greedy_token']])[0]!r}, "
            f"{run.name} {tokenizer.tokens([d['other_token']])[0]!r}); top-1/top-2 logit "
            f"margin {d['margin_top1_top2']:.3g}"
            for d in div
        )
    )
    return check


def edit_buckets(sources: list[str], hyps: list[str], fast: Run, base: Run) -> tuple[list[dict], str]:
    """Per-sentence speedup of `fast` over `base` grouped by the edit ratio of the output (word edit
    distance between input and output over input length): how the gain depends on how much of the
    input survives. Needs per-sentence times (batch size 1)."""
    ratio = {i: edit_ratio(s, h) for i, (s, h) in enumerate(zip(sources, hyps)) if fast.times[i] and base.times[i]}
    rows = []
    for lo, hi in EDIT_BUCKETS:
        idx = [i for i, r in ratio.items() if (r == lo if lo == hi else lo < r <= hi)]
        if not idx:
            continue
        per = sorted(base.times[i] / fast.times[i] for i in idx)
        rows.append(
            {
                "edit_ratio": "0" if lo == hi else (f"({lo:g}, {hi:g}]" if hi != float("inf") else f"> {lo:g}"),
                "sentences": len(idx),
                "calls_per_sentence": sum(fast.calls[i] for i in idx) / len(idx),
                "speedup": sum(base.times[i] for i in idx) / sum(fast.times[i] for i in idx),
                "median_sentence_speedup": per[len(per) // 2],
            }
        )
    head = ("edit ratio", "sentences", f"{fast.name} calls/sent", f"speedup over {base.name}", "median per sentence")
    cells = [list(head)] + [
        [
            r["edit_ratio"],
            str(r["sentences"]),
            f"{r['calls_per_sentence']:.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['median_sentence_speedup']:.2f}x",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return rows, "\n".join("  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells)


def build_report(task: str, rows: list[dict], runs: list[Run], *, n_lines: int, fields: dict) -> dict:
    """The JSON report: the first run's figures at the top level, the second run's under "compare"
    (every run's are under "runs"), and `fields`, the other top-level fields."""
    first = rows[0]
    keys = ("seconds", "tokens", "ms_per_token", "verifier_calls", "drafter_calls", "tokens_per_call", "hit_max_len")
    report = {
        "algo": runs[0].algo.name,
        "task": task,
        "n": n_lines,
        "decoded": first["n"],
        **{k: first[k] for k in keys},
        "bleu": first.get("bleu"),
        "chrf": first.get("chrf"),
        **{k: first[k] for k in ("gec_f05", "gec_precision", "gec_recall") if k in first},
        "options": runs[0].options,
        **fields,
    }
    if len(rows) > 1:
        compared = rows[1]
        report["compare"] = {
            "algo": runs[1].algo.name,
            "seconds": compared["seconds"],
            "speed_vs_first": compared["speed_vs_first"],
            "identical": compared["identical"],
            "bleu": compared.get("bleu"),
            "chrf": compared.get("chrf"),
            "tokens": compared["tokens"],
            "verifier_calls": compared["verifier_calls"],
            **{k: compared[k] for k in ("gec_f05",) if k in compared},
            "options": runs[1].options,
        }
    return report


def run_report(
    task: str,
    summary: Summary,
    runs: list[Run],
    *,
    n_lines: int,
    model: str,
    model_step,
    input: str,
    settings: dict,
    interrupted: bool,
    environment: dict,
) -> dict:
    """decode.py's JSON report of a run: its model, input and settings (batches, max_len, route), every
    run's row, the speedup matrix and the lossless checks, and the machine it ran on. `n_lines`: the
    lines every run finished (all of them unless the run was interrupted)."""
    return build_report(
        task,
        summary.rows,
        runs,
        n_lines=n_lines,
        fields={
            "model": model,
            "model_step": model_step,
            "input": input,
            **settings,
            "runs": summary.rows,
            "speedup_matrix": summary.matrix,
            "lossless_checks": summary.checks,
            "interrupted": interrupted,
            "lines_decoded": n_lines,
            "environment": environment,
        },
    )


def write_report(path: str, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass
class Summary:
    rows: list[dict]  # one per run (summary_row), with speed_vs_first and identical rate against the first
    matrix: list[list[float]] | None  # speedup of every run over every other (three runs or more)
    checks: list[dict]  # each lossless run against greedy of its model: identical rate, divergences
    text: str  # the printed form


def summarise(
    task: str,
    runs: list[Run],
    lines: list[str],
    refs: list,
    ids: list,
    tokenizer: Tokenizer,
    device,
    *,
    warning: str | None = None,
    matrix_text: bool = True,
) -> Summary:
    """The table's rows, the speedup matrix, the lossless checks (every line where a lossless run
    differs from greedy of the same model, with the margin there; for GEC at batch size 1 the
    speedup by edit ratio) and the printed text: `warning` (e.g. that the machine was busy) under the
    table, or, where no line was decoded, that sentence instead of a table of empty figures. Without
    `matrix_text` the matrix is left out of the text (it stays in `matrix`).

    The same model is the same weights on the same route, in int8 or not alike, whichever file they
    were loaded from (exactness.same_model): heads stored alone on a frozen base are checked against
    greedy of the base's own file. A lossless run that no greedy run shares a model with, beside
    greedy runs of other models, gets a line saying that it was not checked."""
    kind = data_mod.TASKS.get(task)  # None: a Hugging Face folder's text, no task (BLEU and chrF with --ref)
    rows = [
        {**summary_row(r, scores(kind, lines, texts(tokenizer, r.outputs), refs)), "options": r.options} for r in runs
    ]
    for row, r in zip(rows[1:], runs[1:]):
        # the table's "speed vs" column: above 1 this run is that many times faster than the first
        row["speed_vs_first"] = rows[0]["seconds"] / row["seconds"] if row["seconds"] else float("nan")
        row["identical"] = identical_rate(runs[0].outputs, r.outputs)
    notes, matrix, checks = [], None, []
    if len(runs) > 2:
        matrix, text = speedup_matrix(rows)
        notes += [text] if matrix_text else []
    for fast in runs:
        if not fast.algo.is_lossless(fast.options):
            continue
        base = min(
            (
                r
                for r in runs
                if r.algo.name == "greedy" and r.int8 == fast.int8 and same_model(r.models.model, fast.models.model)
            ),
            key=lambda r: r.batch_size or float("inf"),
            default=None,
        )  # batch-1 greedy where there is one
        if fast is base:
            continue
        if base is None:
            if any(r.algo.name == "greedy" for r in runs):  # a check the reader would look for: say why there is none
                notes.append(
                    f"{fast.name}: not checked against greedy: no greedy run here decodes with its model "
                    f"({shown_path(fast.models.path)}{', int8' if fast.int8 else ''})"
                )
            continue
        check = divergence_check(fast, base, ids, tokenizer, device, notes)
        if kind == "gec" and fast.batch_size == 1 and base.batch_size == 1:  # how much of the input survives
            check["edit_buckets"], text = edit_buckets(lines, texts(tokenizer, base.outputs), fast, base)
            notes.append(text)
        checks.append(check)
    for q in runs:  # greedy on the int8 route against greedy in floating point on the same checkpoint
        base = min(
            (r for r in runs if r.algo.name == "greedy" and not r.int8 and r.models.path == q.models.path),
            key=lambda r: r.batch_size or float("inf"),
            default=None,
        )
        if q.algo.name == "greedy" and q.int8 and base is not None:
            checks.append({**divergence_check(q, base, ids, tokenizer, device, notes), "int8_against_float": True})
    if not any(r["n"] for r in rows):
        return Summary(rows, matrix, checks, NOTHING_DECODED)
    table = format_table(rows) + (f"\nwarning: {warning}" if warning else "")
    return Summary(rows, matrix, checks, "\n\n".join([table] + notes))
