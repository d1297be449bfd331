"""decode_lines, the interleaved timing loop: every line decoded by every run, the runs alternating
chunk by chunk after an untimed warm-up; run_batch, one timed decoder call."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from ... import data as data_mod
from ...decoding import DecodeStats
from ...errors import first_line
from ...interrupt import sigint_deferred
from ...progress import duration
from ...timing import clock
from ..inputs import max_len_for, warn
from .buckets import batches, length_chunks
from .record import Run


def cut_to_budgets(
    tokens: list[torch.Tensor], stats: DecodeStats, called: int, budgets: list[int]
) -> list[torch.Tensor]:
    """Each row of a batch decoded with budget `called` (its largest line's) cut to its own line's
    budget, as if decoded with that budget alone (Run.cuts_to_budget), with the stats' token and
    max-length counts made so. A row's tokens come without their final eos: a row shorter than `called`
    ended with one."""
    out = []
    for t, budget in zip(tokens, budgets):
        ended = len(t) < called
        if len(t) + ended > budget:  # it ran past its own budget: stopped there, before any eos
            stats.tokens -= len(t) + ended - budget
            stats.hit_max_len += ended
            t = t[:budget]
        out.append(t)
    return out


def run_batch(
    run: Run, batch: list[list[int]], max_len: int | list[int], device
) -> tuple[list, float, DecodeStats, list | None]:
    """One timed decoder call on `batch` (source ids); `max_len`: the output budget, one for the batch
    or one per row (the call then decodes to the largest and cuts each row to its own, which only a run
    that cuts_to_budget may take with budgets that differ)."""
    budgets = max_len if isinstance(max_len, list) else [max_len] * len(batch)
    cfg = run.models.model.cfg  # an imported model brings its own ids
    src = data_mod.source_tensor(batch, cfg.eos_id, cfg.pad_id).to(device)
    t0 = clock(src.device)
    res = run.algo.run(run.models, src, max(budgets), run.options, trace=run.trace)
    seconds = clock(src.device) - t0  # the device's work done, not only launched
    tokens = [t.cpu() for t in res.tokens]
    if min(budgets) < max(budgets):
        tokens = cut_to_budgets(tokens, res.stats, max(budgets), budgets)
    return tokens, seconds, res.stats, res.trace


def tried_batch(run: Run, b: list[int], ids: list, budgets: list[int], device, warm_up: bool = False) -> tuple | None:
    """run_batch on input lines `b` (`budgets`: every input line's output budget), or None after a
    warning naming the run and the lines when the decoder fails on them: one bad batch must not lose the
    others, in the warm-up as in the timed loop (where the lines then stay empty; a warm-up's lines are
    decoded again, timed)."""
    try:
        return run_batch(run, [ids[i] for i in b], [budgets[i] for i in b], device)
    except (RuntimeError, ValueError) as e:
        after = "; the timed run decodes them again" if warm_up else "; writing empty output line(s) in their place"
        warn(
            f"{run.algo.name} failed on input line(s) {', '.join(str(i + 1) for i in b)}"
            f"{' in the warm-up' if warm_up else ''}: {first_line(e, 200)}{after}"
        )
        return None


WARMUP_ROWS = 16  # a warm-up batch holds at most this many sentences, whatever --batch-size


def warm_up(runs: list[Run], chunks: list[list[int]], ids: list, budgets: list, device, whole: bool) -> None:
    """Decode `chunks` with every run, untimed and not kept (the allocator, the kernels, the caches warm):
    the first rows of each chunk's first batch, or with `whole` every batch of the chunk, so that the
    timed loop meets no shape the warm-up did not."""
    for c in chunks:
        for run in runs:
            warm = batches(run, c, ids, budgets)
            for b in warm if whole else [warm[0][:WARMUP_ROWS]]:
                tried_batch(run, b, ids, budgets, device, warm_up=True)


def add_up(runs: list[Run], results: dict) -> None:
    """A chunk's batch results ((id of the run, first line) -> (lines, run_batch's result)) added to each
    run's outputs, traces, per-line times and calls, seconds and stats."""
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


class Pace:
    """The progress line of long work, at most every 5 s: sentences done, their rate, and an ETA from the
    source tokens left (a long sentence costs more than a short one, and the short ones of a window come
    first), naming where the outputs go."""

    def __init__(self, chunks: list[list[int]], ids: list, writing_to: str | None = None):
        self.sentences, self.writing_to = sum(map(len, chunks)), writing_to
        self.tokens = sum(len(ids[i]) + 1 for c in chunks for i in c)  # source tokens to encode, eos included
        self.ids, self.done, self.tokens_done = ids, 0, 0
        self.start = self.last = time.time()

    def update(self, chunk: list[int], last: bool) -> None:
        self.done += len(chunk)
        self.tokens_done += sum(len(self.ids[i]) + 1 for i in chunk)
        now = time.time()
        if not self.sentences or last or now - self.last <= 5:
            return
        elapsed = now - self.start
        eta = elapsed * (self.tokens - self.tokens_done) / self.tokens_done
        print(
            f"  {self.done}/{self.sentences} sentences, {self.done / elapsed:.1f}/s, ETA {duration(eta)}"
            + (f", writing {self.writing_to}" if self.writing_to else ""),
            file=sys.stderr,
            flush=True,
        )
        self.last = now


def decode_lines(
    runs: list[Run],
    ids: list[list[int] | None],
    *,
    max_len: int | None,
    max_positions: int,
    device,
    warmup: int = 2,
    warm_all: bool = False,
    progress: bool = True,
    on_line: Callable[[int, torch.Tensor | None], None] | None = None,
    window: int = 0,
    todo: set[int] | None = None,
    writing_to: str | None = None,
) -> int:
    """The interleaved timing loop: fill each run's outputs, seconds, stats and per-line times, the
    runs alternating chunk by chunk (and which goes first alternating too), after `warmup` untimed
    chunks. Any tool that times decoders against each other on the same lines calls this: decode.py,
    and refdec.hf's audit, whose transformers decoder is a Run like any other (an Algorithm wraps any
    `decoder(model, src, *, max_len, trace, **options) -> DecodeResult`). `ids`: each line's source
    ids, None for an empty line (its output stays None). `warm_all`: the warm-up decodes every batch
    of every chunk once, whole, instead (a route that prepares something per shape, as the graphed
    route captures a CUDA graph, then meets every shape of the timed runs before they start).

    With batches of more than one sentence the lines are bucketed by source length within windows of
    `window` input lines (0: the whole input; refdec.app.runner.buckets). A chunk holds the largest batch
    of any run; each run decodes it in batches of its own (Run.batch_size sentences, or as many as
    Run.batch_tokens allows). Every line has its own output budget (max_len, else max_len_for its own
    source), so no grouping of lines (batch size, token budget, window, processes) changes an output.

    `todo`: the input lines to hand over (all of them when None); only the windows that hold one are
    decoded, each whole. A chunk counts once every run has decoded it: only then are its figures added
    and its lines of `todo` (the first run's outputs) passed to `on_line`, in input order with the empty
    lines between them, as soon as every earlier line of `todo` is done. Ctrl-C stops at that boundary.
    Progress (every 5 s on long work) gives an ETA from the source tokens left and names `writing_to`.
    Returns how many of the `todo` lines, in input order, were handed over (all of them unless
    interrupted)."""
    order = sorted(todo) if todo is not None else list(range(len(ids)))
    chunks = length_chunks(ids, runs, window, set(order) if todo is not None else None)
    budgets = [None if s is None else max_len_for([s], max_len, max_positions) for s in ids]
    for run in runs:
        run.outputs = [None] * len(ids)
        run.traces = [None] * len(ids)
        run.times = [None] * len(ids)
        run.calls = [None] * len(ids)
    done = [s is None for s in ids]
    handed = 0  # order[0 .. handed-1] are done by every run and handed over

    def advance() -> None:  # hand over every line of `order` up to the first one not done, the empty ones too
        nonlocal handed
        while handed < len(order) and done[order[handed]]:
            # the line written and counted together: a Ctrl-C or SIGTERM falls before or after both
            with sigint_deferred():
                if on_line is not None:
                    on_line(order[handed], runs[0].outputs[order[handed]])
                handed += 1

    try:
        advance()  # the empty lines before the first sentence
        warm_up(runs, chunks if warm_all else chunks[:warmup], ids, budgets, device, warm_all)
        pace = Pace(chunks, ids, writing_to) if progress else Pace([], ids)
        for n, c in enumerate(chunks):
            order_runs = runs if n % 2 == 0 else runs[::-1]
            results = {}
            for run in order_runs:
                for b in batches(run, c, ids, budgets):
                    if (result := tried_batch(run, b, ids, budgets, device)) is not None:
                        results[(id(run), b[0])] = b, result
            add_up(runs, results)
            for i in c:
                done[i] = True
            advance()
            pace.update(c, last=n == len(chunks) - 1)
        advance()
    except KeyboardInterrupt:
        pass
    return handed
