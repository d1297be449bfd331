"""What decode.py does: read input, decode it with one algorithm (and, with --compare, a second one
interleaved in the same process), time both, score the outputs, print a table, write a JSON report.

Timing covers encoding and decoding of each batch (time.perf_counter around the decoder call), after
a warm-up on the first sentences that is not counted. With --compare the two algorithms alternate
batch by batch, and which goes first alternates too, so drift in machine speed hits both alike.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from . import data as data_mod
from .decoding import DecodeStats
from .errors import UsageError
from .metrics import corpus_bleu, corpus_chrf, gec_scores
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .algorithms import Algorithm
    from .loading import Models


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def read_text_lines(path: str) -> list[str]:
    """Lines of a UTF-8 file, or of stdin for '-'. Invalid UTF-8 is an error naming the line."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    if path.endswith(".gz"):
        import gzip
        import zlib
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UsageError(f"{path} is not a valid gzip file ({e}); give the plain text file instead") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(line.rstrip(b"\r").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: line {i} is not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None
    return out


def check_writable(path: str, what: str, *, not_paths: dict[str, str] | None = None) -> None:
    """Fail before any decoding if `path` cannot be written, so that finished work is never lost at the
    end: the folder must exist, the path must not be a folder (or one of `not_paths`, e.g. the input),
    and opening it for appending must work (this creates no file that was not there)."""
    p = Path(path)
    for other_what, other in (not_paths or {}).items():
        if other and other != "-" and Path(other).resolve() == p.resolve():
            raise UsageError(f"{what} {path} is also the {other_what}: it would be overwritten")
    if p.is_dir():
        raise UsageError(f"{what} {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"{what} {path}: the folder {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be written: {e.strerror}") from None
    if not existed:
        p.unlink()


class OutputLines:
    """Output lines written in input order as soon as every earlier line is done, each whole and
    flushed: an interrupted or killed run keeps every line it finished."""

    def __init__(self, stream, render: Callable[[int, torch.Tensor | None], str]):
        self.stream, self.render = stream, render
        self.next, self.ready = 0, {}

    def put(self, index: int, tokens: torch.Tensor | None) -> None:
        self.ready[index] = self.render(index, tokens)
        lines = []
        while self.next in self.ready:
            lines.append(self.ready.pop(self.next) + "\n")
            self.next += 1
        if lines:
            with sigint_deferred():  # a Ctrl-C now cannot cut a line in half
                self.stream.write("".join(lines))
                self.stream.flush()


@contextlib.contextmanager
def sigint_deferred():
    """Hold SIGINT back for the duration (POSIX): it is delivered, as usual, right after."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable on Linux), or None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def decode_bytes(cfg, rows: int, src_len: int, out_len: int, itemsize: int) -> int:
    """A rough peak of the memory decoding `rows` rows at once takes (beams count as rows): per row,
    every decoder layer's self-attention keys and values over the output and cross-attention ones
    over the source, the encoder's activations, and a few vocabulary-wide score rows. Within ~10% of
    the measured peak for a whole UA-GEC test set in one batch."""
    per_row = (cfg.dec_layers * 2 * (out_len + src_len) * cfg.d_model
               + 2 * src_len * max(cfg.d_ff, 4 * cfg.d_model) + 4 * cfg.vocab_size)
    return rows * per_row * itemsize


class BusyCores:
    """How many cores other processes kept busy while this one ran (from /proc/stat, less this
    process's own CPU time): a benchmark on a busy machine is warned about, not trusted silently."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        own = os.times()
        return time.monotonic(), (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system

    def others(self) -> float | None:
        now = self._sample()
        if self.start is None or now is None or now[0] - self.start[0] < 0.2:
            return None
        wall = now[0] - self.start[0]
        return max(0.0, ((now[1] - self.start[1]) - (now[2] - self.start[2])) / wall)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class Run:
    """One algorithm's outputs and accumulated figures over the whole input."""

    algo: "Algorithm"  # refdec.algorithms
    options: dict
    models: "Models"  # refdec.loading
    label: str = ""  # name in tables ("" = the algorithm's name)
    batch_size: int = 1  # sentences per decoder call
    trace: bool = False  # keep each sentence's steps
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    traces: list = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)  # per line: seconds of its batch / batch size
    calls: list[int | None] = field(default_factory=list)  # per line: verifier calls of its batch

    @property
    def name(self) -> str:
        return self.label or self.algo.name


def source_ids(tokenizer: Tokenizer, lines: list[str], max_positions: int) -> list[list[int] | None]:
    """Token ids per line; None for an empty line (its output is empty). Overlong lines are cut
    to what the model accepts, with a warning: the line still gets an output."""
    out = []
    limit = max_positions - 1  # room for the eos that ends every source
    for i, line in enumerate(lines, 1):
        if not line.strip():
            out.append(None)
            continue
        ids = tokenizer.encode(line)
        if len(ids) > limit:
            warn(f"input line {i} has {len(ids)} tokens, more than the model's {limit}; decoding its first {limit}")
            ids = ids[:limit]
        out.append(ids)
    return out


def max_len_for(batch: list[list[int]], max_len: int | None, max_positions: int) -> int:
    """Output budget in tokens (eos included): --max-len if given, else 2 x source + 10, within the
    model's positions."""
    budget = max_len if max_len is not None else 2 * max(len(s) for s in batch) + 10
    return max(1, min(budget, max_positions - 1))


def run_batch(run: Run, batch: list[list[int]], max_len: int, device) -> tuple[list, float, DecodeStats, list | None]:
    cfg = run.models.model.cfg  # an imported model brings its own ids
    src = data_mod.source_tensor(batch, cfg.eos_id, cfg.pad_id).to(device)
    t0 = time.perf_counter()
    res = run.algo.run(run.models, src, max_len, run.options, trace=run.trace)
    if src.is_cuda:
        torch.cuda.synchronize()
    return [t.cpu() for t in res.tokens], time.perf_counter() - t0, res.stats, res.trace


WARMUP_ROWS = 16  # a warm-up batch holds at most this many sentences, whatever --batch-size


def length_chunks(ids: list[list[int] | None], size: int) -> list[list[int]]:
    """The indices of the non-empty lines in chunks of `size`: in input order for size 1, else
    sorted by source length (stable) so that each chunk holds neighbours in length, and a batch does
    not wait, in calls and in padded width, on one long row. Outputs go back to their lines by index."""
    todo = [i for i, s in enumerate(ids) if s is not None]
    if size > 1:
        todo.sort(key=lambda i: len(ids[i]))
    return [todo[i:i + size] for i in range(0, len(todo), size)]


def decode_lines(runs: list[Run], ids: list[list[int] | None], *,
                 max_len: int | None, max_positions: int, device, warmup: int = 2, progress: bool = True,
                 on_line: Callable[[int, torch.Tensor | None], None] | None = None) -> int:
    """Fill each run's outputs, seconds and stats; runs alternate chunk by chunk (interleaved timing).

    With batches of more than one sentence the lines are bucketed by source length (`length_chunks`).
    A chunk holds the largest batch of any run; each run decodes it in batches of its own size
    (Run.batch_size), with the one output budget of the chunk (max_len_for its
    sources), so that runs at different batch sizes decode each line alike. A chunk counts once
    every run has decoded it: only then are its figures added and its lines (the first run's) passed
    to `on_line`, in input order with the empty lines between them, as soon as every earlier line is
    done. Ctrl-C stops at that boundary. Returns how many leading input lines every run finished
    (all of them unless interrupted)."""
    size = max(run.batch_size for run in runs)
    chunks = length_chunks(ids, size)
    for run in runs:
        run.outputs = [None] * len(ids)
        run.traces = [None] * len(ids)
        run.times = [None] * len(ids)
        run.calls = [None] * len(ids)
    done = [s is None for s in ids]
    complete = 0  # input lines 0 .. complete-1 are done by every run

    def advance() -> None:  # hand over every line up to the first one not done, the empty ones too
        nonlocal complete
        while complete < len(ids) and done[complete]:
            if on_line is not None:
                on_line(complete, runs[0].outputs[complete])
            complete += 1

    try:
        for c in chunks[:warmup]:  # warm-up: allocator, MKL kernels, caches; not timed, not kept
            for run in runs:
                rows = [ids[i] for i in c[:min(run.batch_size, WARMUP_ROWS)]]
                run_batch(run, rows, max_len_for(rows, max_len, max_positions), device)
        t_start, last_print, finished = time.time(), time.time(), 0
        for n, c in enumerate(chunks):
            budget = max_len_for([ids[i] for i in c], max_len, max_positions)
            order = runs if n % 2 == 0 else runs[::-1]
            results = {}
            for run in order:
                step = run.batch_size
                for b in (c[i:i + step] for i in range(0, len(c), step)):
                    try:
                        results[(id(run), b[0])] = b, run_batch(run, [ids[i] for i in b], budget, device)
                    except (RuntimeError, ValueError) as e:  # one bad batch must not lose the others
                        warn(f"{run.algo.name} failed on input line(s) {', '.join(str(i + 1) for i in b)}: "
                             f"{str(e).splitlines()[0][:200]}; writing empty output line(s) in their place")
            for run in runs:
                for key, (b, (toks, secs, stats, trace)) in results.items():
                    if key[0] != id(run):
                        continue
                    run.seconds += secs
                    run.stats.merge(stats)
                    for j, i in enumerate(b):
                        run.outputs[i] = toks[j]
                        run.times[i] = secs / len(b)
                        run.calls[i] = stats.verifier_calls
                        if trace is not None:
                            run.traces[i] = trace[j]
            for i in c:
                done[i] = True
            advance()
            finished += len(c)
            now = time.time()
            if progress and now - last_print > 5 and n < len(chunks) - 1:  # a line every 5 s on long work
                rate = finished / (now - t_start)
                total = len(ids) - sum(s is None for s in ids)
                print(f"  {finished}/{total} sentences, {rate:.1f}/s, ETA {(total - finished) / rate:.0f}s",
                      file=sys.stderr, flush=True)
                last_print = now
        advance()
    except KeyboardInterrupt:
        pass
    return complete


def text_line(tokenizer: Tokenizer, tokens: torch.Tensor | None) -> tuple[str, int]:
    """One output line and how many bytes of it were not valid UTF-8 (a model can write part of a
    multi-byte character; the line shows U+FFFD there). An empty or failed line stays an empty line,
    and a newline the model might emit is written as a space, so N inputs always give N output lines."""
    if tokens is None:
        return "", 0
    ids = tokens.tolist()
    return tokenizer.decode(ids).replace("\r", " ").replace("\n", " "), tokenizer.invalid_bytes(ids)


def texts(tokenizer: Tokenizer, outputs: list) -> list[str]:
    """Detokenised outputs, one line each (text_line)."""
    return [text_line(tokenizer, t)[0] for t in outputs]


def scores(task_kind: str, sources: list[str], hyps: list[str], refs: list[list[str]] | None) -> dict:
    if not refs:
        return {}
    out = {"bleu": corpus_bleu(hyps, refs), "chrf": corpus_chrf(hyps, refs)}
    if task_kind == "gec":
        per_sentence = [list(r) for r in zip(*refs)]
        g = gec_scores(sources, hyps, per_sentence)
        out.update(gec_precision=g["precision"], gec_recall=g["recall"], gec_f05=g["f05"])
    return out


def identical_rate(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(torch.equal(x, y) for x, y in pairs) / len(pairs) if pairs else 1.0


def summary_row(run: Run, metrics: dict) -> dict:
    st = run.stats
    return {"algo": run.name, "n": st.sentences, "seconds": run.seconds, "batch_size": run.batch_size,
            "sent_per_s": st.sentences / run.seconds if run.seconds else float("nan"), "tokens": st.tokens,
            "ms_per_token": 1000 * run.seconds / max(st.tokens, 1), "verifier_calls": st.verifier_calls,
            "calls_per_sentence": st.verifier_calls / max(st.sentences, 1), "drafter_calls": st.drafter_calls, "tokens_per_call": st.mean_committed,
            "hit_max_len": st.hit_max_len, "encoder_calls": st.encoder_calls, **({"module_seconds": st.module_seconds} if st.module_seconds else {}),
            **metrics}


def format_table(rows: list[dict]) -> str:
    cells = table_cells(rows)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table_cells(rows: list[dict]) -> list[list[str]]:
    """The summary table as text cells, its header first: the columns some row has a figure for."""
    cols = [("algo", "algo", "{}"), ("n", "sent", "{}"), ("seconds", "seconds", "{:.2f}"), ("sent_per_s", "sent/s", "{:.1f}"),
            ("ms_per_token", "ms/tok", "{:.2f}"), ("tokens", "tokens", "{}"), ("verifier_calls", "verif.calls", "{}"),
            ("calls_per_sentence", "calls/sent", "{:.2f}"),
            ("drafter_calls", "draft.calls", "{}"), ("tokens_per_call", "tok/call", "{:.2f}"),
            ("bleu", "BLEU", "{:.2f}"), ("chrf", "chrF", "{:.2f}"), ("gec_f05", "F0.5", "{:.4f}"),
            ("speedup", f"speed vs {rows[0]['algo']}", relative_speed),
            ("identical", f"identical to {rows[0]['algo']}", "{:.4f}")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    show = lambda fmt, v: fmt(v) if callable(fmt) else fmt.format(v)  # noqa: E731
    return [[c[1] for c in cols]] + [[show(c[2], r[c[0]]) if c[0] in r else "" for c in cols] for r in rows]


def relative_speed(seconds_ratio: float) -> str:
    """A row's seconds over the first row's, in words: "2.00x slower" (it took twice as long) or
    "1.50x faster"."""
    if not math.isfinite(seconds_ratio) or seconds_ratio <= 0:
        return "n/a"
    if abs(seconds_ratio - 1) < 0.005:
        return "same"
    return f"{seconds_ratio:.2f}x slower" if seconds_ratio > 1 else f"{1 / seconds_ratio:.2f}x faster"


def speedup_matrix(rows: list[dict]) -> tuple[list[list[float]], str]:
    """m[i][j] = seconds of row j / seconds of row i: how many times faster row i ran than row j
    (all rows timed in one process, interleaved). Returns the matrix and its printed form."""
    names = [r["algo"] for r in rows]
    m = [[(c["seconds"] / r["seconds"]) if r["seconds"] else float("nan") for c in rows] for r in rows]
    cells = [["speedup of row over column"] + names] + [[n] + [f"{v:.2f}x" for v in line] for n, line in zip(names, m)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return m, "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


@torch.inference_mode()
def divergences(model, ids: list[list[int] | None], greedy_out: list, other_out: list, device) -> list[dict]:
    """Every line where `other_out` differs from `greedy_out` (greedy decoding of `model`): the first
    divergent position, the two tokens there, and the model's top-1 minus top-2 logit at that position,
    recomputed the way greedy computes it (one token per call over the greedy prefix). A margin near
    zero is a numerical near-tie between two kernels' roundings, not a decoding error."""
    eos = model.cfg.eos_id
    out = []
    for i, (src, g, o) in enumerate(zip(ids, greedy_out, other_out)):
        if src is None or g is None or o is None or torch.equal(g, o):
            continue
        g_l, o_l = g.tolist() + [eos], o.tolist() + [eos]
        pos = next(p for p in range(min(len(g_l), len(o_l))) if g_l[p] != o_l[p])
        memory = model.encode(data_mod.source_tensor([src], eos, model.cfg.pad_id).to(device))
        cache = model.new_cache(1, capacity=pos + 2)
        prefix = [model.cfg.bos_id] + g_l[:pos]
        for t in prefix:
            logits = model.decode(torch.tensor([[t]], device=device), memory, cache)[0, -1]
        top = logits.float().topk(2)
        out.append({"line": i + 1, "position": pos, "greedy_token": g_l[pos], "other_token": o_l[pos],
                    "margin_top1_top2": float(top.values[0] - top.values[1]),
                    "gap_greedy_vs_other": float(logits[g_l[pos]] - logits[o_l[pos]])})
    return out


EDIT_BUCKETS = ((0.0, 0.0), (0.0, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, float("inf")))


def edit_buckets(sources: list[str], hyps: list[str], fast: "Run", base: "Run") -> tuple[list[dict], str]:
    """Per-sentence speedup of `fast` over `base` grouped by the edit ratio of the output (word edit
    distance between input and output over input length): how the gain depends on how much of the
    input survives. Needs per-sentence times (batch size 1)."""
    from .metrics import edit_ratio
    ratio = {i: edit_ratio(s, h) for i, (s, h) in enumerate(zip(sources, hyps)) if fast.times[i] and base.times[i]}
    rows = []
    for lo, hi in EDIT_BUCKETS:
        idx = [i for i, r in ratio.items() if (r == lo if lo == hi else lo < r <= hi)]
        if not idx:
            continue
        per = sorted(base.times[i] / fast.times[i] for i in idx)
        rows.append({"edit_ratio": "0" if lo == hi else (f"({lo:g}, {hi:g}]" if hi != float("inf") else f"> {lo:g}"),
                     "sentences": len(idx), "calls_per_sentence": sum(fast.calls[i] for i in idx) / len(idx),
                     "speedup": sum(base.times[i] for i in idx) / sum(fast.times[i] for i in idx),
                     "median_sentence_speedup": per[len(per) // 2]})
    head = ("edit ratio", "sentences", f"{fast.name} calls/sent", f"speedup over {base.name}", "median per sentence")
    cells = [list(head)] + [[r["edit_ratio"], str(r["sentences"]), f"{r['calls_per_sentence']:.2f}",
                              f"{r['speedup']:.2f}x", f"{r['median_sentence_speedup']:.2f}x"] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return rows, "\n".join("  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells)


def environment(threads: int, device, dtype) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "threads": threads, "device": str(device), "dtype": str(dtype).replace("torch.", "")}


def build_report(task: str, rows: list[dict], runs: list[Run], *, n_lines: int, extra: dict) -> dict:
    """The JSON report: the first run's figures at the top level, the second run's under "compare"
    (every run's are under "runs")."""
    first = rows[0]
    keys = ("seconds", "tokens", "ms_per_token", "verifier_calls", "drafter_calls", "tokens_per_call", "hit_max_len")
    report = {"algo": runs[0].algo.name, "task": task, "n": n_lines, "decoded": first["n"],
              **{k: first[k] for k in keys}, "bleu": first.get("bleu"), "chrf": first.get("chrf"),
              **{k: first[k] for k in ("gec_f05", "gec_precision", "gec_recall") if k in first},
              "options": runs[0].options, **extra}
    if len(rows) > 1:
        second = rows[1]
        report["compare"] = {"algo": runs[1].algo.name, "seconds": second["seconds"], "speedup": second["speedup"],
                             "identical": second["identical"], "bleu": second.get("bleu"), "chrf": second.get("chrf"),
                             "tokens": second["tokens"], "verifier_calls": second["verifier_calls"],
                             **{k: second[k] for k in ("gec_f05",) if k in second}, "options": runs[1].options}
    return report


def write_report(path: str, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")




# ---- decode.py's steps, in the order it takes them ----

def check_machine(device: str, threads: int | None, *, output: str | None, report: str | None, html: str | None,
                  reads: dict[str, str]) -> None:
    """Device and threads this machine has; output paths checked now, so that a run never decodes
    for an hour to fail on its output. `reads`: name -> path of every file the run reads."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    if threads is not None:
        if not 1 <= threads <= usable_cores():
            raise UsageError(f"--threads must be between 1 and the {usable_cores()} cores this machine gives "
                             f"the run (more threads than cores only slows decoding down)")
        torch.set_num_threads(threads)
    if output:
        check_writable(output, "--output", not_paths=reads)
    if report:
        check_writable(report, "--report", not_paths={**reads, "--output": output})
    if html:
        from .htmlreport import check_available
        check_available()
        check_writable(html, "--html", not_paths={**reads, "--output": output, "--report": report})


def read_input(task: str, path: str | None, ref_paths: list[str], limit: int | None) -> tuple[list[str], list[list[str]]]:
    """The input lines and their reference streams (the task's test set unless `path`)."""
    task_dir = data_mod.DATA_DIR / task
    if path:
        lines = read_text_lines(path)
        refs = [read_text_lines(r) for r in ref_paths]
        for ref, r in zip(ref_paths, refs):
            if len(r) != len(lines):
                raise UsageError(f"--ref {ref} has {len(r)} lines but the input has {len(lines)}")
    else:
        if not (task_dir / "test.src.gz").exists():
            raise UsageError(f"{task_dir}/test.src.gz not found; rebuild it with python data/build.py")
        lines = data_mod.read_lines(task_dir / "test.src.gz")
        refs = [data_mod.read_lines(task_dir / name) for name in ("test.tgt.gz", "test.tgt2.gz")
                if (task_dir / name).exists()]
    if limit is not None:
        lines, refs = lines[:limit], [r[:limit] for r in refs]
    return lines, refs


def check_fits(run: Run, ids: list, max_len: int | None, max_positions: int, dtype: torch.dtype) -> None:
    """Refuse, before decoding, what this run's models or this machine cannot do: a block size the
    proposal heads were not trained for, and batches (beams counted as rows) that would not fit in
    the memory the machine has available."""
    heads, size = run.models.heads, run.options.get("block_size", 0)
    if heads is not None and size and not 2 <= size <= heads.k:
        raise UsageError(f"--block-size must be between 2 and the {heads.k} the proposal heads were "
                         f"trained for, not {size}")
    free = available_memory()
    if free is None:
        return
    beams, rows = run.options.get("beam_size", 1), run.batch_size
    todo = [s for s in ids if s is not None]
    cfg, itemsize = run.models.model.cfg, torch.empty((), dtype=dtype).element_size()
    need, worst = 0, 0
    for i in range(0, len(todo), rows):
        batch = todo[i:i + rows]
        b = decode_bytes(cfg, len(batch) * beams, max(map(len, batch)) + 1, max_len_for(batch, max_len, max_positions),
                         itemsize)
        if b > need:
            need, worst = b, len(batch)
    if need > 0.8 * free:
        fit = int(0.8 * free / (need / (worst * beams)))
        what = f"--beam-size {beams} with --batch-size {rows}" if beams > 1 else f"--batch-size {rows}"
        advice = (f"use at most {max(fit // worst, 0)} beams" if beams > 1 and fit >= worst
                  else f"use at most {max(fit // beams, 1)} sentences per batch" + (" with one beam" if beams > 1 else ""))
        raise UsageError(f"{run.name}: {what} needs about {need / 2**30:.1f} GiB for its caches and scores, more than "
                         f"the {0.8 * free / 2**30:.1f} GiB (80% of what is free) this machine can give it; {advice}")


def decode_to_output(runs: list[Run], ids: list, tokenizer: Tokenizer, *, output: str | None, max_len: int | None,
                     max_positions: int, device, warmup: int, progress: bool, busy: BusyCores) -> int:
    """Decode every line with every run, writing the first run's outputs as they are finished (one
    line per input line, UTF-8 whatever the locale); returns how many leading lines every run finished."""
    if not output:
        sys.stdout.reconfigure(encoding="utf-8")
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    invalid = {}  # output line -> bytes that are not valid UTF-8

    def render(i: int, tokens) -> str:
        text, dropped = text_line(tokenizer, tokens)
        if dropped:
            invalid[i + 1] = dropped
        return text

    try:
        threads, others_busy = torch.get_num_threads(), busy.others()
        if others_busy is not None and others_busy >= 0.5 and others_busy + threads > usable_cores() + 0.25:
            warn(f"other processes keep about {others_busy:.1f} of this machine's {usable_cores()} cores "
                 f"busy and this run uses {threads} thread(s): timings will not be reliable, and threads that "
                 f"wait for a busy core can make decoding many times slower; run alone, or with --threads 1")
        complete = decode_lines(runs, ids, max_len=max_len, max_positions=max_positions, device=device,
                                warmup=warmup, progress=progress, on_line=OutputLines(out, render).put)
    finally:
        if output:
            out.close()
    if invalid:
        warn(f"{len(invalid)} output line(s) hold bytes that are not valid UTF-8 (the model wrote part of a "
             f"character, shown as U+FFFD, the replacement character): line(s) "
             f"{', '.join(map(str, list(invalid)[:20]))}" + (" ..." if len(invalid) > 20 else ""))
    return complete


def keep_first(runs: list[Run], n: int) -> None:
    """After an interruption: every run's figures cut to the first `n` lines (the ones written)."""
    for r in runs:
        r.outputs, r.traces, r.times, r.calls = r.outputs[:n], r.traces[:n], r.times[:n], r.calls[:n]


@dataclass
class Summary:
    rows: list[dict]  # one per run (summary_row), with speedup and identical rate against the first
    matrix: list[list[float]] | None  # speedup of every run over every other (three runs or more)
    checks: list[dict]  # each lossless run against greedy of its model: identical rate, divergences
    text: str  # the printed form


def summarise(task: str, runs: list[Run], lines: list[str], refs: list, ids: list, tokenizer: Tokenizer,
              device) -> Summary:
    """The table's rows, the speedup matrix, the lossless checks (every line where a lossless run
    differs from greedy of the same model, with the margin there; for GEC at batch size 1 the
    speedup by edit ratio) and the printed text."""
    kind = data_mod.TASKS.get(task)  # None: a Hugging Face folder's text, no task (BLEU and chrF with --ref)
    rows = [{**summary_row(r, scores(kind, lines, texts(tokenizer, r.outputs), refs)), "options": r.options}
            for r in runs]
    for row, r in zip(rows[1:], runs[1:]):
        row["speedup"] = row["seconds"] / rows[0]["seconds"] if rows[0]["seconds"] else float("nan")
        row["identical"] = identical_rate(runs[0].outputs, r.outputs)
    notes, matrix, checks = [], None, []
    if len(runs) > 2:
        matrix, text = speedup_matrix(rows)
        notes.append(text)
    for fast in runs:
        base = min((r for r in runs if r.algo.name == "greedy" and r.models.model is fast.models.model),
                   key=lambda r: r.batch_size, default=None)  # batch-1 greedy where there is one
        if base is None or fast is base or not fast.algo.is_lossless(fast.options):
            continue
        div = divergences(fast.models.model, ids, base.outputs, fast.outputs, device)
        check = {"algo": fast.name, "greedy": base.name, "identical": identical_rate(base.outputs, fast.outputs),
                 "divergences": div}
        notes.append(f"{fast.name} vs {base.name}: {check['identical']:.4f} identical, {len(div)} line(s) differ"
                     + "".join(f"\n  line {d['line']}: first divergence at token {d['position']} "
                               f"(greedy {tokenizer.tokens([d['greedy_token']])[0]!r}, "
                               f"{fast.name} {tokenizer.tokens([d['other_token']])[0]!r}); top-1/top-2 logit "
                               f"margin {d['margin_top1_top2']:.3g}" for d in div))
        if kind == "gec" and fast.batch_size == 1 and base.batch_size == 1:  # how much of the input survives
            check["edit_buckets"], text = edit_buckets(lines, texts(tokenizer, base.outputs), fast, base)
            notes.append(text)
        checks.append(check)
    return Summary(rows, matrix, checks, "\n\n".join([format_table(rows)] + notes))
