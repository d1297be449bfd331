"""Blockwise parallel decoding with the combined scoring and proposal model: exact mode == greedy."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_rows_equal, copy_model, random_heads, random_src, tiny_model

from refdec.decoding import decode_greedy
from refdec.decoding.blockwise import accept_rule, decode_blockwise
from refdec.proposal import ProposalHeads, head_targets
from refdec.training import smoothed_loss


def constant_model(token: int = 7) -> torch.nn.Module:
    """A model whose final decoder state is a constant vector (the last norm's scale is 0), so its
    greedy output is `token` at every position: proposals can be made exactly right or wrong."""
    m = tiny_model(0, vocab=12)
    with torch.no_grad():
        m.dec_norm.weight.zero_()
        m.dec_norm.bias.copy_(3 * m.out_proj.weight[token])
    assert m.project(m.dec_norm.bias[None, None])[0, 0].argmax().item() == token
    return m


def steering_heads(model, k: int, right: bool) -> ProposalHeads:
    """Heads whose outputs are fixed vectors: p_1's own state (always right for constant_model) or
    its negation (never right)."""
    h = ProposalHeads(model.cfg.d_model, 8, k).double()
    beta = model.dec_norm.bias.detach()
    with torch.no_grad():
        h.w2.bias.copy_((torch.zeros_like(beta) if right else -2 * beta).repeat(k - 1))
    return h.eval()


def assert_same_as_greedy(model, heads, src, max_len, **kw):
    g = decode_greedy(model, src, max_len=max_len)
    r = decode_blockwise(model, heads, src, max_len=max_len, **kw)
    assert_rows_equal(r.tokens, g.tokens, f"blockwise {kw} against greedy", model, src)  # the tokens first
    assert r.stats.hit_max_len == g.stats.hit_max_len
    return r


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_exact_blockwise_equals_greedy_with_random_heads(seed, k):
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab, norm_first=seed % 3 != 0)
    assert_same_as_greedy(m, random_heads(m, k, seed), random_src(seed, 4, vocab), 25)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [2, 4, 6])
def test_exact_blockwise_equals_greedy_on_a_copying_model(seed, k):
    """Outputs that end in eos inside a block, with proposals sometimes right."""
    m = copy_model()
    for max_len in (3, 30):
        assert_same_as_greedy(m, random_heads(m, k, seed), random_src(seed, 5, 16, max_len=12), max_len)


@pytest.mark.parametrize("k", [2, 3, 4, 7])
@pytest.mark.parametrize("max_len", [1, 2, 9, 20])
def test_perfect_proposals_take_m_over_k_plus_one_calls(k, max_len):
    m = constant_model()
    src = random_src(0, 1, 12)
    r = assert_same_as_greedy(m, steering_heads(m, k, right=True), src, max_len)
    assert r.tokens[0].tolist() == [7] * max_len
    assert r.stats.verifier_calls == 1 + math.ceil((max_len - 1) / k)  # call 1 has nothing to verify


@pytest.mark.parametrize("k", [2, 5])
def test_wrong_proposals_take_one_call_per_token(k):
    m = constant_model()
    r = assert_same_as_greedy(m, steering_heads(m, k, right=False), random_src(0, 1, 12), 12)
    assert r.stats.verifier_calls == 12 and r.stats.committed == [1] * 12


def test_top_k_and_min_block_are_lossy_but_run():
    m = constant_model()
    wrong = steering_heads(m, 4, right=False)
    r = decode_blockwise(m, wrong, random_src(0, 1, 12), max_len=12, min_block=3)
    assert r.stats.verifier_calls < 12  # forced acceptance: at least 3 tokens per call after the first
    assert r.tokens[0].tolist() != [7] * 12  # and the wrong proposals are in the output
    top = decode_blockwise(m, wrong, random_src(0, 1, 12), max_len=12, block_rule="top-k", top_k=12)
    assert top.stats.verifier_calls == 1 + math.ceil(11 / 4)  # top-12 of 12 tokens accepts anything


def test_distance_rule_accepts_near_numbers_only():
    values = torch.full((12,), float("nan"))
    values[5:9] = torch.tensor([1.0, 2.0, 3.0, 10.0])  # ids 5..8 are the numbers 1, 2, 3, 10
    rule = accept_rule("distance", values=values, epsilon=1.0)
    logits = torch.zeros(4, 12)
    logits[:, 6] = 1.0  # p_1's argmax is id 6 (= 2) everywhere
    ok = rule(logits, torch.tensor([6, 7, 8, 9]))  # same, 3 (near), 10 (far), a non-number
    assert ok.tolist() == [True, True, False, False]
    with pytest.raises(ValueError):
        accept_rule("distance")
    with pytest.raises(ValueError):
        accept_rule("fuzzy")


def test_heads_start_as_copies_of_p1_and_need_k_of_two():
    h = ProposalHeads(8, 4, 3)
    x = torch.randn(2, 5, 8)
    out = h(x)
    assert out.shape == (2, 5, 3, 8) and torch.equal(out[:, :, 0], x) and torch.equal(out[:, :, 2], x)
    with pytest.raises(ValueError):
        ProposalHeads(8, 4, 1)


def test_far_heads_on_short_targets_get_pad_targets_and_no_loss():
    """Head i predicts the token i - 1 steps ahead; a batch shorter than that has nothing for it to
    learn: its targets keep the batch's shape, all pad, and the loss is 0 rather than NaN."""
    t = torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]])
    assert torch.equal(head_targets(t, 1), t)
    assert head_targets(t, 2).tolist() == [[6, 7, 2, 0], [2, 0, 0, 0]]
    for i in (5, 9):
        assert torch.equal(head_targets(t, i), torch.zeros_like(t))
    logits = torch.randn(2, 4, 10, requires_grad=True)
    loss = smoothed_loss(logits, head_targets(t, 9), 0.1, 0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [2, 3, 5])
def test_a_smaller_block_uses_the_first_heads_and_stays_exact(seed, block_size):
    """block_size K < heads.k decodes with p_1 and the first K - 1 heads: still greedy, and with
    always-right heads m/K + 1 calls (the other heads are never read)."""
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab)
    assert_same_as_greedy(m, random_heads(m, 6, seed), random_src(seed, 3, vocab), 25, block_size=block_size)
    c = constant_model()
    r = assert_same_as_greedy(c, steering_heads(c, 6, right=True), random_src(0, 1, 12), 20, block_size=block_size)
    assert r.stats.verifier_calls == 1 + math.ceil(19 / block_size)  # call 1 has nothing to verify
    with pytest.raises(ValueError, match="block size"):
        decode_blockwise(m, random_heads(m, 4, seed), random_src(seed, 1, vocab), max_len=5, block_size=5)
