"""How refdec reads the time of a piece of work: every measuring command (refdec.commands: stepcost,
machine, int8bench, ctranslate2, ceiling, bench, distill), the timing loop of decode.py (refdec.app.runner)
and the machine's probes (refdec.routes.probes) time through these functions alone.

A time is read once the device has finished the work queued on it (`clock`: a GPU runs asynchronously,
and without the synchronisation a time would be the launch's alone). Work compared with other work is
timed interleaved, call by call, so that a drift in the machine's speed (another process, the clock's
boost, a warming cache) hits each alike (`interleaved`); a figure is the median of repeated calls
(`median_seconds`), or for a probe, which asks which of two kernels is faster, the fastest of each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def clock(device: torch.device | str = "cpu") -> float:
    """time.perf_counter() once the device has finished the work queued on it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seconds(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds of one call of fn(), the device's work done."""
    start = clock(device)
    fn()
    return clock(device) - start


def median_seconds(
    fn: Callable[[], object],
    reps: int,
    device: torch.device | str = "cpu",
    between: Callable[[], object] | None = None,
) -> float:
    """The median seconds of `reps` calls of fn(); `between`, untimed after each (putting back what a call
    changed, as a cache cut back to its prefix)."""
    times = []
    for _ in range(reps):
        times.append(seconds(fn, device))
        if between is not None:
            between()
    return statistics.median(times)


def interleaved(
    fns: list[Callable[[], object]],
    rounds: int,
    device: torch.device | str = "cpu",
    give_up: Callable[[list[list[float]]], bool] | None = None,
) -> list[list[float]]:
    """Seconds of each of `fns` in each of `rounds` rounds, the functions called in turn within a round,
    after one untimed call of each; `give_up(the times so far)`, asked after each round, ends the rounds
    when true (a kernel so slow that more calls would only cost time)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.append(seconds(fn, device))
        if give_up is not None and give_up(times):
            break
    return times
