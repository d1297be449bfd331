"""Run: one algorithm's outputs and accumulated figures over the whole input, with the limits of its
batches; make_runs, a Run per planned RunSpec on its loaded models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...decoding import DecodeStats
from ..algorithms import Algorithm
from ..loading import Models


@dataclass
class Run:
    """One algorithm's outputs and accumulated figures over the whole input."""

    algo: Algorithm
    options: dict
    models: Models
    label: str = ""  # name in tables ("" = the algorithm's name)
    batch_size: int = 1  # most sentences per decoder call (0: no limit, with a token budget)
    trace: bool = False  # keep each sentence's steps
    batch_tokens: int = 0  # most source tokens per decoder call, padding included (0: none)
    int8: bool = False  # its models on the int8 route (refdec.routes.int8)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    traces: list = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)  # per line: seconds of its batch / batch size
    calls: list[int | None] = field(default_factory=list)  # per line: verifier calls of its batch

    @property
    def name(self) -> str:
        return self.label or self.algo.name

    @property
    def cuts_to_budget(self) -> bool:
        """Whether a line's output under its own budget is its output under a larger one cut to that
        budget, so that a batch may decode to its largest line's budget and cut each row to its own:
        true of greedy and of every lossless algorithm (each equals greedy, which decides token by token),
        not of beam search, BiLD or sampling, whose batches then hold lines of one budget. A trace is
        kept whole, so a traced run takes batches of one budget too."""
        return self.algo.is_lossless(self.options) and not self.trace

    def fits(self, rows: int, longest: int) -> bool:
        """Whether a batch of `rows` sources, the longest `longest` ids, is within this run's limits:
        its batch size, and its token budget counted as the padded source tensor (rows x (longest + 1),
        eos included)."""
        return (not self.batch_size or rows <= self.batch_size) and (
            not self.batch_tokens or rows * (longest + 1) <= self.batch_tokens
        )


def make_runs(specs: list, models: list[Models], *, trace: bool = False) -> list[Run]:
    """A Run per refdec.app.plan RunSpec, on the models refdec.app.loading.load_models gave it."""
    return [
        Run(s.algo, s.options, m, s.label, s.batch_size, trace, s.batch_tokens, s.int8) for s, m in zip(specs, models)
    ]
