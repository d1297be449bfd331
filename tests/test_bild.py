"""Big-little decoding and speculative sampling: their greedy limits are greedy decoding of the large
model exactly (float64), and speculative sampling keeps the large model's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rows_equal, copy_model, random_src, shared_small, tiny_model

from refdec.adapters import early_exit_hidden
from refdec.decoding import decode_greedy
from refdec.decoding.bild import decode_bild
from refdec.decoding.sampling import distribution, nucleus
from refdec.decoding.speculative import decode_speculative


def pair(seed: int, vocab: int = 12):
    large = tiny_model(seed, vocab=vocab, layers=(2, 3))
    small = tiny_model(seed + 100, vocab=vocab, d_model=16, layers=(1, 1))
    return large, small


def assert_greedy_of_large(large, out, src, max_len):
    g = decode_greedy(large, src, max_len=max_len)
    assert_rows_equal(out.tokens, g.tokens, "against greedy of the large model", large, src)


@pytest.mark.parametrize("seed", range(8))
def test_bild_falling_back_at_every_step_is_greedy_of_the_large_model(seed):
    vocab = 12 if seed % 2 else 40
    large, small = pair(seed, vocab)
    src = random_src(seed, 4, vocab)
    r = decode_bild(large, small, src, max_len=20, fallback_threshold=1.5)
    assert_greedy_of_large(large, r, src, 20)
    assert r.stats.rollbacks == 0 and r.stats.committed == [1] * r.stats.tokens  # one greedy token per row per call


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("window", [1, 3, 10])
def test_bild_rolling_back_every_small_token_is_greedy_of_the_large_model(seed, window):
    """A rollback threshold below zero rejects every small-model token: each large call commits one
    greedy token, after the small model's caches were truncated and caught up again and again."""
    large, small = pair(seed)
    src = random_src(seed, 3, 12)
    r = decode_bild(
        large, small, src, max_len=20, fallback_threshold=0.0, rollback_threshold=-1.0, max_window=window, trace=True
    )
    g = decode_greedy(large, src, max_len=20)
    for b, steps in enumerate(r.trace):
        checked = [s for s in steps if s.verified]
        assert all(s.accepted == 0 and (s.rollback or not s.drafted) for s in checked)
        n = len(checked)  # one large-model (greedy) token per call; an unchecked small run may follow
        full = r.tokens[b].tolist() + ([2] if len(r.tokens[b]) < 20 else [])
        assert full[:n] == (g.tokens[b].tolist() + [2])[:n]
        if n == len(full):  # the large model wrote the whole sentence: it is greedy's
            assert torch.equal(r.tokens[b], g.tokens[b])


@pytest.mark.parametrize("seed", range(6))
def test_bild_with_the_large_model_as_small_model_is_its_greedy_output(seed):
    """Small == large: every small token passes, the large model adds its bonus token, and the two
    caches stay in step through accept-everything iterations (eos written by the small model ends
    the sentence, which is greedy's eos too)."""
    m = copy_model()
    src = random_src(seed, 4, 16, max_len=12)
    r = decode_bild(m, m, src, max_len=30, fallback_threshold=0.0, rollback_threshold=1e9, max_window=4)
    assert_greedy_of_large(m, r, src, 30)
    assert r.stats.rollbacks == 0


def test_bild_stats_and_trace_account_for_every_token():
    large, small = pair(3)
    src = random_src(3, 4, 12)
    r = decode_bild(large, small, src, max_len=20, fallback_threshold=0.3, rollback_threshold=2.0, trace=True)
    for b, steps in enumerate(r.trace):
        produced = sum(len(s.committed) for s in steps)
        assert produced == len(r.tokens[b]) + (len(r.tokens[b]) < 20)  # + the eos
    assert (
        r.stats.fallbacks == len(r.stats.committed) and r.stats.drafter_calls > 0
    )  # a fallback per row per large call


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_speculative_decoding_is_greedy_of_the_large_model(seed, gamma):
    vocab = 12 if seed % 2 else 40
    large, small = pair(seed, vocab)
    src = random_src(seed, 4, vocab)
    for max_len in (3, 20):
        assert_greedy_of_large(large, decode_speculative(large, small, src, max_len=max_len, gamma=gamma), src, max_len)


def test_greedy_speculative_decoding_with_a_good_drafter_saves_calls():
    m = copy_model()
    src = random_src(1, 6, 16, max_len=12)
    r = decode_speculative(m, m, src, max_len=30, gamma=4)
    assert_greedy_of_large(m, r, src, 30)
    assert r.stats.verifier_calls * 3 < r.stats.tokens


@pytest.mark.slow  # 3000 Monte Carlo draws
def test_speculative_sampling_keeps_the_large_models_distribution():
    """The first two output tokens, drawn 3000 times: their joint distribution under speculative
    sampling matches sampling from the large model, to within Monte Carlo error."""
    large, small = pair(5, vocab=8)
    src = random_src(5, 1, 8, min_len=3, max_len=3)
    with torch.inference_mode():
        mem = large.encode(src)
        cache = large.new_cache(1, 4)
        p1 = distribution(large.decode(torch.tensor([[1]]), mem, cache)[0, -1])
        exact = {}
        for t in range(8):
            c = cache.clone()
            p2 = distribution(large.decode(torch.tensor([[t]]), mem, c)[0, -1])
            for u in range(8):
                exact[(t, u)] = float(p1[t] * p2[u])
    counts: dict = {}
    n = 3000
    for s in range(n):
        out = decode_speculative(large, small, src, max_len=2, gamma=3, sample=True, seed=s).tokens[0].tolist()
        key = tuple((out + [2, 2])[:2])  # eos (2) where the sentence ended early
        counts[key] = counts.get(key, 0) + 1
    # eos ends a sentence: fold the exact mass of (2, anything) into (2, 2)
    folded = {}
    for (t, u), pr in exact.items():
        k = (t, 2) if t == 2 else (t, u)
        folded[k] = folded.get(k, 0.0) + pr
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - folded.get(k, 0.0)) for k in set(counts) | set(folded))
    assert tv < 0.05, tv  # measured 0.015; drafting from the small model alone gives 0.94


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    assert nucleus(p, 0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert nucleus(p, 0.5).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert torch.equal(nucleus(p, 1.0), p)


def test_bild_sampling_is_seeded():
    large, small = pair(2)
    src = random_src(2, 3, 12)
    a = decode_bild(large, small, src, max_len=15, sample=True, top_p=0.9, seed=7)
    b = decode_bild(large, small, src, max_len=15, sample=True, top_p=0.9, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))


def test_mismatched_vocabularies_are_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        decode_bild(tiny_model(0, vocab=12), tiny_model(1, vocab=40), random_src(0, 1, 12), max_len=5)


def test_early_exit_is_the_first_layers_with_the_shared_head():
    """The early-exit small model's cached decoding equals the first layers of the teacher-forced
    model through the shared norm and projection, and BiLD over it falls back to the full model."""
    from refdec.adapters import EarlyExit

    m = tiny_model(4, vocab=40, layers=(2, 3))
    small = EarlyExit(m, 1)
    src = random_src(4, 1, 40, min_len=5, max_len=5)
    tgt = torch.tensor([[1, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        _, early = early_exit_hidden(m, src, tgt, 1)
        ref = m.project(early)
        cache = small.new_cache(1, 8)
        got = torch.cat(
            [small.decode(tgt[:, :2], small.encode(src), cache), small.decode(tgt[:, 2:], small.encode(src), cache)],
            dim=1,
        )
    assert torch.allclose(got, ref, atol=1e-10) and cache.length == 6
    r = decode_bild(m, small, random_src(4, 3, 40), max_len=15, fallback_threshold=1.5)
    assert_greedy_of_large(m, r, random_src(4, 3, 40), 15)
    assert r.stats.encoder_calls == 1  # the early exit reads the large model's encoder output
    with pytest.raises(ValueError):
        EarlyExit(m, 3)


def test_shared_encoder_small_model_decodes_like_its_teacher_forced_self():
    """The decoder on the large model's encoder: cached decoding over the memory built from the
    large model's (memory_from) equals its uncached forward, which reads the same encoder states."""
    large = tiny_model(5, vocab=40, layers=(2, 3))
    small = shared_small(large)
    assert small.small.encoder is not None and len(small.small.encoder) == 0
    src = random_src(5, 1, 40, min_len=6, max_len=6)
    tgt = torch.tensor([[1, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        ref = small(src, tgt)
        memory = small.memory_from(large.encode(src))
        cache = small.new_cache(1, 8)
        got = torch.cat([small.decode(tgt[:, :1], memory, cache), small.decode(tgt[:, 1:], memory, cache)], dim=1)
    assert torch.allclose(got, ref, atol=1e-10) and cache.length == 6
    with pytest.raises(ValueError, match="no encoder"):
        small.small.encode(src)


@pytest.mark.parametrize("seed", range(6))
def test_bild_and_speculative_with_a_shared_encoder_small_model_are_greedy_of_the_large_model(seed):
    """Its greedy limits are greedy of the large model exactly (float64), and paired with that large
    model the encoder runs once."""
    large = tiny_model(seed, vocab=12, layers=(2, 3))
    small = shared_small(large, seed + 50)
    src = random_src(seed, 4, 12)
    r = decode_bild(large, small, src, max_len=20, fallback_threshold=1.5)
    assert_greedy_of_large(large, r, src, 20)
    assert r.stats.encoder_calls == 1
    s = decode_speculative(large, small, src, max_len=20, gamma=3)
    assert_greedy_of_large(large, s, src, 20)
    assert s.stats.encoder_calls == 1
    # with another large model it reads its own encoder: still exact, two encoder calls
    other = tiny_model(seed + 1, vocab=12, layers=(2, 3))
    s = decode_speculative(other, small, src, max_len=20, gamma=2)
    assert_greedy_of_large(other, s, src, 20)
    assert s.stats.encoder_calls == 2


def test_a_shared_encoder_needs_a_decoder_of_the_encoders_width():
    from refdec.adapters import SharedEncoder
    from refdec.config import ModelConfig
    from refdec.model import Transformer

    large = tiny_model(1, vocab=12)
    with pytest.raises(ValueError, match="width"):
        SharedEncoder(shared_small(large).small, tiny_model(2, vocab=12, d_model=16))
    with pytest.raises(ValueError, match="without an encoder"):
        SharedEncoder(large, large)
    with pytest.raises(ValueError, match="d_memory"):
        ModelConfig(vocab_size=12, d_model=16, n_heads=2, enc_layers=1, d_memory=32)
    assert (
        Transformer(ModelConfig(vocab_size=12, d_model=16, n_heads=2, enc_layers=0, d_memory=32)).cfg.memory_dim == 32
    )
