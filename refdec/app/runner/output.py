"""The first run's outputs written as they finish: one line per input line, in input order, each whole
and flushed (OutputLines); decode_to_output, the run with its warnings; keep_first, the figures cut
to the lines an interruption left written."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ...interrupt import sigint_deferred, stopped_by
from ...machine import BusyCores, busy_warning, usable_cores
from ...tokenizer import Tokenizer
from ..inputs import warn
from .loop import decode_lines
from .record import Run


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
) -> int:
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
        complete = decode_lines(
            runs,
            ids,
            max_len=max_len,
            max_positions=max_positions,
            device=device,
            warmup=warmup,
            progress=progress,
            on_line=OutputLines(out, render).put,
        )
    finally:
        if output:
            out.close()
    cut = [f"{r.name} {r.stats.hit_max_len} of {r.stats.sentences}" for r in runs if r.stats.hit_max_len]
    if cut:  # e.g. --max-len 1 cuts every output, which would otherwise pass for the model's own
        budget = f"--max-len {max_len}" if max_len else "the default length (2 x the longest source of the batch + 10)"
        warn(f"outputs cut at {budget} before their eos: {', '.join(cut)}; a larger --max-len lets them end")
    if invalid:
        warn(
            f"{len(invalid)} output line(s) hold bytes that are not valid UTF-8 (the model wrote part of a "
            f"character, shown as U+FFFD, the replacement character): line(s) "
            f"{', '.join(map(str, list(invalid)[:20]))}" + (" ..." if len(invalid) > 20 else "")
        )
    return complete


def keep_first(runs: list[Run], n: int, total: int, output: str | None) -> None:
    """After an interruption (Ctrl-C, SIGTERM) that left `n` of `total` lines finished: a warning that
    says so, and every run's figures cut to those lines, which are the lines written."""
    warn(
        f"{stopped_by()[0]} after {n} of {total} input lines: those lines are written"
        + (f" to {output}" if output else "")
        + (
            "; the scores below cover them alone, the times and counts every batch finished (batches are "
            "formed by length, so some of those lines come later in the input)"
            if any(r.batch_size != 1 for r in runs)
            else "; the figures below cover them alone"
        )
    )
    for r in runs:
        r.outputs, r.traces, r.times, r.calls = r.outputs[:n], r.traces[:n], r.times[:n], r.calls[:n]
