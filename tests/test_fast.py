"""The fast route (refdec.routes.fast): the same mathematics as the reference route within float64 rounding,
every lossless decoder on it equal to greedy on it (float64, torch.equal, batch sizes 1-17, ragged
sources, adversarial drafts), the switch per model and reversible, packed weights that follow every
weight change, and the reference route wherever the fast route does not apply."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import assert_rows_equal, check_lossless_decoders, random_src, tiny_model
from refdec.config import BOS_ID
from refdec.decoding import decode_beam, decode_greedy, decode_iad
from refdec.routes.fast import FastTransformer, applies_to, is_fast, set_fast_route
from refdec.routes.kernels import RoutedTransformer, set_row_invariant
from refdec.model import Transformer

TOL = 1e-12  # float64: the two routes sum in different orders


def fast_copy(model: Transformer) -> Transformer:
    m = copy.deepcopy(model)
    assert set_fast_route(m) == 1
    return m


def both(model: Transformer, fn):
    """fn(model) on the reference route and on the fast route of a copy."""
    with torch.no_grad():
        return fn(model), fn(fast_copy(model))


# -- the same mathematics -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_encoder_and_cross_attention_memory_match_the_reference(seed):
    m = tiny_model(seed, norm_first=seed % 2 == 0, tie=seed >= 2)
    src = random_src(seed, 6, 40)
    ref, fast = both(m, lambda mm: mm.encode(src))
    assert (ref.states - fast.states).abs().max() < TOL
    assert torch.equal(ref.src_pad, fast.src_pad)
    for (k0, v0), (k1, v1) in zip(ref.cross_kv, fast.cross_kv):
        assert k0.shape == k1.shape and (k0 - k1).abs().max() < TOL and (v0 - v1).abs().max() < TOL


@pytest.mark.parametrize("seed", range(4))
def test_decoder_calls_match_the_reference_uniform_and_ragged(seed):
    """One token, k tokens at once, then a ragged cache (per-row lengths) with right-padded rows
    (`real`): logits within float64 rounding of the reference route's, caches in the same state."""
    m = tiny_model(seed, norm_first=seed % 2 == 0, tie=seed % 3 == 0)
    f = fast_copy(m)
    src, B = random_src(seed + 10, 5, 40), 5
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(5, 40, (B, 4), generator=g)
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        mems, caches = (m.encode(src), f.encode(src)), (m.new_cache(B), f.new_cache(B))
        for step in (tgt, tgt[:, :1]):
            a, b = (mm.decode(step, mem, c) for mm, mem, c in zip((m, f), mems, caches))
            assert a.shape == b.shape and (a - b).abs().max() < TOL
        lengths = torch.tensor([1, 2, 3, 4, 5])
        real = torch.tensor([3, 1, 2, 3, 2])
        for c in caches:
            c.truncate(lengths)
        a, b = (mm.project(mm.decode_hidden(tgt[:, 1:], mem, c, real=real))
                for mm, mem, c in zip((m, f), mems, caches))
        is_real = torch.arange(3)[None, :] < real[:, None]
        assert (a - b)[is_real].abs().max() < TOL
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        end = caches[0].end
        for b_, n in enumerate(caches[0].lengths.tolist()):
            assert (caches[0].k[:, b_, :, :n] - caches[1].k[:, b_, :, :n]).abs().max() < TOL
        assert end == caches[1].end


@pytest.mark.parametrize("family", ["bart", "marian", "nllb"])
def test_imported_family_layers_match_the_reference(family):
    """The layers of the families the fast route writes besides the paper's: BART's (post-norm,
    GELU, learned positions, embedding norms, a logits bias, unscaled embeddings), Marian's (SiLU,
    its position table) and NLLB's forced encoder and decoder tokens."""
    base = tiny_model(11).cfg
    changes = {"bart": dict(norm_first=False, activation="gelu", positions="learned", embed_norm=True,
                            logits_bias=True, scale_embeddings=False),
               "marian": dict(activation="silu", positions="marian", logits_bias=True),
               "nllb": dict(encoder_prefix=(7,), decoder_prefix=(9,))}[family]
    torch.manual_seed(11)
    m = Transformer(dataclasses.replace(base, **changes)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # learned tables, norms and the logits bias away from 0 and 1
    assert applies_to(m.cfg)
    src = random_src(11, 5, 40)
    ref, fast = both(m, lambda mm: decode_greedy(mm, src, max_len=15).tokens)
    assert_rows_equal(fast, ref, family)
    f = fast_copy(m)
    tgt = torch.randint(5, 40, (5, 4))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        a = m.decode(tgt, m.encode(src), m.new_cache(5))
        b = f.decode(tgt, f.encode(src), f.new_cache(5))
    assert (a - b).abs().max() < TOL
    iad = decode_iad(f, src, max_len=15).tokens
    assert_rows_equal(iad, fast, f"{family} iad on the fast route")


def test_teacher_forcing_and_training_use_the_reference_route():
    """forward() (training, no cache) and any call with gradients on take the reference route, on
    the same parameter values (laid out for the fast route: within float64 rounding); training a
    switched model trains it, and its fast-route decoding follows."""
    m = tiny_model(3)
    f = fast_copy(m)
    src = random_src(3, 4, 40)
    tgt = torch.randint(5, 40, (4, 6))
    assert (m(src, tgt) - f(src, tgt)).abs().max() < TOL
    for model in (m, f):
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(3):
            torch.manual_seed(0)
            opt.zero_grad()
            model(src, tgt).logsumexp(-1).mean().backward()
            opt.step()
        model.eval()
    assert all((a - b).abs().max() < 1e-9 for a, b in zip(m.parameters(), f.parameters()))
    with torch.no_grad():
        la = m.decode(tgt[:, :1], m.encode(src), m.new_cache(4))
        lb = f.decode(tgt[:, :1], f.encode(src), f.new_cache(4))
    assert (la - lb).abs().max() < 1e-9


# -- every lossless decoder on the fast route equals greedy on the fast route --------------------------
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13, 17])
def test_lossless_decoders_on_the_fast_route_equal_its_greedy(batch, monkeypatch):
    """Guards the fast route under every lossless decoder (check_lossless_decoders)."""
    check_lossless_decoders(fast_copy, batch, monkeypatch)


@pytest.mark.parametrize("seed", range(3))
def test_fast_greedy_equals_reference_greedy_on_random_models(seed):
    """Away from near-ties (random float64 models) the two routes write the same tokens; beam
    search runs on the fast route too."""
    m = tiny_model(seed, vocab=40, norm_first=seed != 1)
    src = random_src(seed, 9, 40)
    ref, fast = both(m, lambda mm: decode_greedy(mm, src, max_len=20).tokens)
    assert_rows_equal(fast, ref, "fast greedy vs reference greedy")
    ref, fast = both(m, lambda mm: decode_beam(mm, src, max_len=12, beam_size=3).tokens)
    assert_rows_equal(fast, ref, "fast beam vs reference beam")


# -- the switch ---------------------------------------------------------------------------------------
def test_the_switch_is_per_model_reversible_and_keeps_the_parameters():
    m = tiny_model(1)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    other = tiny_model(2)
    assert set_fast_route(m) == 1 and type(m) is FastTransformer and is_fast(m) and not is_fast(other)
    assert set_fast_route(m) == 0  # already switched
    assert m.state_dict().keys() == state.keys() and all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    assert set_fast_route(m, False) == 1 and type(m) is RoutedTransformer and not is_fast(m)
    assert all(p.is_contiguous() for p in m.parameters())  # the output embedding included
    assert all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    holder = torch.nn.ModuleDict({"a": tiny_model(4), "b": tiny_model(5)})
    assert set_fast_route(holder) == 2


def test_packed_weights_follow_every_weight_change():
    """A weight written in place, through .data, or by an optimizer step after a decoding call: the
    next call decodes with the new values (its logits equal the reference route's on the same weights)."""
    m = tiny_model(6)
    f = fast_copy(m)
    src = random_src(6, 3, 40)
    tgt = torch.full((3, 1), BOS_ID)

    def logits(model):
        with torch.no_grad():
            return model.decode(tgt, model.encode(src), model.new_cache(3))

    assert (logits(m) - logits(f)).abs().max() < TOL
    for change in (lambda mm: mm.decoder[0].ff.w1.weight.data.mul_(1.5),
                   lambda mm: mm.decoder[-1].self_attn.wq.bias.data.add_(0.3),
                   lambda mm: setattr(mm.out_proj.weight, "data", mm.out_proj.weight.data * 0.7),
                   lambda mm: mm.out_proj.weight.data.mul_(1.1),
                   lambda mm: setattr(mm.decoder[1].cross_attn.wo.weight, "data", mm.decoder[1].cross_attn.wo.weight.data + 0.2),
                   lambda mm: mm.load_state_dict({k: v * 0.9 for k, v in mm.state_dict().items()}),
                   lambda mm: mm.encoder[0].attn.wv.weight.data.add_(0.1)):
        for mm in (m, f):
            with torch.no_grad():
                change(mm)
        assert (logits(m) - logits(f)).abs().max() < TOL
    opt = torch.optim.SGD(f.parameters(), lr=0.1)
    f.train()
    f(src, torch.randint(5, 40, (3, 5))).sum().backward()
    opt.step()
    f.eval()
    m.load_state_dict(f.state_dict())
    assert (logits(m) - logits(f)).abs().max() < TOL


def test_row_invariant_mode_and_t5_layers_stay_on_the_reference_route():
    """Row-invariant mode wins over the fast route (its row-invariant kernels on the same values, and
    the lossless decoders equal to greedy there too); a configuration the fast route does not write
    is never switched."""
    m = tiny_model(7)
    f = set_row_invariant(fast_copy(m))
    set_row_invariant(m)
    src = random_src(7, 3, 40)
    with torch.no_grad():
        la = m.decode(torch.full((3, 1), BOS_ID), m.encode(src), m.new_cache(3))
        lb = f.decode(torch.full((3, 1), BOS_ID), f.encode(src), f.new_cache(3))
    assert (la - lb).abs().max() < TOL
    g = decode_greedy(f, src, max_len=20).tokens
    assert_rows_equal(decode_iad(f, src, max_len=20).tokens, g, "iad, row-invariant mode on a switched model")
    cfg = tiny_model(8).cfg
    for change in ({"norm": "rms"}, {"gated_ff": True}, {"positions": "relative"}, {"bias": False},
                   {"scale_attention": False}):
        other = dataclasses.replace(cfg, **change)
        assert not applies_to(other), change
    assert applies_to(cfg)
