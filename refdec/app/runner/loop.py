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
from ...machine import clock
from ..inputs import max_len_for, warn
from .buckets import batches, length_chunks
from .record import Run


def run_batch(run: Run, batch: list[list[int]], max_len: int, device) -> tuple[list, float, DecodeStats, list | None]:
    cfg = run.models.model.cfg  # an imported model brings its own ids
    src = data_mod.source_tensor(batch, cfg.eos_id, cfg.pad_id).to(device)
    t0 = clock(src.device)
    res = run.algo.run(run.models, src, max_len, run.options, trace=run.trace)
    seconds = clock(src.device) - t0  # the device's work done, not only launched
    return [t.cpu() for t in res.tokens], seconds, res.stats, res.trace


def tried_batch(run: Run, b: list[int], ids: list, budget: int, device, warm_up: bool = False) -> tuple | None:
    """run_batch on input lines `b`, or None after a warning naming the run and the lines when the decoder
    fails on them: one bad batch must not lose the others, in the warm-up as in the timed loop (where the
    lines then stay empty; a warm-up's lines are decoded again, timed)."""
    try:
        return run_batch(run, [ids[i] for i in b], budget, device)
    except (RuntimeError, ValueError) as e:
        after = "; the timed run decodes them again" if warm_up else "; writing empty output line(s) in their place"
        warn(
            f"{run.algo.name} failed on input line(s) {', '.join(str(i + 1) for i in b)}"
            f"{' in the warm-up' if warm_up else ''}: {first_line(e, 200)}{after}"
        )
        return None


WARMUP_ROWS = 16  # a warm-up batch holds at most this many sentences, whatever --batch-size


def warm_up(
    runs: list[Run], chunks: list[list[int]], ids: list, max_len: int | None, max_positions: int, device, whole: bool
) -> None:
    """Decode `chunks` with every run, untimed and not kept (the allocator, the kernels, the caches warm):
    the first rows of each chunk's first batch, or with `whole` every batch of the chunk, with the
    chunk's budget, so that the timed loop meets no shape the warm-up did not."""
    for c in chunks:
        for run in runs:
            if whole:
                budget = max_len_for([ids[i] for i in c], max_len, max_positions)
                warm = batches(run, c, ids)
            else:
                warm = [batches(run, c, ids)[0][:WARMUP_ROWS]]
                budget = max_len_for([ids[i] for i in warm[0]], max_len, max_positions)
            for b in warm:
                tried_batch(run, b, ids, budget, device, warm_up=True)


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
) -> int:
    """The interleaved timing loop: fill each run's outputs, seconds, stats and per-line times, the
    runs alternating chunk by chunk (and which goes first alternating too), after `warmup` untimed
    chunks. Any tool that times decoders against each other on the same lines calls this: decode.py,
    and refdec.hf's audit, whose transformers decoder is a Run like any other (an Algorithm wraps any
    `decoder(model, src, *, max_len, trace, **options) -> DecodeResult`). `ids`: each line's source
    ids, None for an empty line (its output stays None). `warm_all`: the warm-up decodes every batch
    of every chunk once, whole, instead (a route that prepares something per shape, as the graphed
    route captures a CUDA graph, then meets every shape of the timed runs before they start).

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
            with (
                sigint_deferred()
            ):  # the line written and counted together: a Ctrl-C or SIGTERM falls before or after both
                if on_line is not None:
                    on_line(complete, runs[0].outputs[complete])
                complete += 1

    try:
        warm_up(runs, chunks if warm_all else chunks[:warmup], ids, max_len, max_positions, device, warm_all)
        t_start, last_print, finished = time.time(), time.time(), 0
        for n, c in enumerate(chunks):
            budget = max_len_for([ids[i] for i in c], max_len, max_positions)
            order = runs if n % 2 == 0 else runs[::-1]
            results = {}
            for run in order:
                for b in batches(run, c, ids):
                    if (result := tried_batch(run, b, ids, budget, device)) is not None:
                        results[(id(run), b[0])] = b, result
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
                print(
                    f"  {finished}/{total} sentences, {rate:.1f}/s, ETA {(total - finished) / rate:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
                last_print = now
        advance()
    except KeyboardInterrupt:
        pass
    return complete
