"""Greedy and beam search: the baselines every other decoder is measured against."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_rows_equal, first_divergence, random_src, tiny_model

from refdec.config import BOS_ID, EOS_ID
from refdec.decoding import decode_beam, decode_greedy


@pytest.mark.parametrize("seed", range(12))
def test_beam_of_one_is_greedy(seed):
    """Guards against beam search's bookkeeping (eos handling, reordering) changing the argmax path."""
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab, norm_first=seed % 3 != 0)
    src = random_src(seed, 5, vocab)
    g = decode_greedy(m, src, max_len=25)
    b = decode_beam(m, src, max_len=25, beam_size=1, length_penalty=1.0)
    assert_rows_equal(b.tokens, g.tokens, "beam(1) against greedy", m, src)


@pytest.mark.parametrize("seed", range(12))
def test_batched_greedy_equals_one_at_a_time(seed):
    """Guards against padding leaking into attention and against dropping finished rows wrongly."""
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab)
    src = random_src(seed, 7, vocab, min_len=1, max_len=12)
    batched = decode_greedy(m, src, max_len=20)
    for b in range(7):
        alone = decode_greedy(m, src[b : b + 1, : int(src[b].ne(0).sum())], max_len=20)
        assert torch.equal(batched.tokens[b], alone.tokens[0]), first_divergence(alone.tokens[0], batched.tokens[b])


@pytest.mark.parametrize("seed", range(3))  # models whose rows finish at different steps
def test_batched_greedy_carries_finished_rows_until_a_quarter_has_finished(seed, monkeypatch):
    """Guards greedy's compaction: a finished row stays in the batch (its tokens ignored: outputs,
    stats and trace as each row alone) until finished rows are a quarter of the batch; each drop
    removes at least that many rows."""
    from refdec.cache import KVCache
    from refdec.decoding.rows import COMPACT

    vocab = 12
    m = tiny_model(seed, vocab=vocab)
    src = random_src(seed + 40, 12, vocab, min_len=1, max_len=12)
    drops = []
    select = KVCache.select

    def spy(cache, rows):
        drops.append((cache.batch, len(rows)))
        return select(cache, rows)

    monkeypatch.setattr(KVCache, "select", spy)
    batched = decode_greedy(m, src, max_len=20, trace=True)
    monkeypatch.setattr(KVCache, "select", select)
    for b in range(12):
        alone = decode_greedy(m, src[b : b + 1, : int(src[b].ne(0).sum())], max_len=20, trace=True)
        assert torch.equal(batched.tokens[b], alone.tokens[0]), first_divergence(alone.tokens[0], batched.tokens[b])
        assert batched.trace[b] == alone.trace[0]
    assert batched.stats.tokens == sum(len(t) + (len(t) < 20) for t in batched.tokens)
    assert drops and all((before - after) * COMPACT >= before for before, after in drops), drops


def exhaustive(model, src_row: torch.Tensor, max_len: int, alpha: float) -> tuple[float, list[int]]:
    """Best normalised score over every output: eos-terminated ones up to max_len, and the ones
    cut at max_len without eos (beam search treats those as finished too)."""
    V = model.cfg.vocab_size
    with torch.inference_mode():
        mem = model.encode(src_row[None])

        def logp(prefix):
            return torch.log_softmax(model(src_row[None], torch.tensor([[BOS_ID] + prefix]))[0, -1], -1)

        best = (float("-inf"), [])
        non_eos = [v for v in range(V) if v != EOS_ID]
        for n in range(max_len):  # n tokens then eos (total n + 1), or n = max_len tokens without eos
            for prefix in itertools.product(non_eos, repeat=n):
                prefix = list(prefix)
                s = sum(logp(prefix[:i])[prefix[i]].item() for i in range(n))
                end = s + logp(prefix)[EOS_ID].item()
                best = max(best, (end / (n + 1) ** alpha, prefix + [EOS_ID]))
        for prefix in itertools.product(non_eos, repeat=max_len):
            prefix = list(prefix)
            s = sum(logp(prefix[:i])[prefix[i]].item() for i in range(max_len))
            best = max(best, (s / max_len**alpha, prefix))
        del mem
    return best


@pytest.mark.parametrize("seed,alpha", [(0, 1.0), (1, 0.0), (2, 0.6), (3, 1.0), (4, 2.0)])
def test_beam_with_wide_beam_is_exhaustive_search(seed, alpha):
    """Guards against beam search's pruning or stopping rule missing the best hypothesis when the
    beam is wide enough to hold every prefix (vocabulary of 6, outputs of at most 3 tokens)."""
    m = tiny_model(seed, vocab=6, d_model=16, layers=(1, 1))
    src = random_src(seed, 1, 6, min_len=2, max_len=4)[0]
    score, best = exhaustive(m, src, 3, alpha)
    res = decode_beam(m, src[None], max_len=3, beam_size=6**3, length_penalty=alpha)
    expect = best[:-1] if best and best[-1] == EOS_ID else best
    assert res.tokens[0].tolist() == expect, (score, best)


def test_decoders_refuse_training_mode():
    """Guards against decoding with dropout on, which makes outputs random and breaks every equality."""
    m = tiny_model(0).train()
    with pytest.raises(ValueError, match="eval"):
        decode_greedy(m, random_src(0, 1, 40), max_len=5)
    with pytest.raises(ValueError, match="eval"):
        decode_beam(m, random_src(0, 1, 40), max_len=5)


def test_greedy_stats_and_trace():
    """Guards against the stats record drifting from what was decoded (the benchmarks divide by it)."""
    m = tiny_model(1, vocab=12)
    src = random_src(1, 1, 12)
    res = decode_greedy(m, src, max_len=30, trace=True)
    n = len(res.tokens[0]) + (0 if res.stats.hit_max_len else 1)  # eos counts as a decoded token
    assert res.stats.verifier_calls == n == res.stats.tokens == len(res.trace[0])
    assert res.stats.mean_committed == 1.0 and res.stats.drafter_calls == 0
    assert [s.own for s in res.trace[0]][: len(res.tokens[0])] == res.tokens[0].tolist()


def test_max_len_is_respected():
    """Guards against off-by-one in the output budget (max_len counts eos)."""
    m = tiny_model(0, vocab=40)
    src = random_src(0, 3, 40)
    for max_len in (1, 2, 7):
        for res in (decode_greedy(m, src, max_len=max_len), decode_beam(m, src, max_len=max_len, beam_size=3)):
            assert all(len(t) <= max_len for t in res.tokens)


def test_first_divergence_gives_the_margin_where_the_outputs_part():
    """Guards the failure message of every exactness test: the position and, with the model, the
    top-1/top-2 margin there, equal to the one refdec.app.exactness reports."""
    from refdec.app.exactness import divergences

    m = tiny_model(3, vocab=30)
    src = random_src(3, 1, 30, min_len=4, max_len=6)
    g = decode_greedy(m, src, max_len=12).tokens[0]
    other = g.clone()
    other[2] = (int(g[2]) + 1) % 30
    text = first_divergence(g, other, m, src)
    ids = [t for t in src[0].tolist() if t != m.cfg.pad_id][:-1]
    margin = divergences(m, [ids], [g], [other], src.device)[0]["margin_top1_top2"]
    assert "position 2" in text and f"margin {margin:.3g}" in text
    a, b = g[2:5].tolist(), other[2:5].tolist()
    assert text.startswith(f"first divergence at position 2: expected {a}, got {b}")
    with pytest.raises(AssertionError) as failed:  # the exactness tests' comparison says the same, by row
        assert_rows_equal([g, other], [g, g], "iad against greedy", m, src.expand(2, -1))
    assert str(failed.value).startswith(
        f"iad against greedy, row 1: first divergence at position 2: expected {a}, got {b}"
    )
    short = first_divergence(g, g[:2])
    assert short.startswith(f"first divergence at position 2: expected {a}, got []") and "got 2)" in short
