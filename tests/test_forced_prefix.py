"""Forced decoder tokens (ModelConfig.decoder_prefix, an imported model's language code) under the
decoders that cut a cache back per row or run a companion model near its last position: tiny float64
random models, no downloads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import alone, random_src, tiny_model

from refdec.config import BOS_ID
from refdec.decoding import decode_bild, decode_gad, decode_greedy
from refdec.drafter import Drafter, draft_blocks
from refdec.model import Transformer
from refdec.routes import on_route


def prefixed(seed: int, prefix: tuple[int, ...], **shape) -> Transformer:
    """tiny_model(seed, **shape) with forced decoder tokens `prefix` after its start token."""
    plain = tiny_model(seed, **shape)
    model = Transformer(replace(plain.cfg, decoder_prefix=prefix)).double().eval()
    model.load_state_dict(plain.state_dict())
    return model


def test_a_row_cut_back_to_nothing_restarts_after_its_forced_tokens():
    """Guards the hidden prefix of a ragged cache: a row truncated to length 0 while another keeps its
    positions still holds the start token and forced tokens, so the start token fed to it again
    must give the logits of a fresh start (the bug fed it without its forced token)."""
    m = prefixed(0, (9, 11))
    src = random_src(0, 2, 40)
    tgt = torch.tensor([[BOS_ID, 12, 13, 14], [BOS_ID, 15, 16, 17]])
    with torch.inference_mode():
        memory = m.encode(src)
        cache = m.new_cache(2)
        m.decode(tgt, memory, cache)
        cache.truncate([0, 2])
        got = m.decode(torch.tensor([[BOS_ID, 12], [16, 17]]), memory, cache)  # (2, 2, V)
        fresh = m(alone(src, 0), tgt[:1, :2])[0]  # the uncached reference
        kept = m(alone(src, 1), tgt[1:])[0, 2:]
    torch.testing.assert_close(got[0], fresh, rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], kept, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_batched_bild_with_a_prefixed_small_model_equals_each_row_alone(seed):
    """Guards batched BiLD whose small model has forced tokens: a row that falls back before writing
    anything is cut back to length 0 while other rows keep theirs, and must go on from the state a
    fresh start gives it (the bug dropped its forced token, and the row decoded from a wrong state).
    Row-invariant compute makes each row's batched logits bitwise its logits alone. Rows decoded
    alone never share a cache, so the bug left them equal to a fresh start."""
    large = on_route(prefixed(seed, (9,), layers=(1, 2)), "invariant")
    small = on_route(prefixed(100 + seed, (9,), layers=(1, 1)), "invariant")
    src = random_src(seed, 6, 40)
    with torch.inference_mode():  # the small model's first confidence per row: half the rows fall back at once
        first_p = [
            float(
                small.decode(torch.tensor([[BOS_ID]]), small.encode(alone(src, b)), small.new_cache(1))
                .softmax(-1)
                .max()
            )
            for b in range(src.shape[0])
        ]
    # No rollback: every small-model token is kept, so the output shows the small model's state.
    knobs = dict(
        max_len=12, fallback_threshold=sorted(first_p)[3], rollback_threshold=float("inf"), max_window=4, trace=True
    )
    batched = decode_bild(large, small, src, **knobs)
    singles = [decode_bild(large, small, alone(src, b), **knobs) for b in range(src.shape[0])]
    first = [one.trace[0][0].drafted for one in singles]  # what the small model wrote before its first fallback
    assert any(d == () for d in first) and any(d != () for d in first), first  # the case the bug needs
    for b, one in enumerate(singles):
        assert torch.equal(batched.tokens[b], one.tokens[0]), (b, batched.tokens[b].tolist(), one.tokens[0].tolist())


@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_gad_near_max_positions_with_a_prefixed_drafter_is_greedy(layout):
    """Guards the drafter's block against the hidden forced positions: near max_positions it drafts
    fewer tokens (the bug raised "sequence of N positions exceeds max_positions"), and GAD stays
    greedy's output, batched and alone."""
    prefix = (9, 11)
    verifier = prefixed(1, prefix, max_positions=16)
    drafter = Drafter(prefixed(2, prefix, max_positions=16), k=4, layout=layout)
    max_len = 16 - len(prefix)  # greedy's longest output: the start token and prefix fill the rest
    src = random_src(1, 4, 40)
    greedy = decode_greedy(verifier, src, max_len=max_len)
    assert max(len(t) for t in greedy.tokens) >= max_len - 1  # outputs reach the last positions
    gad = decode_gad(verifier, drafter, src, max_len=max_len)
    for b in range(src.shape[0]):
        assert torch.equal(gad.tokens[b], greedy.tokens[b]), b
        assert torch.equal(decode_gad(verifier, drafter, alone(src, b), max_len=max_len).tokens[0], greedy.tokens[b])


def test_the_drafter_counts_its_forced_positions():
    """draft_blocks at the drafter's last positions: the block shrinks by the hidden forced tokens,
    and a sequence that fills every position drafts nothing."""
    prefix = (9, 11)
    model = prefixed(2, prefix, max_positions=12)
    room = 12 - len(prefix)
    src = random_src(2, 2, 40)
    with torch.inference_mode():
        memory = model.encode(src)
        seqs = [[BOS_ID] + [20] * (room - 3), [BOS_ID] + [21] * (room - 1)]
        cache = model.new_cache(2)
        blocks = draft_blocks(model, memory, cache, seqs, 4, "causal")
        assert [len(b) for b in blocks] == [2, 0]
        assert [len(b) for b in draft_blocks(model, memory, None, seqs, 4, "bidirectional")] == [2, 0]
