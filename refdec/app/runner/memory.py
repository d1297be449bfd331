"""check_fits: refuse, before decoding, what a run's models or this machine's memory cannot do."""

from __future__ import annotations

import torch

from ...errors import UsageError
from ...machine import available_memory, decode_bytes
from ..inputs import max_len_for
from .buckets import length_chunks
from .record import Run


def check_fits(run: Run, ids: list, max_len: int | None, max_positions: int, dtype: torch.dtype) -> None:
    """Refuse, before decoding, what this run's models or this machine cannot do: a block size the
    proposal heads were not trained for, and batches (beams counted as rows) that would not fit in
    the memory the machine has available."""
    heads, size = run.models.heads, run.options.get("block_size", 0)
    if heads is not None and size and not 2 <= size <= heads.k:
        raise UsageError(
            f"--block-size must be between 2 and the {heads.k} the proposal heads were trained for, not {size}"
        )
    free = available_memory()
    if free is None:
        return
    beams = run.options.get("beam_size", 1)
    cfg, itemsize = run.models.model.cfg, torch.empty((), dtype=dtype).element_size()
    need, worst = 0, 0
    for c in length_chunks(ids, [run]):
        batch = [ids[i] for i in c]
        b = decode_bytes(
            cfg, len(batch) * beams, max(map(len, batch)) + 1, max_len_for(batch, max_len, max_positions), itemsize
        )
        if b > need:
            need, worst = b, len(batch)
    if need > 0.8 * free:
        fit = int(0.8 * free / (need / (worst * beams)))
        size = f"batches of {worst} sentences" if run.batch_tokens else f"batch size {run.batch_size}"
        what = f"beam size {beams} at {size}" if beams > 1 else size
        advice = (
            f"use at most {max(fit // worst, 0)} beams"
            if beams > 1 and fit >= worst
            else f"use a token budget of at most {max(int(run.batch_tokens * 0.8 * free / need), 1)}"
            if run.batch_tokens and beams == 1
            else f"use at most {max(fit // beams, 1)} sentences per batch" + (" with one beam" if beams > 1 else "")
        )
        raise UsageError(
            f"{run.name}: {what} needs about {need / 2**30:.1f} GiB for its caches and scores, more than "
            f"the {0.8 * free / 2**30:.1f} GiB (80% of what is free) this machine can give it; {advice}"
        )
