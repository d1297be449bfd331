"""What decode.py does between reading its input and reporting: decode every line with every run, the
runs interleaved (`decode_lines`, the timing loop), and write the first run's outputs as they finish.

Timing covers encoding and decoding of each batch (time.perf_counter around the decoder call, read
once the device has finished its work: refdec.machine.clock), after a warm-up on the first sentences
that is not counted. With several runs the runs alternate batch by batch, and which goes first
alternates too, so drift in machine speed hits all of them alike.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import data as data_mod
from .algorithms import Algorithm
from .decoding import DecodeStats
from .errors import UsageError, first_line
from .inputs import max_len_for, warn
from .interrupt import stopped_by
from .loading import Models
from .machine import BusyCores, available_memory, busy_warning, clock, decode_bytes, usable_cores
from .tokenizer import Tokenizer


@dataclass
class Run:
    """One algorithm's outputs and accumulated figures over the whole input."""

    algo: Algorithm
    options: dict
    models: Models
    label: str = ""  # name in tables ("" = the algorithm's name)
    batch_size: int = 1  # most sentences per decoder call (0: no limit, with a token budget)
    trace: bool = False  # keep each sentence's steps
    batch_tokens: int = 0  # most source tokens per decoder call, padding included (0: none)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    traces: list = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)  # per line: seconds of its batch / batch size
    calls: list[int | None] = field(default_factory=list)  # per line: verifier calls of its batch

    @property
    def name(self) -> str:
        return self.label or self.algo.name

    def fits(self, rows: int, longest: int) -> bool:
        """Whether a batch of `rows` sources, the longest `longest` ids, is within this run's limits:
        its batch size, and its token budget counted as the padded source tensor (rows x (longest + 1),
        eos included)."""
        return ((not self.batch_size or rows <= self.batch_size)
                and (not self.batch_tokens or rows * (longest + 1) <= self.batch_tokens))


def make_runs(specs: list, models: list[Models], *, trace: bool = False) -> list[Run]:
    """A Run per refdec.plan RunSpec, on the models refdec.loading.load_models gave it."""
    return [Run(s.algo, s.options, m, s.label, s.batch_size, trace, s.batch_tokens) for s, m in zip(specs, models)]


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
            with sigint_deferred():  # a Ctrl-C or SIGTERM now cannot cut a line in half
                self.stream.write("".join(lines))
                self.stream.flush()


@contextlib.contextmanager
def sigint_deferred():
    """Hold SIGINT and SIGTERM back for the duration (POSIX): they are delivered, as usual, right after."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run_batch(run: Run, batch: list[list[int]], max_len: int, device) -> tuple[list, float, DecodeStats, list | None]:
    cfg = run.models.model.cfg  # an imported model brings its own ids
    src = data_mod.source_tensor(batch, cfg.eos_id, cfg.pad_id).to(device)
    t0 = clock(src.device)
    res = run.algo.run(run.models, src, max_len, run.options, trace=run.trace)
    seconds = clock(src.device) - t0  # the device's work done, not only launched
    return [t.cpu() for t in res.tokens], seconds, res.stats, res.trace


WARMUP_ROWS = 16  # a warm-up batch holds at most this many sentences, whatever --batch-size


def cut(order: list[int], ids: list[list[int]], fits: Callable[[int, int], bool]) -> list[list[int]]:
    """`order` (line indices) cut into consecutive batches, each as long as `fits(rows, longest)` allows
    (at least one line)."""
    out, batch, longest = [], [], 0
    for i in order:
        if batch and not fits(len(batch) + 1, max(longest, len(ids[i]))):
            out.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, len(ids[i]))
    return out + [batch] if batch else out


def length_chunks(ids: list[list[int] | None], runs: list[Run]) -> list[list[int]]:
    """The indices of the non-empty lines in chunks, each large enough for one batch of every run: in
    input order when every run decodes one sentence at a time, else sorted by source length (stable)
    so that each chunk holds neighbours in length, and a batch does not wait, in calls and in padded
    width, on one long row. Outputs go back to their lines by index."""
    todo = [i for i, s in enumerate(ids) if s is not None]
    if any(run.batch_size != 1 for run in runs):
        todo.sort(key=lambda i: len(ids[i]))
    return cut(todo, ids, lambda rows, longest: any(run.fits(rows, longest) for run in runs))


def batches(run: Run, chunk: list[int], ids: list[list[int]]) -> list[list[int]]:
    """A chunk's lines in this run's batches."""
    return cut(chunk, ids, run.fits)


def decode_lines(runs: list[Run], ids: list[list[int] | None], *,
                 max_len: int | None, max_positions: int, device, warmup: int = 2, progress: bool = True,
                 on_line: Callable[[int, torch.Tensor | None], None] | None = None) -> int:
    """The interleaved timing loop: fill each run's outputs, seconds, stats and per-line times, the
    runs alternating chunk by chunk (and which goes first alternating too), after `warmup` untimed
    chunks. Any tool that times decoders against each other on the same lines calls this: decode.py,
    and refdec.hf's audit, whose transformers decoder is a Run like any other (an Algorithm wraps any
    `decoder(model, src, *, max_len, trace, **options) -> DecodeResult`). `ids`: each line's source
    ids, None for an empty line (its output stays None).

    With batches of more than one sentence the lines are bucketed by source length (`length_chunks`).
    A chunk holds the largest batch of any run; each run decodes it in batches of its own (Run.batch_size
    sentences, or as many as Run.batch_tokens allows), with the one output budget of the chunk (max_len_for its
    sources), so that runs at different batch sizes decode each line alike. A chunk counts once
    every run has decoded it: only then are its figures added and its lines (the first run's) passed
    to `on_line`, in input order with the empty lines between them, as soon as every earlier line is
    done. Ctrl-C stops at that boundary. Returns how many leading input lines every run finished
    (all of them unless interrupted)."""
    chunks = length_chunks(ids, runs)
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
            with sigint_deferred():  # the line written and counted together: a Ctrl-C or SIGTERM falls before or after both
                if on_line is not None:
                    on_line(complete, runs[0].outputs[complete])
                complete += 1

    try:
        for c in chunks[:warmup]:  # warm-up: allocator, MKL kernels, caches; not timed, not kept
            for run in runs:
                rows = [ids[i] for i in batches(run, c, ids)[0][:WARMUP_ROWS]]
                run_batch(run, rows, max_len_for(rows, max_len, max_positions), device)
        t_start, last_print, finished = time.time(), time.time(), 0
        for n, c in enumerate(chunks):
            budget = max_len_for([ids[i] for i in c], max_len, max_positions)
            order = runs if n % 2 == 0 else runs[::-1]
            results = {}
            for run in order:
                for b in batches(run, c, ids):
                    try:
                        results[(id(run), b[0])] = b, run_batch(run, [ids[i] for i in b], budget, device)
                    except (RuntimeError, ValueError) as e:  # one bad batch must not lose the others
                        warn(f"{run.algo.name} failed on input line(s) {', '.join(str(i + 1) for i in b)}: "
                             f"{first_line(e, 200)}; writing empty output line(s) in their place")
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
    beams = run.options.get("beam_size", 1)
    cfg, itemsize = run.models.model.cfg, torch.empty((), dtype=dtype).element_size()
    need, worst = 0, 0
    for c in length_chunks(ids, [run]):
        batch = [ids[i] for i in c]
        b = decode_bytes(cfg, len(batch) * beams, max(map(len, batch)) + 1, max_len_for(batch, max_len, max_positions),
                         itemsize)
        if b > need:
            need, worst = b, len(batch)
    if need > 0.8 * free:
        fit = int(0.8 * free / (need / (worst * beams)))
        size = f"batches of {worst} sentences" if run.batch_tokens else f"batch size {run.batch_size}"
        what = f"beam size {beams} at {size}" if beams > 1 else size
        advice = (f"use at most {max(fit // worst, 0)} beams" if beams > 1 and fit >= worst
                  else f"use a token budget of at most {max(int(run.batch_tokens * 0.8 * free / need), 1)}"
                  if run.batch_tokens and beams == 1
                  else f"use at most {max(fit // beams, 1)} sentences per batch" + (" with one beam" if beams > 1 else ""))
        raise UsageError(f"{run.name}: {what} needs about {need / 2**30:.1f} GiB for its caches and scores, more than "
                         f"the {0.8 * free / 2**30:.1f} GiB (80% of what is free) this machine can give it; {advice}")


def decode_to_output(runs: list[Run], ids: list, tokenizer: Tokenizer, *, output: str | None, max_len: int | None,
                     max_positions: int, device, warmup: int, progress: bool, busy: BusyCores) -> int:
    """Decode every line with every run, writing the first run's outputs as they are finished (one
    line per input line, UTF-8 whatever the locale); returns how many leading lines every run finished.
    Warns first if other processes keep the cores this run's threads need busy (`busy`: started with
    the run, so that it has seen the machine while the models loaded)."""
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
        busy_now = busy_warning(busy.others(), torch.get_num_threads(), usable_cores(), "keep")
        if busy_now:  # measured since the run started (at least MIN_WINDOW seconds), before any decoding
            warn(busy_now)
        complete = decode_lines(runs, ids, max_len=max_len, max_positions=max_positions, device=device,
                                warmup=warmup, progress=progress, on_line=OutputLines(out, render).put)
    finally:
        if output:
            out.close()
    cut = [f"{r.name} {r.stats.hit_max_len} of {r.stats.sentences}" for r in runs if r.stats.hit_max_len]
    if cut:  # e.g. --max-len 1 cuts every output, which would otherwise pass for the model's own
        budget = f"--max-len {max_len}" if max_len else "the default length (2 x the longest source of the batch + 10)"
        warn(f"outputs cut at {budget} before their eos: {', '.join(cut)}; a larger --max-len lets them end")
    if invalid:
        warn(f"{len(invalid)} output line(s) hold bytes that are not valid UTF-8 (the model wrote part of a "
             f"character, shown as U+FFFD, the replacement character): line(s) "
             f"{', '.join(map(str, list(invalid)[:20]))}" + (" ..." if len(invalid) > 20 else ""))
    return complete


def keep_first(runs: list[Run], n: int, total: int, output: str | None) -> None:
    """After an interruption (Ctrl-C, SIGTERM) that left `n` of `total` lines finished: a warning that
    says so, and every run's figures cut to those lines, which are the lines written."""
    warn(f"{stopped_by()[0]} after {n} of {total} input lines: those lines are written"
         + (f" to {output}" if output else "")
         + ("; the scores below cover them alone, the times and counts every batch finished (batches are "
            "formed by length, so some of those lines come later in the input)"
            if any(r.batch_size != 1 for r in runs) else "; the figures below cover them alone"))
    for r in runs:
        r.outputs, r.traces, r.times, r.calls = r.outputs[:n], r.traces[:n], r.times[:n], r.calls[:n]
