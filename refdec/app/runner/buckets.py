"""The lines in chunks and batches of neighbours in length, by the one length bucketer of refdec.data
(cut_batches): a chunk large enough for one batch of every run, and each run's batches in it."""

from __future__ import annotations

from ...data import cut_batches
from .record import Run


def length_chunks(ids: list[list[int] | None], runs: list[Run]) -> list[list[int]]:
    """The indices of the non-empty lines in chunks, each large enough for one batch of every run: in
    input order when every run decodes one sentence at a time, else sorted by source length (stable)
    so that each chunk holds neighbours in length, and a batch does not wait, in calls and in padded
    width, on one long row. Outputs go back to their lines by index."""
    todo = [i for i, s in enumerate(ids) if s is not None]
    if any(run.batch_size != 1 for run in runs):
        todo.sort(key=lambda i: len(ids[i]))
    return cut_batches(
        todo, lambda i: (len(ids[i]),), lambda rows, longest: any(run.fits(rows, *longest) for run in runs)
    )


def batches(run: Run, chunk: list[int], ids: list[list[int]]) -> list[list[int]]:
    """A chunk's lines in this run's batches."""
    return cut_batches(chunk, lambda i: (len(ids[i]),), lambda rows, longest: run.fits(rows, *longest))
