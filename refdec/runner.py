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
from typing import Callable

import torch

from . import data as data_mod
from .decoding import ALGORITHMS, Algorithm, DecodeStats
from .metrics import corpus_bleu, corpus_chrf, gec_scores
from .tokenizer import Tokenizer


class UsageError(Exception):
    """Bad input or options: decode.py prints the message on one line and exits non-zero."""


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

    algo: Algorithm
    knobs: dict
    models: dict | None = None  # role -> model for this run (None: decode_lines' models)
    label: str = ""  # name in tables ("" = the algorithm's name)
    batch_size: int | None = None  # sentences per decoder call (None = decode_lines' batch_size)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    traces: list = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)  # per line: seconds of its batch / batch size
    calls: list[int | None] = field(default_factory=list)  # per line: verifier calls of its batch

    @property
    def name(self) -> str:
        return self.label or self.algo.name

    def models_of(self, default: dict) -> dict:
        return self.models or default


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


def run_batch(run: Run, models: dict, batch: list[list[int]], max_len: int, device) -> tuple[list, float, DecodeStats, list | None]:
    models = run.models or models
    cfg = models["model"].cfg if "model" in models else None  # an imported model brings its own ids
    src = (data_mod.source_tensor(batch, cfg.eos_id, cfg.pad_id) if cfg else data_mod.source_tensor(batch)).to(device)
    t0 = time.perf_counter()
    res = run.algo.run(models, src, max_len, run.knobs)
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


def decode_lines(runs: list[Run], models: dict, ids: list[list[int] | None], *, batch_size: int,
                 max_len: int | None, max_positions: int, device, warmup: int = 2, progress: bool = True,
                 on_line: Callable[[int, torch.Tensor | None], None] | None = None) -> int:
    """Fill each run's outputs, seconds and stats; runs alternate chunk by chunk (interleaved timing).

    With batches of more than one sentence the lines are bucketed by source length (`length_chunks`).
    A chunk holds the largest batch of any run; each run decodes it in batches of its own size
    (Run.batch_size, else `batch_size`), with the one output budget of the chunk (max_len_for its
    sources), so that runs at different batch sizes decode each line alike. A chunk counts once
    every run has decoded it: only then are its figures added and its lines (the first run's) passed
    to `on_line`, in input order with the empty lines between them, as soon as every earlier line is
    done. Ctrl-C stops at that boundary. Returns how many leading input lines every run finished
    (all of them unless interrupted)."""
    size = max(run.batch_size or batch_size for run in runs)
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
                rows = [ids[i] for i in c[:min(run.batch_size or batch_size, WARMUP_ROWS)]]
                run_batch(run, models, rows, max_len_for(rows, max_len, max_positions), device)
        t_start, last_print, finished = time.time(), time.time(), 0
        for n, c in enumerate(chunks):
            budget = max_len_for([ids[i] for i in c], max_len, max_positions)
            order = runs if n % 2 == 0 else runs[::-1]
            results = {}
            for run in order:
                step = run.batch_size or batch_size
                for b in (c[i:i + step] for i in range(0, len(c), step)):
                    try:
                        results[(id(run), b[0])] = b, run_batch(run, models, [ids[i] for i in b], budget, device)
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


def build_report(task: str, rows: list[dict], knobs: list[dict], algos: list[Algorithm], *, n_lines: int,
                 extra: dict) -> dict:
    """The JSON report: the first run's figures at the top level, the --compare run under "compare"."""
    first = rows[0]
    keys = ("seconds", "tokens", "ms_per_token", "verifier_calls", "drafter_calls", "tokens_per_call", "hit_max_len")
    report = {"algo": algos[0].name, "task": task, "n": n_lines, "decoded": first["n"],
              **{k: first[k] for k in keys}, "bleu": first.get("bleu"), "chrf": first.get("chrf"),
              **{k: first[k] for k in ("gec_f05", "gec_precision", "gec_recall") if k in first},
              "options": {k: v for k, v in knobs[0].items() if k in algos[0].knobs}, **extra}
    if len(rows) > 1:
        second = rows[1]
        report["compare"] = {"algo": algos[1].name, "seconds": second["seconds"], "speedup": second["speedup"],
                             "identical": second["identical"], "bleu": second.get("bleu"), "chrf": second.get("chrf"),
                             "tokens": second["tokens"], "verifier_calls": second["verifier_calls"],
                             **{k: second[k] for k in ("gec_f05",) if k in second},
                             "options": {k: v for k, v in knobs[1].items() if k in algos[1].knobs}}
    return report


def write_report(path: str, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["ALGORITHMS", "Run", "UsageError", "decode_lines", "format_table", "identical_rate", "read_text_lines",
           "scores", "source_ids", "summary_row", "texts", "warn", "build_report", "write_report", "environment"]
