"""Input-guided aggressive decoding and the shared verification step: exactly greedy, in float64."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_rows_equal, copy_model, random_src, rewrite_target, tiny_model

from refdec.config import BOS_ID, EOS_ID, PAD_ID
from refdec.decoding import decode_greedy
from refdec.decoding.iad import MATCH_POLICIES, decode_iad, find_match
from refdec.decoding.verify import verify

SETTINGS = list(itertools.product(MATCH_POLICIES, (0, 1, 3), (0, 2)))  # match, max_draft, max_suffix


def src_rows(rows: list[list[int]]) -> torch.Tensor:
    """Right-padded sources from token lists (eos appended)."""
    out = torch.full((len(rows), max(map(len, rows)) + 1), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r) + 1] = torch.tensor(r + [EOS_ID])
    return out


def assert_same_as_greedy(model, src, max_len, **knobs):
    g = decode_greedy(model, src, max_len=max_len)
    r = decode_iad(model, src, max_len=max_len, **knobs)
    assert_rows_equal(r.tokens, g.tokens, f"iad {knobs} against greedy", model, src)  # the tokens first
    assert r.stats.hit_max_len == g.stats.hit_max_len
    return g, r


# -- find_match: the three policies ----------------------------------------------------------------------------
X = [BOS_ID, 10, 11, 12, 10, 11, 13, EOS_ID, PAD_ID]  # "10 11" occurs twice


def test_unique_takes_the_shortest_unique_suffix():
    assert find_match(X, [BOS_ID]) == 0  # bos aligns with x_0: the first draft is the whole source
    assert find_match(X, [BOS_ID, 12]) == 3  # 12 occurs once
    assert find_match(X, [BOS_ID, 12, 10]) == 4  # 10 is ambiguous, "12 10" is unique
    assert find_match(X, [BOS_ID, 99]) is None  # absent: a greedy step


def test_unique_gives_up_on_ambiguity_where_leftmost_does_not():
    out = [BOS_ID, 9, 10, 11]  # "10 11" twice, "9 10 11" never
    assert find_match(X, out, "unique") is None
    assert find_match(X, out, "leftmost") == 2  # leftmost occurrence of the longest ambiguous suffix
    assert find_match(X, out, "longest") == 2
    assert find_match(X, [BOS_ID, 13, 10, 11], "unique", max_suffix=2) is None  # ambiguous within 2 tokens


def test_longest_prefers_the_longer_suffix_at_its_leftmost_occurrence():
    x = [BOS_ID, 10, 11, 20, 11, 21, EOS_ID, PAD_ID]
    assert find_match(x, [BOS_ID, 10, 11], "longest") == 2  # "10 11" beats the ambiguous "11"
    assert find_match(x, [BOS_ID, 10, 11], "unique") == 2
    assert find_match(x, [BOS_ID, 99, 11], "longest") == 2  # only "11" occurs: its leftmost occurrence
    assert find_match(x, [BOS_ID, 99, 11], "longest", max_suffix=1) == 2


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="match policy"):
        find_match(X, [BOS_ID], "fuzzy")


# -- the verification step -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_verify_commits_what_greedy_would_and_trims_the_cache(seed):
    m = copy_model()
    src = src_rows([[5 + (seed + i) % 11 for i in range(9)]])
    ref = decode_greedy(m, src, max_len=20).tokens[0].tolist() + [EOS_ID]
    memory = m.encode(src)
    cache = m.new_cache(1, 32)
    m.decode(torch.tensor([[BOS_ID, ref[0]]]), memory, cache)  # prefix: bos, ref[0]; ref[1] is "last"
    cache.truncate(2)
    g = torch.Generator().manual_seed(seed)
    draft = [t if torch.rand(1, generator=g) < 0.7 else 15 for t in ref[2:8]]  # partly right, partly wrong
    v = verify(m, memory, cache, ref[1], draft, budget=30, eos_id=EOS_ID)
    assert v.tokens == ref[2 : 2 + len(v.tokens)]
    assert v.accepted == len(v.tokens) - 1 or EOS_ID in v.tokens
    assert cache.length == 2 + len(v.tokens)  # the committed output minus its new last token
    # The trimmed cache is the cache greedy would have: the next step predicts the next token.
    if v.tokens[-1] != EOS_ID:
        nxt = m.decode(torch.tensor([[v.tokens[-1]]]), memory, cache)[0, -1].argmax().item()
        assert nxt == ref[2 + len(v.tokens)]


def test_verify_cuts_at_the_budget_and_at_eos():
    m = copy_model()
    src = src_rows([[8, 9, 10, 11]])  # the model copies it: 8 9 10 11 eos
    assert decode_greedy(m, src, max_len=10).tokens[0].tolist() == [8, 9, 10, 11]
    memory = m.encode(src)
    cache = m.new_cache(1, 16)
    v = verify(m, memory, cache, BOS_ID, [8, 9, 10, 11, EOS_ID, 12, 13], budget=20, eos_id=EOS_ID)
    assert v.tokens == [8, 9, 10, 11, EOS_ID]
    cache = m.new_cache(1, 16)
    v = verify(m, memory, cache, BOS_ID, [8, 9, 10, 11, EOS_ID], budget=3, eos_id=EOS_ID)
    assert v.tokens == [8, 9, 10] and cache.length == 3
    with pytest.raises(ValueError):
        verify(m, memory, m.new_cache(1, 4), BOS_ID, [], budget=0, eos_id=EOS_ID)


# -- IAD == greedy ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("match,max_draft,max_suffix", SETTINGS)
def test_iad_equals_greedy_on_a_copying_model(seed, match, max_draft, max_suffix):
    """A model trained to copy-with-edits: long drafts, accepted and rejected, eos inside drafts."""
    m = copy_model()
    src = random_src(seed, 6, 16, min_len=1, max_len=12)
    assert_same_as_greedy(m, src, 30, match=match, max_draft=max_draft, max_suffix=max_suffix)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("match", MATCH_POLICIES)
def test_iad_equals_greedy_on_random_models(seed, match):
    """Random models rewrite their input entirely: drafts are almost always rejected at once."""
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab, norm_first=seed % 3 != 0)
    src = random_src(seed, 5, vocab)
    assert_same_as_greedy(m, src, 25, match=match)


@pytest.mark.parametrize("max_len", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("match", MATCH_POLICIES)
def test_iad_drafts_past_max_len(max_len, match):
    """Drafts longer than the budget: the output stops at max_len exactly as greedy's does."""
    m = copy_model()
    src = src_rows([[8, 9, 10, 11, 12, 13, 14, 15], [6, 8, 10, 12, 14, 6, 8]])
    g, r = assert_same_as_greedy(m, src, max_len, match=match)
    assert all(len(t) <= max_len for t in r.tokens)


@pytest.mark.parametrize("match", MATCH_POLICIES)
def test_iad_edge_sources(match):
    """Empty and one-token sources, repeated n-grams (ambiguous matches), a repeated single token."""
    rows = [[], [9], [8, 9, 8, 9, 8, 9, 8, 9], [10, 10, 10, 10, 10], [5, 7, 5, 7, 5, 7], [6, 11, 6, 11, 12, 6, 11]]
    for mdl in (copy_model(), tiny_model(3, vocab=16)):
        for max_len in (4, 20):
            assert_same_as_greedy(mdl, src_rows(rows), max_len, match=match)


def test_iad_accepts_a_verbatim_copy_in_one_call():
    """When the model's output is its input, the first draft (the whole source and its eos) is
    accepted at once: one verifier call per sentence."""
    m = copy_model()
    rows = [[8, 9, 10, 11], [12, 13, 14, 15, 8, 9], [6, 6, 8, 12, 10]]  # no 5 or 7: nothing to edit
    src = src_rows(rows)
    g = decode_greedy(m, src, max_len=20)
    copied = [b for b, r in enumerate(rows) if g.tokens[b].tolist() == r]
    assert len(copied) >= 2, "the copy model should copy these"
    for b in copied:
        r = decode_iad(m, src[b : b + 1], max_len=20)
        assert torch.equal(r.tokens[0], g.tokens[b]) and r.stats.verifier_calls == 1
        assert r.stats.committed == [len(rows[b]) + 1]


def test_iad_is_faster_in_calls_when_the_model_copies():
    """On the rewrite task most tokens are copied: far fewer verifier calls than output tokens."""
    m = copy_model()
    src = random_src(42, 30, 16, min_len=6, max_len=12)
    g = decode_greedy(m, src, max_len=30)
    r = decode_iad(m, src, max_len=30)
    right = sum(g.tokens[b].tolist() == rewrite_target(src[b][src[b] > EOS_ID].tolist()) for b in range(30))
    assert right >= 20, "the copy model should have learned the task"
    assert r.stats.verifier_calls * 2 < r.stats.tokens
    assert r.stats.mean_committed > 2


def test_iad_trace_accounts_for_every_token():
    m = copy_model()
    src = random_src(5, 4, 16, min_len=3, max_len=12)
    r = decode_iad(m, src, max_len=30, trace=True)
    for b, steps in enumerate(r.trace):
        toks = [t for s in steps for t in s.committed]
        assert toks[:-1] == r.tokens[b].tolist() and toks[-1] == EOS_ID
        assert all(s.accepted <= len(s.drafted) and s.drafted_by in ("source", "") for s in steps)


def test_iad_refuses_training_mode_and_unknown_policy():
    m = tiny_model(0)
    with pytest.raises(ValueError, match="match policy"):
        decode_iad(m, random_src(0, 1, 40), max_len=5, match="nearest")
    m.train()
    with pytest.raises(ValueError, match="eval"):
        decode_iad(m, random_src(0, 1, 40), max_len=5)
