"""Batched draft-then-verify: a KV cache with a length per row, one verification call for a whole
ragged batch, and batched IAD equal to batch-1 greedy row by row."""

from __future__ import annotations

import pytest
import torch
from conftest import alone, check_batched_iad, copy_model, invariant_copy, random_src, tiny_model

from refdec.cache import KVCache
from refdec.config import BOS_ID, EOS_ID, PAD_ID
from refdec.decoding import decode_greedy
from refdec.decoding.iad import decode_iad
from refdec.decoding.verify import verify, verify_rows
from refdec.routes import on_route


# -- the cache --------------------------------------------------------------------------------------
def test_cache_per_row_append_truncate_select():
    """Guards the per-row bookkeeping: truncate to per-row lengths makes the cache ragged (`length`
    refuses, `lengths` answers), append writes each row at its own offset, advance moves every row,
    growth keeps every row's contents, select and truncate collapse equal rows back to one length,
    a row can never grow by truncate, and clones keep their own lengths."""
    c = KVCache(n_layers=1, batch=3, n_heads=2, head_dim=4, capacity=2, dtype=torch.float64)
    k = torch.arange(3 * 2 * 5 * 4, dtype=torch.float64).view(3, 2, 5, 4)
    c.append(0, k, -k)
    c.advance(5)
    assert c.length == 5 and not c.ragged
    c.truncate([2, 5, 0])
    assert c.ragged and c.lengths.tolist() == [2, 5, 0] and c.end == 5
    with pytest.raises(ValueError, match="lengths"):
        _ = c.length
    d = c.clone()
    new = torch.full((3, 2, 3, 4), -1.0, dtype=torch.float64)
    K, V = c.append(0, new, new)  # grows capacity 5 -> 10 while ragged
    c.advance(3)
    assert K.shape == (3, 2, 8, 4) and c.lengths.tolist() == [5, 8, 3] and c.end == 8
    for b, n in enumerate([2, 5, 0]):
        assert torch.equal(K[b, :, :n], k[b, :, :n])  # kept
        assert torch.equal(K[b, :, n : n + 3], new[b])  # written at the row's own offset
        assert torch.equal(V[b, :, :n], -k[b, :, :n])
    with pytest.raises(ValueError):
        c.truncate([6, 8, 3])  # row 0 holds 5
    with pytest.raises(ValueError):
        c.truncate(4)  # row 2 holds 3
    assert d.lengths.tolist() == [2, 5, 0]  # the clone kept its own
    c.select(torch.tensor([1, 1]))
    assert not c.ragged and c.length == 8 and c.batch == 2
    d.truncate(torch.tensor([0, 0, 0]))
    assert not d.ragged and d.length == 0
    e = KVCache(1, 3, 1, 1)
    e.append(0, torch.ones(3, 1, 4, 1), torch.ones(3, 1, 4, 1))
    e.advance(4)
    e.truncate(torch.tensor([4, 1, 4]))
    e.select(torch.tensor([0, 2]))  # the remaining rows agree
    assert e.length == 4
    e.truncate(1)
    assert e.length == 1


def ragged_setup(model, src, prefix_lens, seed):
    """A batch cache whose rows hold prefixes of different lengths (a longer block decoded, then
    each row truncated to its own prefix), the stale tails overwritten with large garbage, and the
    prefixes themselves."""
    B = src.shape[0]
    g = torch.Generator().manual_seed(seed)
    width = max(prefix_lens) + 3
    tgt = torch.cat(
        [torch.full((B, 1), BOS_ID), torch.randint(5, model.cfg.vocab_size, (B, width - 1), generator=g)], 1
    )
    memory = model.encode(src)
    cache = model.new_cache(B, capacity=4)
    model.decode(tgt, memory, cache)
    cache.truncate(prefix_lens)
    for b, n in enumerate(prefix_lens):
        cache.k[:, b, :, n:] = 1e3
        cache.v[:, b, :, n:] = -1e3
    return memory, cache, tgt


@pytest.mark.parametrize("invariant", [False, True])
def test_a_rejected_tail_adds_nothing_to_the_softmax(invariant):
    """Guards the ragged attention mask and per-row positions (a rejected or stale tail that still
    entered the softmax, even as an e^0 term in the denominator, or a row positioned at the longest
    row's length): after per-row truncation, with garbage past each row's length, decoding one
    token and then three tokens per row gives each row's batch-1 logits; bitwise in row-invariant
    mode, to 1e-10 otherwise."""
    m = tiny_model(4)
    if invariant:
        m = on_route(m, "invariant")
    src = random_src(4, 4, 40)
    lens = [1, 6, 3, 9]
    with torch.inference_mode():
        memory, cache, tgt = ragged_setup(m, src, lens, 4)
        nxt = torch.randint(5, 40, (4, 4), generator=torch.Generator().manual_seed(5))
        one = m.decode(nxt[:, :1], memory, cache)  # (B, 1, V): a single query still needs the mask
        three = m.decode(nxt[:, 1:], memory, cache)
        assert cache.lengths.tolist() == [n + 4 for n in lens]
        for b, n in enumerate(lens):
            m1 = m.encode(alone(src, b))
            c1 = m.new_cache(1)
            m.decode(tgt[b : b + 1, :n], m1, c1)
            ref = m.decode(nxt[b : b + 1], m1, c1)[0]
            got = torch.cat([one[b], three[b]])
            if invariant:
                assert torch.equal(got, ref), b
            else:
                assert (got - ref).abs().max().item() < 1e-10, b


def test_each_row_is_truncated_by_its_own_rejected_count():
    """Guards the batched verification step's bookkeeping (a row whose cache length is not reduced by
    its rejected count, or is reduced by another row's): drafts of different lengths, right, partly
    right and wrong, with eos inside one and a budget cutting another; each row commits what a
    batch-1 verification commits, its cache length is its old length + its committed count, and
    the next decoder step gives each row its batch-1 logits."""
    m = copy_model()
    src = random_src(11, 5, 16, min_len=4, max_len=12)
    refs = [decode_greedy(m, alone(src, b), max_len=20).tokens[0].tolist() + [EOS_ID] for b in range(5)]
    drafts = [refs[0][:6], refs[1][:2] + [15, 15], [], refs[3][:3] + [9] + refs[3][4:], refs[4] + [8, 9]]
    budgets = [20, 20, 20, 2, 20]
    with torch.inference_mode():
        memory = m.encode(src)
        cache = m.new_cache(5, capacity=8)
        vs = verify_rows(m, memory, cache, [BOS_ID] * 5, drafts, budgets=budgets, eos_id=EOS_ID)
        singles = []
        for b in range(5):
            m1 = m.encode(alone(src, b))
            c1 = m.new_cache(1)
            v1 = verify(m, m1, c1, BOS_ID, drafts[b], budget=budgets[b], eos_id=EOS_ID)
            singles.append((m1, c1, v1))
            assert vs[b].tokens == v1.tokens and vs[b].accepted == v1.accepted, b
            assert vs[b].tokens == refs[b][: len(vs[b].tokens)]
            assert vs[b].logits.shape[0] == len(drafts[b][: budgets[b] - 1]) + 1
        assert cache.lengths.tolist() == [len(v.tokens) for v in vs]  # bos + tokens minus the new last
        assert len({len(v.tokens) for v in vs}) > 1, "the rows should commit different counts"
        nxt = m.decode(torch.tensor([[v.tokens[-1]] for v in vs]), memory, cache)[:, 0]
        for b, (m1, c1, v1) in enumerate(singles):
            ref = m.decode(torch.tensor([[v1.tokens[-1]]]), m1, c1)[0, 0]
            assert (nxt[b] - ref).abs().max().item() < 1e-10, b


# -- batched IAD == batch-1 greedy ---------------------------------------------------------------------


@pytest.mark.parametrize("batch", range(1, 18))
def test_batched_iad_equals_batch1_greedy_on_a_copying_model(batch):
    """Guards batched IAD row by row against batch-1 greedy (float64, torch.equal) for batch sizes
    1-17: ragged sources, long drafts accepted and rejected, rows finishing at different steps, eos
    inside drafts, max_draft cuts, and a small max_len that drafts run past."""
    m = copy_model()
    src = random_src(100 + batch, batch, 16, min_len=1, max_len=14)
    r = check_batched_iad(m, src, 30)
    steps = [len(t) for t in r.trace]
    if batch >= 4:
        assert len(set(steps)) > 1, "rows should finish at different steps"
    check_batched_iad(m, src, 30, max_draft=3, match="longest")
    check_batched_iad(m, src, 5)


@pytest.mark.parametrize("seed", range(4))
def test_batched_iad_equals_batch1_greedy_on_random_models(seed):
    """Guards batched IAD on models that rewrite their input (drafts rejected at once, rows of
    every length), pre- and post-norm, a few batch sizes."""
    vocab = 12 if seed % 2 else 40
    m = tiny_model(seed, vocab=vocab, norm_first=seed % 2 == 0)
    for batch in (2, 7, 13):
        check_batched_iad(m, random_src(seed * 31 + batch, batch, vocab), 25, match="leftmost")


def test_batched_iad_edge_rows():
    """Guards the edges in one batch: eos-only (empty) sources next to long ones, one-token
    sources, repeated n-grams, drafts past max_len at max_len 1-3, and max_len 0."""
    rows = [
        [],
        [9],
        [8, 9, 8, 9, 8, 9, 8, 9],
        [],
        [10, 10, 10, 10, 10],
        [5, 7, 5, 7, 5, 7],
        [6, 11, 6, 11, 12, 6, 11],
        [12, 13, 14, 15, 8, 9, 10, 11, 12, 13],
    ]
    src = torch.full((len(rows), 11), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        src[i, : len(r) + 1] = torch.tensor(r + [EOS_ID])
    for mdl in (copy_model(), tiny_model(3, vocab=16)):
        for max_len in (1, 2, 3, 20):
            for match in ("unique", "longest"):
                check_batched_iad(mdl, src, max_len, match=match)
    r = decode_iad(copy_model(), src, max_len=0)
    assert all(t.numel() == 0 for t in r.tokens) and r.stats.verifier_calls == 0


def test_batched_iad_accepts_eos_inside_a_draft():
    """Guards a row that commits its eos from inside a draft while other rows go on: the copy model
    copies these rows verbatim, each in one call, beside rows it edits."""
    m = copy_model()
    rows = [[8, 9, 10, 11], [5, 8, 7, 9, 5, 12, 13, 14], [12, 13, 14, 15, 8, 9], [6, 6, 8, 12, 10]]
    src = torch.full((4, 9), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        src[i, : len(r) + 1] = torch.tensor(r + [EOS_ID])
    r = check_batched_iad(m, src, 20)
    copied = [b for b in range(4) if r.tokens[b].tolist() == rows[b]]
    assert len(copied) >= 2
    for b in copied:
        assert len(r.trace[b]) == 1 and r.trace[b][0].committed[-1] == EOS_ID


# -- row-invariant mode: the same equality in float32 --------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2, 5, 9, 17])
def test_batched_iad_equals_batch1_greedy_in_float32_row_invariant(batch):
    """Guards the ragged batch in row-invariant mode: in float32, where a shape-dependent rounding
    would show, batched IAD equals batch-1 greedy with torch.equal (padded drafts, per-row positions
    and masks change no position's logits)."""
    m = invariant_copy(copy_model(), torch.float32)
    src = random_src(200 + batch, batch, 16, min_len=0 if batch > 2 else 1, max_len=12)
    check_batched_iad(m, src, 24)
    check_batched_iad(m, src, 4, match="longest")
