"""The lines in windows, chunks and batches: a window of input lines is sorted by source length and cut
into chunks, each large enough for one batch of every run, and each run cuts a chunk into its batches,
by the one length bucketer of refdec.data (cut_batches).

The window bounds the reordering (as Marian's --maxi-batch and fairseq's --buffer-size do): lines are
sorted only among the `window` input lines around them, so the outputs stream out in input order a
window at a time, a stopped run is never more than one window behind what it decoded, and which
sentences share a batch depends on the window's lines alone, never on where a run started or stopped.
"""

from __future__ import annotations

from itertools import groupby

from ...data import cut_batches
from .record import Run


def windows(n: int, window: int) -> list[range]:
    """Input lines 0 .. n-1 in consecutive windows of `window` lines (one window of all for 0)."""
    size = window if window > 0 else max(n, 1)
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def length_chunks(
    ids: list[list[int] | None], runs: list[Run], window: int = 0, todo: set[int] | None = None
) -> list[list[int]]:
    """The indices of the non-empty lines in chunks, each large enough for one batch of every run,
    window by window (`windows`; only the windows that hold a line of `todo`, when given, and each of
    those whole, so that its batches are the ones an uninterrupted run makes). Within a window the lines
    are in input order when every run decodes one sentence at a time, else sorted by source length
    (stable) so that each chunk holds neighbours in length, and a batch does not wait, in calls and in
    padded width, on one long row. Outputs go back to their lines by index."""
    chunks = []
    for lines in windows(len(ids), window):
        if todo is not None and not any(i in todo for i in lines):
            continue
        rows = [i for i in lines if ids[i] is not None]
        if any(run.batch_size != 1 for run in runs):
            rows.sort(key=lambda i: len(ids[i]))
        chunks += cut_batches(
            rows, lambda i: (len(ids[i]),), lambda n, longest: any(run.fits(n, *longest) for run in runs)
        )
    return chunks


def batches(run: Run, chunk: list[int], ids: list[list[int]], budgets: list[int] | None = None) -> list[list[int]]:
    """A chunk's lines in this run's batches. With `budgets` (each line's output budget) and a run that
    cannot cut a longer output to a line's own budget (Run.cuts_to_budget), a batch holds lines of one
    budget only, so that every line is decoded with its own."""
    if budgets is None or run.cuts_to_budget:
        groups = [chunk]
    else:
        groups = [list(g) for _, g in groupby(chunk, key=lambda i: budgets[i])]
    return [
        b
        for group in groups
        for b in cut_batches(group, lambda i: (len(ids[i]),), lambda rows, longest: run.fits(rows, *longest))
    ]
