"""decode.py --html: one self-contained HTML page of a decoding run.

The page holds the summary table (the rows decode.py prints), the speedup matrix and lossless
checks, charts drawn with matplotlib and inlined as SVG (speedup by edit ratio, tokens committed per
verifier call, time per module, quality against speed), and every sentence with each run's output
and its decoding drawn iteration by iteration from the trace (refdec.trace.Step): the drafted tokens
that were accepted, the verifier's own token at the bifurcation, the drafted tokens it rejected, and
who wrote what (BiLD's small and large model, GAD's draft and verify lines). A text box searches the
sentences and a menu keeps those where a run's output differs from greedy decoding of its model.

Tokens are drawn as the words they spell, grouped as --trace groups them (refdec.trace.words): a
word's tokens side by side with a thin line between them (its tokens, split by |, in the word's
title), each token coloured by its part.

Nothing is loaded from elsewhere: styles, script and figures are all inline in the page. The style,
the script and the page around them are files of the package (refdec/app/assets/: report.css,
report.js, report.html), read with importlib.resources, so an installed copy has them. matplotlib is
imported only here, so the library and decode.py without --html run without it.
"""

from __future__ import annotations

import html
import io
import json
import re
from importlib import resources

import torch

from ..errors import UsageError
from ..repo import install_hint
from ..trace import Step, how_drafted, iad_notes, iterations, source_tokens, token_pieces, words
from . import report, runner
from .exactness import same_model

PARTS = {"accepted": "drafted, accepted", "own": "the verifier's own token", "rejected": "drafted, rejected"}


def check_available() -> None:
    """--html draws its charts with matplotlib: refuse before any decoding if it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--html needs matplotlib ({install_hint('html')})") from None


def write_page(path: str, **kw) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(build_page(**kw))


def write_run_page(
    path: str,
    summary: report.Summary,
    runs: list,
    tokenizer,
    sources: list[str],
    refs: list[list[str]],
    ids: list,
    *,
    task: str | None,
    model: str,
    input: str,
    interrupted: bool,
    device: str,
    batch_size: int | None,
    batch_tokens: int | None,
    command: str,
) -> None:
    """decode.py's page of a run: a header of what ran (task, model, input, batches, device, the
    command), then build_page."""
    batches = (
        (f"{batch_tokens} source tokens" + (f", at most {batch_size} sentences" if batch_size else ""))
        if batch_tokens
        else batch_size or 1
    )
    facts = {
        "task": task,
        "model": model,
        "input": input,
        "sentences": f"{len(sources)}" + (" (interrupted: the lines every run finished)" if interrupted else ""),
        "batch size": batches,
        "device": f"{device}, {torch.get_num_threads()} thread(s)",
        "command": command,
    }
    write_page(
        path,
        title=f"refdec: {' vs '.join(r.name for r in runs)} on {task or model}",
        facts=facts,
        summary=summary,
        sources=sources,
        refs=refs,
        ids=ids,
        runs=runs,
        tokenizer=tokenizer,
    )


def build_page(
    *,
    title: str,
    facts: dict,
    summary: report.Summary,
    sources: list[str],
    refs: list[list[str]],
    ids: list,
    runs: list,
    tokenizer,
) -> str:
    """The page for runs decoded on `sources` (`ids` their token ids, None for an empty line), with
    the figures of report.summarise; a sentence's time is its own at batch size 1, its batch's
    average otherwise. `facts`: name -> value lines of the header (task, model, command ...). Every
    run must have been decoded with traces."""
    e = html.escape
    rows, matrix, checks = summary.rows, summary.matrix, summary.checks
    greedy_of = {
        id(r): next(
            (
                g
                for g in runs
                if g.algo.name == "greedy"
                and g is not r
                and g.int8 == r.int8
                and same_model(g.models.model, r.models.model)
            ),
            None,
        )
        for r in runs
    }
    charts = [
        c
        for c in (
            chart_quality_speed(rows),
            chart_edit_buckets(checks),
            chart_tokens_per_call(runs),
            chart_module_time(rows),
        )
        if c
    ]
    body = [
        f"<header><h1>{e(title)}</h1><dl>"
        + "".join(f"<dt>{e(k)}</dt><dd>{e(str(v))}</dd>" for k, v in facts.items())
        + "</dl></header>",
        "<h2>Summary</h2>",
        summary_html(rows, matrix, checks),
    ]
    if charts:
        body += ["<h2>Charts</h2>", '<div class="charts">' + "".join(charts) + "</div>"]
    filters = "".join(
        f'<option value="{e(r.name)}">{e(r.name)} differs from greedy</option>'
        for r in runs
        if greedy_of[id(r)] is not None
    )
    if filters:
        filters = '<option value="*">any run differs from greedy</option>' + filters
    body.append(f"""<h2>Sentences</h2>
<div class="controls"><input id="q" type="search" placeholder="search the sources, references and outputs"
  autocomplete="off">
<select id="only"><option value="">all sentences</option>{filters}</select>
<span id="count"></span></div>
{legend_html()}""")
    piece = token_pieces(tokenizer)
    for i, line in enumerate(sources):
        body.append(sentence_html(i, line, [r[i] for r in refs], ids[i], runs, greedy_of, tokenizer, piece))
    return asset("report.html").format(
        title=e(title), style=asset("report.css"), script=asset("report.js"), body="\n".join(body)
    )


def asset(name: str) -> str:
    """The text of one of the page's files in refdec/app/assets/ (its style, script and template)."""
    return (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")


def summary_html(rows: list[dict], matrix, checks: list[dict]) -> str:
    e = html.escape
    cells = report.table_cells(rows)
    out = ['<table class="num"><thead><tr>' + "".join(f"<th>{e(c)}</th>" for c in cells[0]) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in cells[1:]]
    out.append("</tbody></table>")
    if matrix:
        names = [r["algo"] for r in rows]
        out.append(
            '<table class="num"><caption>speedup of row over column</caption><thead><tr><th></th>'
            + "".join(f"<th>{e(n)}</th>" for n in names)
            + "</tr></thead><tbody>"
            + "".join(
                f"<tr><th>{e(n)}</th>" + "".join(f"<td>{v:.2f}x</td>" for v in line) + "</tr>"
                for n, line in zip(names, matrix)
            )
            + "</tbody></table>"
        )
    for c in checks:
        div = c["divergences"]
        links = ", ".join(
            f'<a href="#s{d["line"]}">line {d["line"]}</a> (token {d["position"]}, top-1/top-2 '
            f"margin {d['margin_top1_top2']:.3g})"
            for d in div
        )
        out.append(
            f'<p class="check"><b>{e(c["algo"])}</b> vs <b>{e(c["greedy"])}</b>: '
            f"{c['identical']:.4f} identical, {len(div)} line(s) differ" + (f": {links}" if div else "") + "</p>"
        )
        if c.get("edit_buckets"):  # the statistic the edit-ratio chart draws, under the same name
            head = ("edit ratio", "sentences", f"{c['algo']} calls/sent", bucket_speedup_name(c["greedy"]))
            out.append(
                '<table class="num"><thead><tr>'
                + "".join(f"<th>{e(h)}</th>" for h in head)
                + "</tr></thead><tbody>"
                + "".join(
                    f"<tr><td>{e(b['edit_ratio'])}</td><td>{b['sentences']}</td>"
                    f"<td>{b['calls_per_sentence']:.2f}</td><td>{b['speedup']:.2f}x</td></tr>"
                    for b in c["edit_buckets"]
                )
                + "</tbody></table>"
            )
    return "\n".join(out)


def bucket_speedup_name(greedy: str) -> str:
    """The one statistic of an edit-ratio bucket that the page shows, in its table and its chart: the
    bucket's summed time of greedy over the run's (a few slow sentences weigh as they do in the total),
    not a per-sentence median, which can lie on the other side of 1x."""
    return f"speedup over {greedy} (bucket's total time)"


def legend_html() -> str:
    chips = "".join(f'<span class="tok {k}">{html.escape(v)}</span> ' for k, v in PARTS.items())
    return (
        f'<p class="legend">{chips} &nbsp; Each numbered row is one iteration: one call of the model whose '
        f"output is produced (GAD: the drafter's block D, then what verification kept V). A drafted token is "
        f"copied from the source (IAD), drafted by the drafter (GAD), proposed by the heads (blockwise) or "
        f"written by the small model S (BiLD, speculative decoding; L marks the large model's own token). GAD's "
        f"drafter always fills its block: the tokens after its own &lt;/s&gt; are filler, never committed. "
        f"IAD's notes number the source's tokens from 1, as its row x does. "
        f"Beam search: the token each live beam added at each step, best beam first. Tokens are drawn as the "
        f"words they spell; a thin line inside a word marks where one token ends and the next begins (the "
        f"word's tokens are in its tooltip).</p>"
    )


def chips(items: list[tuple[int, str]], piece) -> str:
    """(token, part) pairs drawn as the words they spell (refdec.trace.words, the trace's grouping):
    one box per word, each token in it a chip coloured by its part (accepted, own, rejected), a thin
    line where one token ends and the next begins, and the word's tokens, split by |, in its title."""
    out = []
    for w in words([t for t, _ in items], piece):
        texts = [piece(items[i][0])[0] for i in w]
        title = f' title="{html.escape("|".join(texts))}"' if len(texts) > 1 else ""
        out.append(
            f'<span class="word"{title}>'
            + "".join(f'<span class="tok {items[i][1]}">{html.escape(text)}</span>' for i, text in zip(w, texts))
            + "</span>"
        )
    return "".join(out)


def tagged(tokens, part: str) -> list[tuple[int, str]]:
    """The (token, part) pairs of chips: every token of `tokens` in one part."""
    return [(t, part) for t in tokens]


def sentence_html(i: int, line: str, refs: list[str], src_ids, runs: list, greedy_of: dict, tokenizer, piece) -> str:
    e = html.escape
    if src_ids is None:
        return (
            f'<section class="sent" id="s{i + 1}" data-differs="[]"><div class="src"><a class="n" href="#s{i + 1}">'
            f"{i + 1}</a><i>(blank line: every run writes an empty line)</i></div></section>"
        )
    differs = []
    parts = []
    for n, r in enumerate(runs):
        out = r.outputs[i]
        text = runner.text_line(tokenizer, out)[0]
        g = greedy_of[id(r)]
        diff = g is not None and out is not None and g.outputs[i] is not None and not torch.equal(out, g.outputs[i])
        if diff:
            differs.append(r.name)
        badge = f' <span class="badge">differs from {e(g.name)}</span>' if diff else ""
        if r.traces[i] is None:  # a batch the run failed on (warned): an empty output line
            parts.append(
                f'<div class="run" data-run="{e(r.name)}"><div class="runhead"><b>{e(r.name)}</b>{badge}</div>'
                f'<span class="out"><i>(no output: decoding this batch failed)</i></span></div>'
            )
            continue
        steps = r.traces[i]
        facts = f"{sum(s.verified for s in steps)} call(s)"
        if r.times[i] is not None:
            facts += f", {1000 * r.times[i]:.1f} ms" + ("" if r.batch_size == 1 else " (batch average)")
        parts.append(
            f'<details class="run" data-run="{e(r.name)}"{" open" if n == 0 else ""}>'
            f"<summary><b>{e(r.name)}</b>{badge} "
            f'<span class="facts">{e(facts)}</span><span class="out">{e(text)}</span></summary>'
            f"{steps_html(r.algo.name, steps, piece)}</details>"
        )
    refs_html = "".join(f'<div class="ref"><span class="lab">ref</span>{e(x)}</div>' for x in refs)
    src = e(line)
    return (
        f'<section class="sent" id="s{i + 1}" data-differs="{e(json.dumps(differs))}">'
        f'<div class="src"><a class="n" href="#s{i + 1}">{i + 1}</a>{src}</div>{refs_html}{"".join(parts)}</section>'
    )


def steps_html(algo: str, steps: list[Step], piece) -> str:
    """A run's decoding of one sentence, one row per iteration."""
    if algo == "greedy":
        return (
            f'<div class="steps"><div class="it"><span class="k">{iterations(len(steps))}, one token each</span>'
            f'<span class="toks">{chips(tagged((s.own for s in steps), "own"), piece)}</span></div></div>'
        )
    if algo == "beam":
        return beam_html(steps, piece)
    rows = []
    if algo == "iad" and steps and steps[0].source:  # the source's tokens, numbered as the notes count them
        rows.append(
            f'<div class="it source"><span class="k">x</span><span class="toks">'
            f"{html.escape(source_tokens(steps[0].source, piece))}</span>"
            '<span class="how">the source token by token, numbered from 1</span></div>'
        )
    notes = iad_notes(steps, piece) if algo == "iad" else []
    for n, s in enumerate(steps, 1):
        acc = tagged(s.drafted[: s.accepted], "accepted")
        own = tagged([s.own], "own") if s.own is not None else []
        rej = tagged(s.rejected, "rejected")
        if algo == "gad":
            rows.append(
                f'<div class="it"><span class="k">{n}</span><span class="dv">D</span>'
                f'<span class="toks">{chips(acc + rej, piece)}</span></div>'
                f'<div class="it"><span class="k"></span><span class="dv">V</span>'
                f'<span class="toks">{chips(acc + own, piece)}</span>'
                f'<span class="how">{s.accepted} of {len(s.drafted)} drafted tokens accepted</span></div>'
            )
            continue
        if algo in ("bild", "speculative"):
            how = (
                f"S wrote {len(s.drafted)}, L accepted {s.accepted}"
                if s.verified and s.drafted
                else "nothing from S"
                if s.verified
                else f"S wrote {len(s.drafted)} after the last L call"
            )
            how += f", rolled back {len(s.rejected)}" if s.rejected and algo == "bild" else ""
            how += f", rejected {len(s.rejected)}" if s.rejected and algo == "speculative" else ""
            how += ", L wrote 1" if s.own is not None else ""
            body = (f'<span class="who">S</span>{chips(acc + rej, piece)}' if s.drafted else "") + (
                f'<span class="who">L</span>{chips(own, piece)}' if own else ""
            )
        else:
            how = notes[n - 1] if notes else how_drafted(s)
            body = chips(acc + own + rej, piece)
        rows.append(
            f'<div class="it"><span class="k">{n}</span><span class="toks">{body}</span>'
            f'<span class="how">{html.escape(how)}</span></div>'
        )
    return '<div class="steps">' + "".join(rows) + "</div>"


def beam_html(steps: list[Step], piece) -> str:
    """Beam search as a grid: one column per step, one row per live beam (best first), each cell the
    token that beam added at that step; the final best beam's cells are marked."""
    if not steps:
        return '<div class="steps"></div>'
    width = max(len(s.beams) for s in steps)
    head = "".join(f"<th>{n}</th>" for n in range(1, len(steps) + 1))
    body = []
    for k in range(width):
        cells = []
        for s in steps:
            if k < len(s.beams) and s.beams[k] and s.scores[k] != float("-inf"):
                text, _ = piece(s.beams[k][-1])
                cells.append(f'<td class="{"own" if k == 0 else ""}">{html.escape(text)}</td>')
            else:
                cells.append("<td></td>")
        body.append(f"<tr><th>{k + 1}</th>{''.join(cells)}</tr>")
    return (
        f'<div class="steps beam"><span class="how">{len(steps)} steps; the token each live beam (rank 1 = best) '
        f"added at each step</span><table><thead><tr><th>beam</th>{head}</tr></thead><tbody>{''.join(body)}"
        f"</tbody></table></div>"
    )


# ---------------------------------------------------------------- charts (matplotlib, inline SVG)


def svg(fig, name: str, caption: str) -> str:
    """The figure as an inline <svg> (text kept as text, every id prefixed with the chart's name so
    that several charts on one page never share one), in a <figure> with its caption."""
    import matplotlib
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "refdec"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML declaration and doctype
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'(\bid="|url\(#|href="#)([^")]+)', rf"\1{name}-\2", text)  # one id space per chart
    return f"<figure>{text}<figcaption>{html.escape(caption)}</figcaption></figure>"


def figure(w: float = 5.2, h: float = 3.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(w, h))
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)
    return fig, ax


PALETTE = ["#3b6fb6", "#e07b39", "#4c9a5b", "#b0478f", "#8c7a3a", "#5aa9b8", "#c44e52", "#7f7f7f"]


def chart_quality_speed(rows: list[dict]) -> str:
    """BLEU (and F0.5 on GEC tasks) against speed relative to the first row, one point per run.

    Both axes start at 0, so that the distance between two points is in proportion to the
    difference (an autoscaled axis spreads 89.41 and 89.43 BLEU over the whole chart); each point
    beside the first is labelled with its difference from the first, which the eye cannot read there."""
    if len(rows) < 2 or not all(r.get("bleu") is not None and r["seconds"] > 0 for r in rows):
        return ""
    import matplotlib.pyplot as plt

    metrics = [("bleu", "BLEU", 100.0, "{:+.2f}")] + (
        [("gec_f05", "F0.5", 1.0, "{:+.4f}")] if all("gec_f05" in r for r in rows) else []
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    base = rows[0]["seconds"]
    speeds = [base / r["seconds"] for r in rows]
    for ax, (key, name, scale, fmt) in zip(axes[0], metrics):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(color="#e5e5e5", linewidth=0.8)
        ax.set_axisbelow(True)
        for n, (r, x) in enumerate(zip(rows, speeds)):
            ax.scatter(
                [x],
                [r[key]],
                s=50,
                color=PALETTE[n % len(PALETTE)],
                zorder=3,
                label=r["algo"],
                marker="os^Dvp<>"[n % 8],
            )
            if n:
                ax.annotate(
                    quality_delta(r[key] - rows[0][key], fmt),
                    (x, r[key]),
                    textcoords="offset points",
                    xytext=(6, -12 if n % 2 else 5),
                    fontsize=7,
                    color="#555",
                )
        ax.set_xlabel(f"speed relative to {rows[0]['algo']} (higher is faster)")
        ax.set_ylabel(f"{name} (difference from {rows[0]['algo']} beside each point)")
        ax.set_xlim(0, 1.15 * max(speeds))
        ax.set_ylim(0, min(scale, 1.15 * max(r[key] for r in rows)) or scale)
    axes[0][0].legend(frameon=False, fontsize=8)
    return svg(
        fig,
        "quality",
        f"Quality against speed: one point per run, all timed in one process; both axes start "
        f"at 0, and each point is labelled with its difference from {rows[0]['algo']}.",
    )


def quality_delta(delta: float, fmt: str) -> str:
    """A difference from the first row's score, "same" when it prints as zero."""
    text = fmt.format(delta)
    return "same" if float(text) == 0 else text


def chart_edit_buckets(checks: list[dict]) -> str:
    """Speedup over greedy by the output's edit ratio (the lossless checks' buckets, batch size 1):
    bucket_speedup_name's statistic, the one the summary's bucket table gives. The axis starts at 0."""
    checks = [c for c in checks if c.get("edit_buckets")]
    if not checks:
        return ""
    labels = []
    for c in checks:
        labels += [b["edit_ratio"] for b in c["edit_buckets"] if b["edit_ratio"] not in labels]
    fig, ax = figure()
    width = 0.8 / len(checks)
    for n, c in enumerate(checks):
        by = {b["edit_ratio"]: b for b in c["edit_buckets"]}
        xs = [labels.index(k) + (n - (len(checks) - 1) / 2) * width for k in by]
        bars = ax.bar(
            xs,
            [b["speedup"] for b in by.values()],
            width * 0.92,
            color=PALETTE[n % len(PALETTE)],
            label=f"{c['algo']} over {c['greedy']}",
        )
        for bar, b in zip(bars, by.values()):
            ax.annotate(
                f"{b['speedup']:.2f}x\nn={b['sentences']}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
    ax.axhline(1, color="#999", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("edit ratio of the output (word edits / source words)")
    ax.set_ylabel(bucket_speedup_name(checks[0]["greedy"] if len(checks) == 1 else "greedy"))
    ax.set_ylim(0, 1.2 * max(b["speedup"] for c in checks for b in c["edit_buckets"]))
    if len(checks) > 1:
        ax.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    return svg(
        fig,
        "edit",
        "Speedup over greedy by the edit ratio of the output (how much of the source it changes): "
        "greedy's summed time over the bucket's sentences divided by the run's, from per-sentence "
        "times at batch size 1 (the table above gives the same figures); n = sentences in the bucket.",
    )


def chart_tokens_per_call(runs: list) -> str:
    """How many tokens each verifier call committed (draft-then-verify runs; greedy and beam commit
    one per call)."""
    runs = [r for r in runs if r.stats.committed and max(r.stats.committed) > 1]
    if not runs:
        return ""
    fig, ax = figure()
    top = max(max(r.stats.committed) for r in runs)
    bins = [b - 0.5 for b in range(1, top + 2)]
    for n, r in enumerate(runs):
        ax.hist(
            r.stats.committed,
            bins=bins,
            weights=[100 / len(r.stats.committed)] * len(r.stats.committed),
            histtype="stepfilled" if len(runs) == 1 else "step",
            linewidth=1.4,
            alpha=0.85 if len(runs) == 1 else 1,
            color=PALETTE[n % len(PALETTE)],
            label=f"{r.name} (mean {r.stats.mean_committed:.2f})",
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens committed by one call")
    ax.set_ylabel("% of calls")
    ax.set_xlim(0.5, top + 0.5)
    ax.legend(frameon=False, fontsize=8)
    return svg(
        fig,
        "calls",
        "Tokens committed per verifier call: each call commits its accepted draft and one token of its own.",
    )


def chart_module_time(rows: list[dict]) -> str:
    """Seconds per part of the model (rows with module_seconds: GAD's encoders, drafter and verifier)."""
    rows = [r for r in rows if r.get("module_seconds")]
    if not rows:
        return ""
    parts = list(dict.fromkeys(k for r in rows for k in r["module_seconds"]))
    fig, ax = figure(5.2, 0.7 + 0.45 * len(rows))
    ax.grid(axis="y", visible=False)
    ax.grid(axis="x", color="#e5e5e5", linewidth=0.8)
    left = [0.0] * len(rows)
    for n, part in enumerate(parts):
        vals = [r["module_seconds"].get(part, 0.0) for r in rows]
        ax.barh(range(len(rows)), vals, left=left, color=PALETTE[n % len(PALETTE)], label=part, height=0.6)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(rows)), [r["algo"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(frameon=False, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.1 / len(rows)))
    return svg(
        fig, "modules", "Time per module, summed over the sentences (the rest of a run's time is the loop around them)."
    )
