"""GAD's block drafter and decoder: drafts as trained, GAD == greedy of the verifier (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_rows_equal, random_src, shared_small, tiny_model

from refdec.commands.fuzz import gadpp_rule_at_exact
from refdec.config import BOS_ID, EOS_ID, MASK_ID, PAD_ID
from refdec.decoding import decode_greedy
from refdec.decoding import gad as gad_module
from refdec.decoding.gad import decode_gad, gadpp_rule
from refdec.drafter import Drafter, block_batch, draft_block, glance, glancing_ratio


def assert_greedy(verifier, res, src, max_len):
    g = decode_greedy(verifier, src, max_len=max_len)
    assert_rows_equal(res.tokens, g.tokens, "gad against greedy of the verifier", verifier, src)
    return g


def test_block_batch_layouts():
    inp, gold, blocked = block_batch([[7, 8, 9], [5]], k=3, prefix_lens=[2, 0], layout="causal")
    assert inp[0].tolist() == [BOS_ID, 7, 8, MASK_ID, MASK_ID, MASK_ID]
    assert gold[0].tolist() == [PAD_ID] * 3 + [9, EOS_ID, PAD_ID]  # the sentence ends inside the block
    assert inp[1].tolist()[:4] == [BOS_ID, MASK_ID, MASK_ID, MASK_ID] and gold[1].tolist()[1:3] == [5, EOS_ID]
    b = blocked[0, 0]
    assert b[1, 2] and b[1, 3]  # a prefix position sees neither later prefix tokens nor the masks
    assert not b[3, 5] and not b[5, 0] and not b[4, 3]  # masks see each other and the prefix
    _, _, full = block_batch([[7, 8, 9]], k=3, prefix_lens=[2], layout="bidirectional")
    assert not full[0, 0, :6, :6].any()
    with pytest.raises(ValueError):
        block_batch([[7]], 2, [0], "sideways")


def test_glancing_reveals_in_proportion_to_mistakes():
    inp = torch.tensor([[BOS_ID, MASK_ID, MASK_ID, MASK_ID, MASK_ID]])
    gold = torch.tensor([[PAD_ID, 5, 6, 7, 8]])
    pred = torch.tensor([[0, 5, 9, 9, 9]])  # 3 wrong
    new, target = glance(inp, gold, pred, 0.5, torch.Generator().manual_seed(0))
    revealed = new.ne(MASK_ID) & gold.ne(PAD_ID)
    assert int(revealed.sum()) == 2  # ceil(0.5 x 3)
    assert torch.equal(new[revealed], gold[revealed]) and (target[revealed] == PAD_ID).all()
    same, _ = glance(inp, gold, gold, 0.5)
    assert torch.equal(same, inp)  # nothing wrong, nothing revealed
    assert glancing_ratio(0, 0.5, 0.3, 100) == 0.5 and glancing_ratio(50, 0.5, 0.3, 100) == pytest.approx(0.4)
    assert glancing_ratio(500, 0.5, 0.3, 100) == pytest.approx(0.3)


@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
@pytest.mark.parametrize("seed", range(4))
def test_drafting_matches_the_training_layout_and_the_cache_is_exact(layout, seed):
    """What the drafter sees at decoding time is what it was trained on (block_batch's mask through
    forward_hidden), and the causal layout's cache reused across iterations drafts what a fresh
    computation drafts."""
    m = tiny_model(seed, vocab=16)
    src = random_src(seed, 1, 16, min_len=4, max_len=8)
    memory = m.encode(src)
    y = torch.randint(5, 16, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = m.new_cache(1, 32)
    for p in (0, 1, 2, 5, 9):
        seq = [BOS_ID] + y[:p]
        drafted = draft_block(m, memory, cache, seq, 4, layout)
        inp, _, blocked = block_batch([y], 4, [p], layout)
        ref = m.project(m.forward_hidden(src, inp, blocked))[0, 1 + p : 1 + p + 4].argmax(-1).tolist()
        assert drafted == ref
        if layout == "causal":
            assert cache.length == len(seq)


@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_drafting_stops_where_the_drafters_positions_end(layout):
    m = tiny_model(0, vocab=16, max_positions=12)
    memory = m.encode(random_src(0, 1, 16))
    seq = [BOS_ID] + [5] * 8  # 9 of 12 positions used: room for 3 masks
    assert len(draft_block(m, memory, m.new_cache(1, 16), seq, 5, layout)) == 3
    assert draft_block(m, memory, m.new_cache(1, 16), seq + [6] * 3, 5, layout) == []


def oracle(greedy_out: list[int], k: int, wrong: bool, vocab: int):
    """A drafter that knows the verifier's greedy output (or always misses its next token)."""

    def draft(drafter, memory, cache, sequences, kk, layout):
        blocks = []
        for sequence in sequences:
            j = len(sequence) - 1
            block = (greedy_out + [EOS_ID] * kk)[j : j + kk]
            blocks.append([(t + 1) % vocab for t in block] if wrong else block)
        return blocks

    return draft


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_gad_with_a_random_drafter_is_greedy(seed, k, layout):
    vocab = 12 if seed % 2 else 40
    verifier = tiny_model(seed, vocab=vocab)
    drafter = tiny_model(seed + 50, vocab=vocab, layers=(1, 2))
    src = random_src(seed, 3, vocab)
    for max_len in (2, 20):
        assert_greedy(
            verifier, decode_gad(verifier, Drafter(drafter, k=k, layout=layout), src, max_len=max_len), src, max_len
        )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [2, 5, 25])
@pytest.mark.parametrize("wrong", [False, True])
def test_gad_with_always_right_and_always_wrong_drafters(monkeypatch, seed, k, wrong):
    vocab = 12 if seed % 2 else 40
    verifier = tiny_model(seed, vocab=vocab)
    src = random_src(seed, 1, vocab)
    g = decode_greedy(verifier, src, max_len=30).tokens[0].tolist()
    monkeypatch.setattr(gad_module, "draft_blocks", oracle(g, k, wrong, vocab))
    r = decode_gad(verifier, Drafter(verifier, k=1), src, max_len=30, block_size=k)  # block_size over the trained k
    assert_greedy(verifier, r, src, 30)
    produced = r.stats.tokens
    if wrong:
        assert r.stats.verifier_calls == produced  # one token per call
    else:
        assert r.stats.verifier_calls == -(-produced // (k + 1))  # k drafted + the free token per call


@pytest.mark.parametrize("seed", range(6))
def test_gadpp_with_beta_1_tau_0_is_gad(seed):
    verifier = tiny_model(seed, vocab=40)
    drafter = Drafter(tiny_model(seed + 9, vocab=40), k=4)
    src = random_src(seed, 3, 40)
    a = decode_gad(verifier, drafter, src, max_len=20)
    with gadpp_rule_at_exact():
        b = decode_gad(verifier, drafter, src, max_len=20)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    loose = decode_gad(verifier, drafter, src, max_len=20, top_beta=40, tau=1e9)
    assert loose.stats.verifier_calls <= a.stats.verifier_calls  # accepts every draft


def test_gadpp_rule_and_stats():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]], dtype=torch.float64))
    rule = gadpp_rule(top_beta=2, tau=0.6)
    assert rule(logits, torch.tensor([1, 2])).tolist() == [True, False]  # 0.3 within 0.6 nats; 0.2 not top-2
    with pytest.raises(ValueError):
        gadpp_rule(0, 0)
    m = tiny_model(0, vocab=12)
    with pytest.raises(ValueError, match="layout"):
        Drafter(m, k=3, layout="sideways")
    with pytest.raises(ValueError, match="at least 1"):
        Drafter(m, k=0)
    r = decode_gad(m, Drafter(m, k=3), random_src(0, 2, 12), max_len=10)
    assert set(r.stats.module_seconds) == {"verifier encoder", "drafter encoder", "drafter decoder", "verifier decoder"}
    assert r.stats.drafter_calls == r.stats.verifier_calls


def test_glancing_counts_per_row_as_math_ceil_does():
    """Every row reveals ceil(ratio x its mistakes) block positions, chosen in one pass for the batch
    (no per-row device round trips); rows with no mistakes keep all their masks."""
    B, k = 6, 10
    inp = torch.full((B, 1 + k), MASK_ID)
    inp[:, 0] = BOS_ID
    gold = torch.cat([torch.full((B, 1), PAD_ID), torch.arange(5, 5 + k).repeat(B, 1)], dim=1)
    gold[5, 4:] = PAD_ID  # a block cut short by the end of the sentence
    pred = gold.clone()
    wrong = [0, 1, 3, 7, 10, 3]
    for r, w in enumerate(wrong):
        pred[r, 1 : 1 + w] = 99
    new, target = glance(inp, gold, pred, 0.3, torch.Generator().manual_seed(1))
    revealed = new.ne(MASK_ID) & gold.ne(PAD_ID)
    assert revealed.sum(dim=1).tolist() == [math.ceil(0.3 * w) for w in wrong]
    assert torch.equal(new[revealed], gold[revealed]) and (target[revealed] == PAD_ID).all()
    assert torch.equal(target[~revealed], gold[~revealed])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_gad_with_a_drafter_on_the_verifiers_encoder_is_greedy(seed, layout):
    """A drafter without an encoder of its own (SharedEncoder over the verifier): GAD is still the
    verifier's greedy output, the encoder runs once per batch for both, and what it drafts at decoding
    time is what its training layout computes on the same encoder states."""
    vocab = 12 if seed % 2 else 40
    verifier = tiny_model(seed, vocab=vocab, layers=(2, 2))
    drafter = shared_small(verifier, seed=seed + 30)
    src = random_src(seed, 3, vocab)
    for k in (1, 4, 9):
        r = decode_gad(verifier, Drafter(drafter, k=k, layout=layout), src, max_len=20)
        assert_greedy(verifier, r, src, 20)
        assert r.stats.encoder_calls == 1
    one = src[:1]
    memory = drafter.memory_from(verifier.encode(one))
    y = torch.randint(5, vocab, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = drafter.new_cache(1, 32)
    for p in (0, 3, 7):
        drafted = draft_block(drafter, memory, cache, [BOS_ID] + y[:p], 4, layout)
        inp, _, blocked = block_batch([y], 4, [p], layout)
        states, src_pad = verifier.encode_states(one)
        hidden = drafter.small.forward_hidden(one, inp, blocked, memory=drafter.small.attach(states, src_pad))
        assert drafted == drafter.project(hidden)[0, 1 + p : 1 + p + 4].argmax(-1).tolist()
