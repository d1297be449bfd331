"""Batched GAD (and GAD++ at its exact setting), blockwise parallel decoding, greedy speculative
decoding and BiLD on the shared verify_rows step: every lossless one equals batch-1 greedy row by
row (float64, torch.equal), for batch sizes 1-17, ragged sources (empty ones included), ragged and
adversarial drafts, eos inside drafts, drafts past max_len and rows finishing at different steps;
the batched drafter and small-model Follower see nothing of another row or of their padding."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    adversarial_drafter,
    alone,
    assert_rows_equal,
    batch1_greedy,
    copy_model,
    fake_models,
    invariant_copy,
    ragged_src,
    random_heads,
    random_src,
    tiny_model,
)

from refdec.commands.fuzz import gadpp_rule_at_exact
from refdec.config import BOS_ID, EOS_ID
from refdec.decoding import gad as gad_module
from refdec.decoding.bild import decode_bild
from refdec.decoding.blockwise import decode_blockwise
from refdec.decoding.gad import decode_gad
from refdec.decoding.pairing import Follower
from refdec.decoding.speculative import decode_speculative
from refdec.drafter import Drafter, draft_block, draft_blocks
from refdec.proposal import ProposalHeads


@pytest.mark.parametrize("batch", range(1, 18))
def test_batched_gad_equals_batch1_greedy(batch, monkeypatch):
    """Guards batched GAD: a real drafter (causal or bidirectional, its own caches ragged) and an
    adversarial one (right, partly right, wrong, empty blocks, eos inside), GAD++'s rule at its exact
    setting (top_beta 1, tau 0 through the acceptance test), max_len 25 and 4."""
    vocab = 12 if batch % 2 else 40
    verifier = tiny_model(batch, vocab=vocab)
    drafter = tiny_model(batch + 50, vocab=vocab, layers=(1, 2))
    src = ragged_src(300 + batch, batch, vocab)
    layout = "causal" if batch % 3 else "bidirectional"
    for max_len in (25, 4):
        ref = batch1_greedy(verifier, src, max_len)
        r = decode_gad(verifier, Drafter(drafter, k=1 + batch % 5, layout=layout), src, max_len=max_len, trace=True)
        assert_rows_equal(r.tokens, ref, f"gad B={batch} max_len={max_len}")
        with gadpp_rule_at_exact():
            pp = decode_gad(verifier, Drafter(drafter, k=3, layout=layout), src, max_len=max_len)
        assert_rows_equal(pp.tokens, ref, f"gad++ exact B={batch} max_len={max_len}")
        refs = [t.tolist() + [EOS_ID] for t in ref]
        with monkeypatch.context() as mp:
            mp.setattr(gad_module, "draft_blocks", adversarial_drafter(refs, batch + max_len, vocab))
            adv = decode_gad(verifier, Drafter(drafter, k=6), src, max_len=max_len, trace=True)
        assert_rows_equal(adv.tokens, ref, f"gad adversarial B={batch} max_len={max_len}")
        if batch >= 6 and max_len == 25 and vocab == 40:
            assert len({len(t) for t in adv.trace}) > 1, "rows should finish at different steps"
            assert any(s.accepted > 0 for t in adv.trace for s in t), "some drafts should be accepted"


@pytest.mark.parametrize("batch", range(1, 18))
def test_batched_blockwise_and_speculative_equal_batch1_greedy(batch):
    """Guards batched blockwise decoding (heads that propose p_1's own token, so proposals are
    partly right, and random heads) and greedy speculative decoding (the large model as its own
    drafter, every draft right and eos inside drafts; a random small model, drafts mostly wrong),
    on a copying model and a random one, max_len 30 and 3 (drafts past max_len)."""
    models = (copy_model(), tiny_model(batch, vocab=12))
    for m in models:
        vocab = m.cfg.vocab_size
        src = ragged_src(400 + batch, batch, vocab)
        small = tiny_model(batch + 100, vocab=vocab, d_model=16, layers=(1, 1))
        copying = ProposalHeads(m.cfg.d_model, 8, 4).double().eval()  # zero residual: every head is p_1
        for max_len in (30, 3):
            ref = batch1_greedy(m, src, max_len)
            what = f"B={batch} vocab={vocab} max_len={max_len}"
            assert_rows_equal(
                decode_blockwise(m, copying, src, max_len=max_len).tokens, ref, f"blockwise (p_1 heads) {what}"
            )
            assert_rows_equal(
                decode_blockwise(m, random_heads(m, 3, batch), src, max_len=max_len).tokens,
                ref,
                f"blockwise (random heads) {what}",
            )
            same = decode_speculative(m, m, src, max_len=max_len, gamma=4, trace=True)
            assert_rows_equal(same.tokens, ref, f"speculative (self-drafted) {what}")
            assert_rows_equal(
                decode_speculative(m, small, src, max_len=max_len, gamma=1 + batch % 4).tokens,
                ref,
                f"speculative (random small) {what}",
            )
            if max_len == 30 and batch > 1:
                assert all(not s.rejected for t in same.trace for s in t)  # every draft right


@pytest.mark.parametrize("batch", [1, 2, 5, 9, 17])
def test_batched_decoders_equal_batch1_greedy_in_float32_row_invariant(batch):
    """Guards the batched decoders in row-invariant mode: in float32, where a shape-dependent
    rounding would show, each equals batch-1 greedy with torch.equal; and batched BiLD (lossy) makes
    each row's decisions exactly as BiLD on that row alone."""
    m = invariant_copy(copy_model(), torch.float32)
    drafter = invariant_copy(tiny_model(batch + 7, vocab=16, layers=(1, 2)), torch.float32)
    small = invariant_copy(tiny_model(batch + 8, vocab=16, d_model=16, layers=(1, 1)), torch.float32)
    heads = ProposalHeads(m.cfg.d_model, 8, 3).float().eval()
    src = ragged_src(500 + batch, batch, 16)
    ref = batch1_greedy(m, src, 24)
    assert_rows_equal(decode_gad(m, Drafter(drafter, k=4), src, max_len=24).tokens, ref, "gad")
    assert_rows_equal(
        decode_gad(m, Drafter(drafter, k=4, layout="bidirectional"), src, max_len=24).tokens, ref, "gad bidirectional"
    )
    assert_rows_equal(decode_blockwise(m, heads, src, max_len=24).tokens, ref, "blockwise")
    assert_rows_equal(decode_speculative(m, small, src, max_len=24, gamma=3).tokens, ref, "speculative")
    assert_rows_equal(decode_speculative(m, m, src, max_len=24, gamma=5).tokens, ref, "speculative self-drafted")
    knobs = dict(max_len=24, fallback_threshold=0.5, rollback_threshold=1.0, max_window=4)
    r = decode_bild(m, small, src, trace=True, **knobs)
    for b in range(batch):
        one = decode_bild(m, small, alone(src, b), trace=True, **knobs)
        assert torch.equal(r.tokens[b], one.tokens[0]) and r.trace[b] == one.trace[0], f"bild row {b}"


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_batched_bild_at_its_greedy_limits_is_greedy(batch):
    """Guards batched BiLD where it is greedy of the large model: the large model writes every token
    (fallback threshold above 1), or rejects every small-model token (rollback below 0) after the
    small model's runs of different lengths per row."""
    large = tiny_model(batch, vocab=12, layers=(2, 3))
    small = tiny_model(batch + 100, vocab=12, d_model=16, layers=(1, 1))
    src = ragged_src(600 + batch, batch, 12)
    ref = batch1_greedy(large, src, 20)
    assert_rows_equal(
        decode_bild(large, small, src, max_len=20, fallback_threshold=1.5).tokens, ref, "bild, large writes"
    )
    r = decode_bild(large, large, src, max_len=20, fallback_threshold=0.0, rollback_threshold=1e9, max_window=3)
    assert_rows_equal(r.tokens, ref, "bild, small = large")
    assert r.stats.rollbacks == 0


# -- the batched drafter and Follower: nothing of another row, nothing of the padding ---------------
@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_batched_drafting_equals_drafting_each_row_alone(layout):
    """Guards draft_blocks' per-row open block (a row's masks that saw its padding, even as an e^0
    term in their softmax, or another row's positions) and its per-row cache cut (a row whose
    drafter cache kept the masks, or was cut to another row's length): sequences of different
    lengths, drafted in rounds where each row's sequence grows by its own count, give bitwise the
    drafts of each row drafted alone (row-invariant mode), and each row's cache holds its sequence."""
    m = invariant_copy(tiny_model(3, vocab=16, max_positions=24), torch.float64)
    src = random_src(7, 4, 16, min_len=2, max_len=9)
    g = torch.Generator().manual_seed(1)
    seqs = [[BOS_ID] + torch.randint(5, 16, (n,), generator=g).tolist() for n in (0, 5, 2, 9)]
    with torch.inference_mode():
        memory = m.encode(src)
        cache = m.new_cache(4, 8) if layout == "causal" else None
        singles = [(m.encode(alone(src, b)), m.new_cache(1, 8) if layout == "causal" else None) for b in range(4)]
        for grow in ([3, 1, 0, 4], [1, 6, 2, 1], [20, 1, 1, 1]):  # the last round runs row 0 out of positions
            got = draft_blocks(m, memory, cache, seqs, 5, layout)
            for b, (mem1, c1) in enumerate(singles):
                assert got[b] == draft_block(m, mem1, c1, seqs[b], 5, layout), (grow, b)
                assert len(got[b]) == max(0, min(5, 24 - len(seqs[b])))
            if layout == "causal":
                assert cache.lengths.tolist() == [min(len(s), 24) for s in seqs]
            seqs = [s + torch.randint(5, 16, (n,), generator=g).tolist() for s, n in zip(seqs, grow)]


def test_batched_follower_equals_a_follower_per_row():
    """Guards the batched Follower (a row fed another row's padding or positions, or a cache not cut
    back to the row's first changed token): rows that grow, roll back and re-feed their last token,
    each by its own count, give bitwise the next-token logits of a Follower per row, and rows that
    leave take their cache and memory rows with them."""
    m = invariant_copy(tiny_model(5, vocab=16), torch.float64)
    src = random_src(9, 3, 16, min_len=2, max_len=8)
    g = torch.Generator().manual_seed(2)
    rnd = lambda n: torch.randint(5, 16, (n,), generator=g).tolist()  # noqa: E731
    with torch.inference_mode():
        batched = Follower(m, m.encode(src), capacity=4)
        alone_f = [Follower(m, m.encode(alone(src, b)), capacity=4) for b in range(3)]
        seqs = [[BOS_ID] + rnd(n) for n in (1, 4, 0)]
        edits = [lambda s: s + rnd(2), lambda s: s[:-2] + rnd(1), lambda s: s, lambda s: s[:1] + rnd(5)]
        for step in range(6):
            got = batched.next_logits(seqs)
            for b, f in enumerate(alone_f):
                assert torch.equal(got[b], f.next_logits([seqs[b]])[0]), (step, b)
            seqs = [edits[(step + b) % 4](s) if len(s) > 2 else s + rnd(3) for b, s in enumerate(seqs)]
        batched.select(torch.tensor([2, 0]))
        got = batched.next_logits([seqs[2], seqs[0]])
        assert torch.equal(got[0], alone_f[2].next_logits([seqs[2]])[0])
        assert torch.equal(got[1], alone_f[0].next_logits([seqs[0]])[0])


# -- decode.py: length buckets, per-run batch sizes ----------------------------------------------------
def load_cli():
    from refdec.commands import decode

    return decode


def test_runs_at_different_batch_sizes_share_length_buckets_and_keep_input_order():
    """Guards the runner's bucketing (a batch of far-apart lengths, an output put back on the wrong
    line, lines handed on out of order) and per-run batch sizes (a run at batch 1 given another
    output budget than a run at batch 3 for the same line): lines are decoded in chunks of the
    largest batch, sorted by length, each run in its own batch size; outputs land on their own lines,
    each cut to its own line's budget, and are handed on in input order, empty lines included."""
    from refdec.app import runner
    from refdec.app.algorithms import Algorithm
    from refdec.decoding import DecodeResult, DecodeStats

    seen = {1: [], 3: []}

    def fake(size):
        def decode(model, src, *, max_len, trace=False):
            lens = src.ne(0).sum(dim=1).tolist()
            seen[size].append((lens, max_len))
            outs = [torch.tensor([n] + [7] * (max_len - 1)) for n in lens]  # to the budget: no eos
            return DecodeResult(outs, DecodeStats(sentences=len(lens)))

        return decode

    ids = [[5] * n if n else None for n in (4, 1, 0, 7, 2, 9, 3, 0, 5, 6)]
    runs = [runner.Run(Algorithm(f"b{n}", fake(n), "fake"), {}, fake_models(), batch_size=n) for n in (1, 3)]
    handed = []
    done = runner.decode_lines(
        runs,
        ids,
        max_len=None,
        max_positions=64,
        device="cpu",
        warmup=0,
        progress=False,
        on_line=lambda i, t: handed.append(i),
    )
    assert done == len(ids) and handed == list(range(len(ids)))
    for run in runs:
        for i, s in enumerate(ids):
            assert (run.outputs[i] is None) == (s is None)
            if s is not None:
                assert run.outputs[i][0].item() == len(s) + 1  # its own line's source (eos included)
                assert len(run.outputs[i]) == 2 * len(s) + 10  # its own line's budget, whatever its batch
    assert [len(b) for b, _ in seen[3]] == [3, 3, 2]
    assert [b for b, _ in seen[3]] == [[2, 3, 4], [5, 6, 7], [8, 10]]  # neighbours in length
    assert [b for b, _ in seen[1]] == [[2], [3], [4], [5], [6], [7], [8], [10]]


def test_batch_size_options_are_parsed_and_refused():
    """Guards --compare's :batch-size=N and --batch-sizes (a size that is not a whole number of at
    least 1, repeated sizes, or --batch-sizes beside --batch-size: refused, never ignored)."""
    from refdec.app.plan import Compared, parse_compare, parse_sizes
    from refdec.errors import UsageError

    cli = load_cli()
    assert parse_compare("iad:batch-size=4:max-draft=8,greedy") == [
        Compared("iad", None, {"max_draft": 8}, batch_size=4),
        Compared("greedy"),
    ]
    for bad in ("iad:batch-size=0", "iad:batch-size=x", "greedy:batch-size=-2"):
        with pytest.raises(UsageError, match="batch-size"):
            parse_compare(bad)
    assert parse_sizes("1,8,32", None) == [1, 8, 32]
    for text, size, needle in (
        ("1,1", None, "different"),
        ("8,a", None, "whole numbers"),
        ("0,4", None, "at least 1"),
        ("1,8", 4, "leave out"),
    ):
        with pytest.raises(UsageError, match=needle):
            parse_sizes(text, size)
    args = cli.build_parser().parse_args(
        ["--algo", "greedy", "--task", "gec-uk", "--batch-sizes", "1,8", "--compare", "iad:batch-size=4"]
    )
    with pytest.raises(UsageError, match="cannot set its own"):
        cli.run(args)


def test_token_budget_batches_hold_at_most_the_budget_and_share_chunks_with_row_batches():
    """Guards --batch-tokens: each batch of a token-budget run holds as many neighbours in length as
    fit in the budget (sentences x (longest + 1) source tokens, one sentence at least), its row cap
    holds, a run batched by rows beside it still gets its own batches, and every line comes back to
    its own place."""
    from refdec.app import runner
    from refdec.app.algorithms import Algorithm
    from refdec.decoding import DecodeResult, DecodeStats

    seen = {}

    def fake(name):
        def decode(model, src, *, max_len, trace=False):
            lens = src.ne(0).sum(dim=1).tolist()
            seen.setdefault(name, []).append((lens, src.numel()))
            return DecodeResult([torch.tensor([n]) for n in lens], DecodeStats(sentences=len(lens)))

        return decode

    lengths = (4, 1, 0, 7, 2, 9, 3, 0, 5, 6, 30, 2, 2, 2, 2, 2)
    ids = [[5] * n if n else None for n in lengths]
    runs = [
        runner.Run(Algorithm("rows", fake("rows"), "fake"), {}, fake_models(), batch_size=3),
        runner.Run(Algorithm("tokens", fake("tokens"), "fake"), {}, fake_models(), batch_size=0, batch_tokens=24),
        runner.Run(Algorithm("capped", fake("capped"), "fake"), {}, fake_models(), batch_size=2, batch_tokens=24),
    ]
    runner.decode_lines(runs, ids, max_len=None, max_positions=64, device="cpu", warmup=0, progress=False)
    for run in runs:
        assert [o[0].item() if o is not None else None for o in run.outputs] == [n + 1 if n else None for n in lengths]
    assert all(len(b) <= 3 for b, _ in seen["rows"])
    for name, cap in (("tokens", None), ("capped", 2)):
        got = [b for b, _ in seen[name]]
        assert sorted(n for b in got for n in b) == sorted(n + 1 for n in lengths if n)
        for b, numel in seen[name]:
            assert numel == len(b) * max(b)  # the padded source tensor: what the budget counts
            assert numel <= 24 or len(b) == 1  # within the budget, or one sentence longer than it
            assert cap is None or len(b) <= cap
    assert [31] in [b for b, _ in seen["tokens"]]  # a sentence longer than the budget: a batch of its own
    assert max(len(b) for b, _ in seen["tokens"]) > 3  # short sentences: more rows than a batch size would give
    seen.clear()  # alone, a token-budget run's batches are as full as the budget allows
    runner.decode_lines(runs[1:2], ids, max_len=None, max_positions=64, device="cpu", warmup=0, progress=False)
    got = [b for b, _ in seen["tokens"]]
    assert all((len(b) + 1) * max(b + nxt[:1]) > 24 for b, nxt in zip(got, got[1:]))


def test_batch_tokens_options_are_parsed_planned_and_refused():
    """Guards --batch-tokens and :batch-tokens=N: a global budget with --batch-size as its row cap, a
    --compare run's own budget without the global cap, labels that say so, and refusals."""
    from refdec.app.plan import Compared, parse_compare, plan_runs
    from refdec.errors import UsageError

    assert parse_compare("iad:batch-tokens=512,greedy:batch-size=8:batch-tokens=256") == [
        Compared("iad", None, {}, batch_tokens=512),
        Compared("greedy", None, {}, batch_size=8, batch_tokens=256),
    ]
    with pytest.raises(UsageError, match="batch-tokens must be a whole number"):
        parse_compare("iad:batch-tokens=0")
    specs = plan_runs(
        "greedy",
        "gec-uk",
        model=None,
        given={},
        batch_size=16,
        sizes=[],
        batch_tokens=1024,
        compares=parse_compare("greedy:batch-tokens=512,greedy:batch-size=4"),
    )
    assert [(s.batch_size, s.batch_tokens) for s in specs] == [(16, 1024), (0, 512), (4, 0)]
    assert [s.label for s in specs] == ["greedy", "greedy:batch-tokens=512", "greedy:batch-size=4"]
    assert [
        (s.batch_size, s.batch_tokens)
        for s in plan_runs(
            "greedy", "gec-uk", model=None, given={}, compares=[], batch_size=None, sizes=[], batch_tokens=300
        )
    ] == [(0, 300)]
    with pytest.raises(UsageError, match="leave out --batch-tokens"):
        plan_runs("greedy", "gec-uk", model=None, given={}, compares=[], batch_size=None, sizes=[1, 8], batch_tokens=64)
    cli = load_cli()
    with pytest.raises(UsageError, match="--batch-tokens 0: must be at least 1"):
        cli.run(cli.build_parser().parse_args(["--algo", "greedy", "--task", "gec-uk", "--batch-tokens", "0"]))
