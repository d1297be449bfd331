"""The progress line of refdec's long-running commands (stepcost, ceiling, fuzz, distill, ctranslate2).

On stderr, so stdout keeps only the table a command prints: `  12/30 rounds, 40 s, ETA 60 s`, at
most one line every few seconds, and none for work that ends sooner.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """Seconds as a person reads them: `42 s`, `12.5 min`, `2.1 h`."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 6000 else f"{seconds / 3600:.1f} h"


class ProgressLine:
    """`done/total unit, elapsed, ETA` through `log` (stderr by default), at most once every `every`
    seconds and never in the first `every` seconds: a command of a few seconds prints nothing, a long
    one shows it is alive and how long it has left. `already`: units done by an earlier run that this
    one resumes, left out of the pace; the ETA assumes the rest goes at the pace so far."""

    def __init__(
        self, total: int, unit: str, every: float = 5.0, *, already: int = 0, log: Callable[[str], None] = to_stderr
    ):
        self.total, self.unit, self.every, self.already, self.log = total, unit, every, already, log
        self.start = self.last = time.monotonic()

    def update(self, done: int, *, now: bool = False) -> None:
        """`done` of the total units are finished: a line if one is due (`now`: whatever the time)."""
        t = time.monotonic()
        if not now and (t - self.last < self.every or not self.already < done < self.total):
            return
        elapsed = t - self.start
        pace = elapsed / max(done - self.already, 1)
        self.log(f"  {done}/{self.total} {self.unit}, {duration(elapsed)}, ETA {duration(pace * (self.total - done))}")
        self.last = t
