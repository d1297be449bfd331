"""One row's acceptance (verify.accept_row), the batch bookkeeping (rows.Rows) and GAD's timing hook."""

from __future__ import annotations

import torch
from conftest import random_src, tiny_model

from refdec.config import EOS_ID
from refdec.decoding.gad import PARTS, decode_gad
from refdec.decoding.result import DecodeStats
from refdec.decoding.rows import Rows
from refdec.decoding.verify import accept_row
from refdec.drafter import Drafter

V = 12


def logits_for(argmax: list[int]) -> torch.Tensor:
    """(len(argmax), V) logits whose argmax at each position is the given id."""
    out = torch.zeros(len(argmax), V, dtype=torch.float64)
    out[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    return out


def test_accept_row_commits_the_passed_prefix_and_the_verifiers_token():
    """Guards the exactness argument itself: d_1 .. d_n that equal the verifier's argmax, then p_n
    (the bifurcation's token, or the free one when every drafted token passed)."""
    argmax = [5, 6, 9, 10]
    assert accept_row([5, 6, 7], logits_for(argmax), argmax, budget=10, eos_id=EOS_ID) == ([5, 6, 9], 2)
    assert accept_row([5, 6, 9], logits_for(argmax), argmax, budget=10, eos_id=EOS_ID) == ([5, 6, 9, 10], 3)
    assert accept_row([7, 6, 9], logits_for(argmax), argmax, budget=10, eos_id=EOS_ID) == ([5], 0)
    assert accept_row([], logits_for([8]), [8], budget=10, eos_id=EOS_ID) == ([8], 0)


def test_accept_row_cuts_at_eos_and_at_the_budget():
    """Guards the two boundary cuts: nothing after the first eos, nothing past what max_len leaves."""
    argmax = [5, EOS_ID, 7, 8]
    assert accept_row([5, EOS_ID, 7], logits_for(argmax), argmax, budget=10, eos_id=EOS_ID) == ([5, EOS_ID], 3)
    assert accept_row([5, 6, 7], logits_for([5, 6, 7, 8]), [5, 6, 7, 8], budget=2, eos_id=EOS_ID) == ([5, 6], 3)


def test_accept_row_takes_the_rules_test_and_choice():
    """A lossy test replaces equality and a sampler replaces the argmax at the bifurcation, which is
    told whether draft token n was refused."""
    argmax = [5, 6, 9]
    seen = []

    def choose(row, n, rejected):
        seen.append((n, rejected))
        return 8

    def always(logits, draft):
        return torch.ones(len(draft), dtype=torch.bool)

    def never(logits, draft):
        return torch.zeros(len(draft), dtype=torch.bool)

    assert accept_row([6, 7], logits_for(argmax), argmax, budget=9, eos_id=EOS_ID, accept=always) == ([6, 7, 9], 2)
    assert accept_row([6, 7], logits_for(argmax), argmax, budget=9, eos_id=EOS_ID, accept=never, choose=choose) == (
        [8],
        0,
    )
    assert accept_row([6, 7], logits_for(argmax), argmax, budget=9, eos_id=EOS_ID, accept=always, choose=choose) == (
        [6, 7, 8],
        2,
    )
    assert seen == [(0, True), (2, False)]


def test_rows_leave_with_their_memory_and_cache_rows():
    """Guards the batch bookkeeping: a row that ends (eos or max_len) leaves, and the memory and
    cache keep exactly the rows that go on, in order."""
    m = tiny_model(0, vocab=V)
    src = random_src(0, 3, V)
    memory, cache = m.encode(src), m.new_cache(3, capacity=8)
    rows = Rows(m.cfg, 3, 4, DecodeStats(sentences=3), trace=True, memories=[memory], caches=[cache])
    assert rows.lasts() == [m.cfg.bos_id] * 3 and rows.budgets() == [4, 4, 4]
    rows.outputs()[1].append(7)
    assert rows.prefixes()[1] == [m.cfg.bos_id, 7] and rows.budgets() == [4, 3, 4]
    rows.outputs()[0].append(EOS_ID)
    rows.keep([r for r, out in enumerate(rows.outputs()) if not rows.done(out)])
    assert rows.alive == [1, 2] and len(rows) == 2 and rows.memory.batch == 2
    assert torch.equal(rows.memory.states, memory.states[1:])


def test_gad_reports_its_parts_through_the_timing_hook():
    """The timing is a hook around each part: a caller's hook sees the encoders once and a drafter
    then a verifier call per iteration; the default one fills stats.module_seconds."""
    m = tiny_model(0, vocab=V)
    calls = []

    class Recorder:
        seconds = {}

        def __call__(self, part):
            calls.append(part)
            return torch.no_grad()  # any context manager

    r = decode_gad(m, Drafter(m, k=3), random_src(0, 2, V), max_len=10, times=Recorder())
    assert calls[:2] == ["verifier encoder", "drafter encoder"]
    assert calls[2:] == ["drafter decoder", "verifier decoder"] * r.stats.verifier_calls
    assert set(decode_gad(m, Drafter(m, k=3), random_src(0, 2, V), max_len=10).stats.module_seconds) == set(PARTS)
