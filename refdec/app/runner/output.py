"""The first run's outputs written as they finish: one line per input line, in input order, each whole
and flushed (OutputLines); decode_to_output, the run with its warnings; keep_first, the figures cut
to the lines an interruption left written."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ...interrupt import sigint_deferred
from ...machine import BusyCores, busy_warning, usable_cores
from ...tokenizer import Tokenizer
from ..inputs import warn
from ..resume import Records
from .buckets import windows
from .job import Job
from .loop import decode_lines
from .record import Run


class OutputLines:
    """Output lines written in input order as soon as every earlier line is done, each whole and
    flushed: an interrupted or killed run keeps every line it finished. `start`: the first line to write
    (a resumed run's output holds the lines before it); `known`: later lines an earlier run finished,
    written, as they are reached, in place of a new output."""

    def __init__(
        self, stream, render: Callable[[int, torch.Tensor | None], str], start: int = 0, known: dict | None = None
    ):
        self.stream, self.render = stream, render
        self.next, self.ready = start, {i: t for i, t in (known or {}).items() if i >= start}
        self.put(None, None)  # the known lines at the start

    def put(self, index: int | None, tokens: torch.Tensor | None) -> None:
        if index is not None and index >= self.next and index not in self.ready:
            self.ready[index] = self.render(index, tokens)
        lines = []
        while self.next in self.ready:
            lines.append(self.ready.pop(self.next) + "\n")
            self.next += 1
        if lines:
            with sigint_deferred():  # a Ctrl-C or SIGTERM now cannot cut a line in half
                self.stream.write("".join(lines))
                self.stream.flush()


class PartialLines:
    """Under torchrun: each finished line's text appended to this process's partial file
    (refdec.app.resume.Records), merged into the output once every process is done."""

    def __init__(self, path, render: Callable[[int, torch.Tensor | None], str]):
        self.records, self.render = Records(path), render

    def put(self, index: int, tokens: torch.Tensor | None) -> None:
        text = self.render(index, tokens)
        with sigint_deferred():
            self.records.put(index, text)


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


def decode_to_output(
    runs: list[Run],
    ids: list,
    tokenizer: Tokenizer,
    *,
    output: str | None,
    max_len: int | None,
    max_positions: int,
    device,
    warmup: int,
    progress: bool,
    busy: BusyCores,
    window: int = 0,
    job: Job | None = None,
) -> tuple[list[int], bool]:
    """Decode every line with every run, writing the first run's outputs as they are finished (one
    line per input line, UTF-8 whatever the locale); returns the lines this run finished and wrote, in
    input order, and whether they are all it had to do (False: interrupted).
    Warns first if other processes keep the cores this run's threads need busy (`busy`: started with
    the run, so that it has seen the machine while the models loaded). `job` (refdec.app.runner.job): the
    --output file's job, whose lines already done are not decoded again (only the windows that hold a line
    not done are decoded, each whole, so that every batch is the one an uninterrupted run makes); under
    torchrun (job.world > 1) this process decodes every job.world-th of those windows into its partial file."""
    if not output:
        sys.stdout.reconfigure(encoding="utf-8")
    invalid = {}  # output line -> bytes that are not valid UTF-8

    def render(i: int, tokens) -> str:
        text, dropped = text_line(tokenizer, tokens)
        if dropped:
            invalid[i + 1] = dropped
        return text

    todo = None
    if job is not None:
        done = job.done(len(ids))
        left = [w for w in windows(len(ids), window) if any(i not in done for i in w)]
        todo = {i for w in left[job.rank :: job.world] for i in w if i not in done}
    if job is not None and job.world > 1:
        out, writer = None, PartialLines(job.partial, render)
    else:
        out = open(output, "a" if job else "w", encoding="utf-8") if output else sys.stdout
        writer = OutputLines(out, render, job.start if job else 0, job.known if job else None)
    try:
        busy_now = busy_warning(busy.others(), torch.get_num_threads(), usable_cores(), "keep")
        # measured since the run started (at least MIN_WINDOW seconds), before any decoding; under torchrun
        # the other processes are this run's own
        if busy_now and not (job and job.world > 1):
            warn(busy_now)
        handed = decode_lines(
            runs,
            ids,
            max_len=max_len,
            max_positions=max_positions,
            device=device,
            warmup=warmup,
            progress=progress,
            on_line=writer.put,
            window=window,
            todo=todo,
            writing_to=(str(job.partial) if job.world > 1 else output) if job else output or "standard output",
        )
    finally:
        if out is not None and output:
            out.close()
    cut = [f"{r.name} {r.stats.hit_max_len} of {r.stats.sentences}" for r in runs if r.stats.hit_max_len]
    if cut:  # e.g. --max-len 1 cuts every output, which would otherwise pass for the model's own
        budget = f"--max-len {max_len}" if max_len else "the default length (2 x the sentence's source + 10)"
        warn(f"outputs cut at {budget} before their eos: {', '.join(cut)}; a larger --max-len lets them end")
    if invalid:
        warn(
            f"{len(invalid)} output line(s) hold bytes that are not valid UTF-8 (the model wrote part of a "
            f"character, shown as U+FFFD, the replacement character): line(s) "
            f"{', '.join(map(str, list(invalid)[:20]))}" + (" ..." if len(invalid) > 20 else "")
        )
    order = sorted(todo) if todo is not None else list(range(len(ids)))
    return order[:handed], handed == len(order)


def keep_lines_of(runs: list[Run], lines: list[int]) -> None:
    """Every run's per-line figures cut to `lines` (indices into the input), in that order."""
    for r in runs:
        r.outputs, r.traces, r.times, r.calls = (
            [r.outputs[i] for i in lines],
            [r.traces[i] for i in lines],
            [r.times[i] for i in lines],
            [r.calls[i] for i in lines],
        )
