"""check_fits: refuse, before decoding, what a run's models or this machine's memory cannot do."""

from __future__ import annotations

import torch

from ...errors import UsageError
from ...machine import available_memory, decode_bytes
from ..inputs import max_len_for, warn
from .buckets import length_chunks
from .record import Run


def check_fits(run: Run, ids: list, max_len: int | None, max_positions: int, dtype: torch.dtype) -> None:
    """Refuse, before decoding, what this run's models or this machine cannot do: a block size the
    proposal heads were not trained for, and batches (beams counted as rows) that would not fit in
    the memory the machine has available. A token budget that would let a batch outgrow that memory
    is cut to one that fits first (fit_budget), with a warning."""
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
    if run.batch_tokens:
        fit_budget(run, int(0.8 * free), max_len, max_positions, itemsize)
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


def budget_bytes(run: Run, tokens: int, max_len: int | None, max_positions: int, itemsize: int) -> tuple[int, int, int]:
    """The most memory a batch within a budget of `tokens` source tokens can need (refdec.machine.decode_bytes,
    beams counted as rows), over every source length S the model takes (1 to max_positions - 1): as many
    rows as the budget allows at that length (tokens // (S + 1), eos included; at least one, as a longer
    sentence is a batch of its own; at most the run's batch size), each with the output budget of such a
    batch (max_len_for). Returns (bytes, rows, S) of the worst. It bounds every batch the run can form,
    whatever the input."""
    cfg, beams = run.models.model.cfg, run.options.get("beam_size", 1)
    worst = (0, 0, 0)
    for s in range(1, max_positions):
        rows = max(tokens // (s + 1), 1)
        if run.batch_size:
            rows = min(rows, run.batch_size)
        b = decode_bytes(cfg, rows * beams, s + 1, max_len_for([[0] * s], max_len, max_positions), itemsize)
        worst = max(worst, (b, rows, s))
    return worst


def fit_budget(run: Run, room: int, max_len: int | None, max_positions: int, itemsize: int) -> None:
    """Where the run's token budget lets a batch need more than `room` bytes (budget_bytes), cut
    Run.batch_tokens to the largest budget that stays within it, and warn once, naming both budgets and
    why: the batches of the budget as given would take the machine's memory (or fail for the lack of it)
    on inputs of the worst length, and larger batches than memory holds make a run no faster. A budget
    that does not fit even with one sentence per batch is left as it is: the check of the batches
    themselves refuses what the input needs."""
    need, rows, length = budget_bytes(run, run.batch_tokens, max_len, max_positions, itemsize)
    if need <= room or budget_bytes(run, 1, max_len, max_positions, itemsize)[0] > room:
        return
    low, high = 1, run.batch_tokens  # budget_bytes grows with the budget: the largest within room
    while low < high:
        mid = (low + high + 1) // 2
        if budget_bytes(run, mid, max_len, max_positions, itemsize)[0] <= room:
            low = mid
        else:
            high = mid - 1
    warn(
        f"{run.name}: a token budget of {run.batch_tokens} lets a batch need about {need / 2**30:.1f} GiB for its "
        f"caches and scores ({rows} sentences of {length} tokens), more than the {room / 2**30:.1f} GiB (80% of "
        f"what is free) this machine can give it; decoding with a budget of {low} tokens, the most that fits"
    )
    run.batch_tokens = low
