"""The rows of a batch still decoding: the bookkeeping every batched decoder shares, kept out of
the algorithms so that each decode_* body reads as its paper's pseudo-code.

A batch starts with every source row decoding. Each row has its output so far (without bos), a
budget (what is left of max_len) and, when asked, a trace of Steps. After a verification call each
row commits its own tokens; a row that produced eos or reached max_len leaves the batch, and its
rows of every memory and cache leave with it, so the batch shrinks as sentences finish and costs
what its longest sentence costs in calls. Batch rows are numbered 0 .. len(rows) - 1 in the order
of `alive`; the outputs stay indexed by source row.

    rows <- every source row
    while rows:
        each row drafts                                   (the algorithm)
        verified = rows.verify(model, drafts)             (one call for every row: verify_rows, counted)
        rows.commit(drafts, verified)                     (append, count, trace, drop finished rows)
    return rows.result()
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import Memory, Transformer
from ..trace import Step
from .result import DecodeResult, DecodeStats, result_of
from .verify import AcceptRule, ChooseRule, Verified, per_row, step_of, verify_rows


class Rows:
    """The source rows still decoding (`alive`), their outputs, the stats and trace, and the
    memories and caches whose batch rows follow them (a KVCache or a Follower: anything with
    `select(rows)`; None, a cache a decoder does without, is skipped). cfg: the verifier's (bos, eos)."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        stats: DecodeStats,
        trace: bool,
        *,
        memories: list[Memory],
        caches: list,
    ):
        self.max_len, self.bos_id, self.eos_id, self.stats = max_len, cfg.bos_id, cfg.eos_id, stats
        self.alive = list(range(batch)) if max_len > 0 else []  # source row of each batch row still decoding
        self.outs: list[list[int]] = [[] for _ in range(batch)]  # output tokens after bos, per source row
        self.steps: list[list[Step]] | None = [[] for _ in range(batch)] if trace else None
        self.sentence_marks: dict[str, list] = {}  # Step fields of one value per source row (IAD's source)
        self.memories = list(memories)
        self.caches = [c for c in caches if c is not None]

    def __len__(self) -> int:
        return len(self.alive)

    @property
    def memory(self) -> Memory:
        """The first memory (the verifier's), batch rows as `alive`."""
        return self.memories[0]

    @property
    def cache(self):
        """The first cache (the verifier's), batch rows as `alive`."""
        return self.caches[0]

    def outputs(self) -> list[list[int]]:
        """Each batch row's output so far (the lists themselves: appending to one extends that row)."""
        return [self.outs[b] for b in self.alive]

    def prefixes(self) -> list[list[int]]:
        """Each batch row's bos + output so far: what a drafter conditions on."""
        return [[self.bos_id] + out for out in self.outputs()]

    def lasts(self) -> list[int]:
        """What each batch row feeds the verifier first: its last committed token (bos before any)."""
        return [out[-1] if out else self.bos_id for out in self.outputs()]

    def budgets(self) -> list[int]:
        """How many tokens each batch row's output may still grow by (what is left of max_len)."""
        return [self.max_len - len(out) for out in self.outputs()]

    def done(self, out: list[int]) -> bool:
        """An output that ends in eos or has reached max_len is finished."""
        return bool(out) and out[-1] == self.eos_id or len(out) >= self.max_len

    def verify(
        self,
        model: Transformer,
        drafts: list[list[int]],
        *,
        accept: AcceptRule | list[AcceptRule] | None = None,
        choose: ChooseRule | list[ChooseRule] | None = None,
    ) -> list[Verified]:
        """One verification call (refdec.decoding.verify.verify_rows) of every batch row's draft:
        `model` over the verifier's memory and cache, row r fed its last committed token then
        drafts[r], with what is left of its max_len as its budget; counted in stats.verifier_calls.
        accept, choose: verify_rows's rules (one for every row, or a list of one per row)."""
        verified = verify_rows(
            model,
            self.memory,
            self.cache,
            self.lasts(),
            drafts,
            budgets=self.budgets(),
            eos_id=self.eos_id,
            accept=accept,
            choose=choose,
        )
        self.stats.verifier_calls += 1
        return verified

    def record(self, r: int, step: Step) -> None:
        """Add `step` to batch row r's trace, when a trace is kept."""
        if self.steps is not None:
            self.steps[self.alive[r]].append(step)

    def commit(self, drafts: list[list[int]], verified: list[Verified], *, drafted_by: str, **marks) -> list[int]:
        """Batch row r takes what its verification of drafts[r] committed: appended to its output,
        counted in stats.committed and traced as a Step (`marks`: the Step's other fields, one value
        for every row or a list of one per row). Finished rows then leave the batch; returns the
        batch rows (numbered as before the call) that go on."""
        for r, (out, v) in enumerate(zip(self.outputs(), verified)):
            out += v.tokens
            self.stats.committed.append(len(v.tokens))
            fields = {k: per_row(m, r) for k, m in marks.items()} | {
                k: m[self.alive[r]] for k, m in self.sentence_marks.items()
            }
            self.record(r, step_of(drafts[r], v, drafted_by, **fields))
        going = [r for r, out in enumerate(self.outputs()) if not self.done(out)]
        self.keep(going)
        return going

    def keep(self, going: list[int]) -> None:
        """Batch rows `going` stay, in that order, the others leave: every cache keeps those rows in
        place and every memory is cut to them. Nothing moves when every row stays or none does."""
        if going and len(going) < len(self.alive):
            rows = torch.tensor(going, device=self.memory.states.device)
            for cache in self.caches:
                cache.select(rows)
            self.memories = [m.select(rows) for m in self.memories]
        self.alive = [self.alive[r] for r in going]

    def result(self, device: torch.device) -> DecodeResult:
        """The batch's DecodeResult, once every row has finished."""
        return result_of(self.outs, self.eos_id, self.stats, self.steps, device)


COMPACT = 4  # greedy's finished rows leave the batch once they are at least 1/COMPACT of it


class GreedyRows:
    """Greedy's batch, which commits one token per row and call, so that no row needs a list of its
    own: each step's tokens go into one (B, max_len) tensor with one indexed write, and the rows'
    outputs are read from it once, at the end, cut at their first eos.

    Dropping a finished row moves every later row of the cache (refdec.cache.KVCache.select) and
    copies the memory, so it waits until a quarter of the batch has finished (COMPACT): until then a
    finished row is carried along, its tokens computed and ignored, rather than the rows moved each
    time one row finishes. `memory` and `cache` follow the rows still in the batch."""

    def __init__(self, memory: Memory, cache, batch: int, max_len: int, eos_id: int):
        device = memory.states.device
        self.memory, self.cache, self.eos_id = memory, cache, eos_id
        self.written = torch.full((batch, max_len), eos_id, dtype=torch.long, device=device)  # y_1 .. per source row
        self.alive = torch.arange(batch, device=device)  # source row of each batch row
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)  # batch rows that have written eos
        self.steps = 0

    def write(self, tokens: torch.Tensor) -> bool:
        """Each batch row's next token (b,); True once every row has written eos."""
        self.written[self.alive, self.steps] = tokens  # a carried row writes after its eos: cut at the end
        self.steps += 1
        self.finished |= tokens.eq(self.eos_id)
        return bool(self.finished.all())

    def compact(self, tokens: torch.Tensor) -> torch.Tensor:
        """Drop the finished rows (with their memory and cache rows) once they are a quarter of the
        batch; returns `tokens` for the batch rows that stay."""
        if int(self.finished.sum()) * COMPACT >= len(self.finished):
            keep = (~self.finished).nonzero().squeeze(1)
            self.alive, self.finished, self.memory = self.alive[keep], self.finished[keep], self.memory.select(keep)
            self.cache.select(keep)
            tokens = tokens[keep]
        return tokens

    def outputs(self) -> list[list[int]]:
        """Each source row's tokens up to and including its first eos (all of them without one)."""
        return [cut_at_eos(row, self.eos_id) for row in self.written[:, : self.steps].tolist()]


def cut_at_eos(row: list[int], eos_id: int) -> list[int]:
    """A row's tokens up to and including its first eos (all of them without one: it reached max_len)."""
    return row[: row.index(eos_id) + 1] if eos_id in row else row
