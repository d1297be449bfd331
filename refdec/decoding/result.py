"""The one return type of every decoder: tokens, a stats record and, on request, a step trace."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..timing import clock
from ..trace import Step


@dataclass
class DecodeStats:
    """Counts a decoder fills in. Wall time is measured by the caller, not here.

    verifier_calls  decoder calls of the model whose output is produced (greedy: one per step; one
                    call verifies every row of a batch)
    drafter_calls   calls of a separate drafter / small model (0 for greedy and beam)
    committed       tokens committed by each verifier call, per sentence row (greedy: all 1); their
                    mean is the tokens per call
    fallbacks, rollbacks  big-little decoding's counters, one per row that fell back (or rolled back)
    """

    sentences: int = 0
    tokens: int = 0  # output tokens, eos included where produced
    verifier_calls: int = 0
    drafter_calls: int = 0
    encoder_calls: int = 0
    committed: list[int] = field(default_factory=list)
    fallbacks: int = 0
    rollbacks: int = 0
    hit_max_len: int = 0  # sentences stopped by max_len before eos
    module_seconds: dict = field(default_factory=dict)  # time per part (GAD: encoders, drafter, verifier)

    @property
    def mean_committed(self) -> float:
        """Tokens committed per verifier call and row."""
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def merge(self, other: DecodeStats) -> None:
        for name in (
            "sentences",
            "tokens",
            "verifier_calls",
            "drafter_calls",
            "encoder_calls",
            "fallbacks",
            "rollbacks",
            "hit_max_len",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.committed.extend(other.committed)
        for k, v in other.module_seconds.items():
            self.module_seconds[k] = self.module_seconds.get(k, 0.0) + v

    def to_dict(self) -> dict:
        return {
            "sentences": self.sentences,
            "tokens": self.tokens,
            "verifier_calls": self.verifier_calls,
            "drafter_calls": self.drafter_calls,
            "encoder_calls": self.encoder_calls,
            "tokens_per_call": self.mean_committed,
            "fallbacks": self.fallbacks,
            "rollbacks": self.rollbacks,
            "hit_max_len": self.hit_max_len,
            **({"module_seconds": dict(self.module_seconds)} if self.module_seconds else {}),
        }


@dataclass
class DecodeResult:
    """tokens[b]: the output of source row b as a 1-D LongTensor, without bos and without the final
    eos (which the decoder stops at). trace: one Step per iteration when the caller asked for one."""

    tokens: list[torch.Tensor]
    stats: DecodeStats
    trace: list[list[Step]] | None = None  # trace[b] = the steps of row b


class PartTimes:
    """A timing hook: `with times("drafter decoder"): ...` adds the wall time of the block to that
    part's seconds. A decoder that reports time per part (GAD) calls its hook around each part and
    copies `seconds` into DecodeStats.module_seconds; the algorithm itself keeps no clock."""

    def __init__(self, *parts: str):
        self.seconds = dict.fromkeys(parts, 0.0)  # the parts in report order, each from zero

    @contextlib.contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        start = clock()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + clock() - start


def check_eval(model: torch.nn.Module) -> None:
    """Decoders refuse a model in training mode: dropout would make every output random."""
    if model.training:
        raise ValueError("decoding needs model.eval(): dropout is active in training mode")


def finish_row(out: list[int], eos_id: int, stats: DecodeStats, device) -> torch.Tensor:
    """Count a finished row's tokens in `stats` and return it as a tensor without its final eos
    (a row without eos stopped at max_len)."""
    stats.tokens += len(out)
    if out and out[-1] == eos_id:
        out = out[:-1]
    else:
        stats.hit_max_len += 1
    return torch.tensor(out, dtype=torch.long, device=device)


def result_of(
    outs: list[list[int]], eos_id: int, stats: DecodeStats, steps: list[list[Step]] | None, device
) -> DecodeResult:
    """A batch's DecodeResult from each row's output tokens (finish_row) and, on request, its trace."""
    return DecodeResult([finish_row(out, eos_id, stats, device) for out in outs], stats, steps)
