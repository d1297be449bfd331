"""The fast route (refdec.routes.fast): the same mathematics as the reference route within float64 rounding,
every lossless decoder on it equal to greedy on it (float64, torch.equal, batch sizes 1-17, ragged
sources, adversarial drafts), a wrapper that leaves the model as it is, a weight layout that follows
weight changes, and the model's own layers wherever the fast route does not apply."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import assert_rows_equal, check_lossless_decoders, random_src, tiny_model

from refdec.adapters import EarlyExit
from refdec.app.loading import Models, routed
from refdec.config import BOS_ID, PAD_ID
from refdec.decoding import decode_beam, decode_greedy, decode_iad
from refdec.model import Transformer
from refdec.routes import on_route
from refdec.routes.fast import FastRoute, applies_to
from refdec.routes.kernels import KernelRoute, Kernels

TOL = 1e-12  # float64: the two routes sum in different orders


def fast_copy(model: Transformer) -> FastRoute:
    """The fast route around a copy of the model (so that tests may change one and not the other)."""
    return on_route(copy.deepcopy(model), "fast")


def both(model: Transformer, fn):
    """fn(model) on the reference route and on the fast route of a copy."""
    with torch.no_grad():
        return fn(model), fn(fast_copy(model))


# -- the same mathematics -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_encoder_and_cross_attention_memory_match_the_reference(seed):
    m = tiny_model(seed, norm_first=seed % 2 == 0, tie=seed >= 2)
    src = random_src(seed, 6, 40)
    if seed % 2:  # rows sorted by length, as a batch cut from sorted lines: neighbours of one length
        src = src[src.ne(PAD_ID).sum(1).argsort(stable=True)]
    ref, fast = both(m, lambda mm: mm.encode(src))
    assert torch.equal(ref.src_pad, fast.src_pad) and bool(ref.src_pad.any())  # padded sources
    real = ~ref.src_pad  # (B, S): the fast route computes the real positions alone, the padding's are zeros
    assert fast.states.shape == ref.states.shape and (ref.states - fast.states)[real].abs().max() < TOL
    assert not fast.states[~real].any()
    for (k0, v0), (k1, v1) in zip(ref.cross_kv, fast.cross_kv):  # (B, H, S, Dh)
        assert k0.shape == k1.shape and v0.shape == v1.shape
        for a, b in ((k0, k1), (v0, v1)):
            assert (a - b).transpose(1, 2)[real].abs().max() < TOL and not b.transpose(1, 2)[~real].any()


def test_the_encoders_two_forms_of_attention_over_padded_sources_agree():
    """A batch of sources of unequal lengths, each source's attention alone (on a CPU) or the padded
    batch's, masked (elsewhere): the same states at the real positions (float64), zeros at the padding,
    and a source of no tokens at all (every position padding) has no rows to attend with."""
    m = tiny_model(3)
    f = fast_copy(m)
    src = random_src(5, 7, 40)
    src[2] = PAD_ID  # no tokens at all
    pad = src.eq(PAD_ID)
    real = (~pad).reshape(-1).nonzero().squeeze(1)
    with torch.no_grad():
        each = f.encoder_stack(src, ~pad[:, None, None, :], real, (~pad).sum(1).tolist())
        padded = f.encoder_stack(src, ~pad[:, None, None, :], real)
    assert (each - padded)[~pad].abs().max() < TOL and not each[pad].any() and not padded[pad].any()


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
        a, b = (mm.project(mm.decode_hidden(tgt[:, 1:], mem, c, real=real)) for mm, mem, c in zip((m, f), mems, caches))
        is_real = torch.arange(3)[None, :] < real[:, None]
        assert (a - b)[is_real].abs().max() < TOL
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        end = caches[0].end
        for b_, n in enumerate((lengths + real).tolist()):  # the real positions (padding's are the caller's to cut)
            assert (caches[0].k[:, b_, :, :n] - caches[1].k[:, b_, :, :n]).abs().max() < TOL
        assert end == caches[1].end


@pytest.mark.parametrize("family", ["bart", "marian", "nllb"])
def test_imported_family_layers_match_the_reference(family):
    """The layers of the families the fast route writes besides the paper's: BART's (post-norm,
    GELU, learned positions, embedding norms, a logits bias, unscaled embeddings), Marian's (SiLU,
    its position table) and NLLB's forced encoder and decoder tokens."""
    base = tiny_model(11).cfg
    changes = {
        "bart": dict(
            norm_first=False,
            activation="gelu",
            positions="learned",
            embed_norm=True,
            logits_bias=True,
            scale_embeddings=False,
        ),
        "marian": dict(activation="silu", positions="marian", logits_bias=True),
        "nllb": dict(encoder_prefix=(7,), decoder_prefix=(9,)),
    }[family]
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


def test_training_the_model_under_the_route_is_followed():
    """The route does not train (the model does, as model.py reads); calls with gradients on take the
    model's own layers, and after an optimizer step, fused Adam's included (which advances no version
    counter), the route decodes with the new weights."""
    m = tiny_model(3)
    f = fast_copy(m)
    src = random_src(3, 4, 40)
    tgt = torch.randint(5, 40, (4, 6))
    with torch.enable_grad():
        assert (
            m.project(m.forward_hidden(src, tgt)) - f.project(f.reference.forward_hidden(src, tgt))
        ).abs().max() < TOL
    for model, fused in ((m, False), (f.model, True)):
        with torch.no_grad():
            f.decode(tgt[:, :1], f.encode(src), f.new_cache(4))  # the layout made before the steps
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        for _ in range(3):
            torch.manual_seed(0)
            opt.zero_grad()
            model(src, tgt).logsumexp(-1).mean().backward()
            opt.step()
        model.eval()
    assert all((a - b).abs().max() < 1e-9 for a, b in zip(m.parameters(), f.model.parameters()))
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
def test_the_route_wraps_the_model_and_leaves_it_as_it_is():
    """Wrapping changes nothing in the model (its classes, parameters, their values and memory, its
    state dict); an early exit of the model is put on the route around the same route, so the pair
    still shares its encoder; a family the fast route does not write is refused, and on_route puts it
    on its own layers on the few-row product instead."""
    m = tiny_model(1)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    classes = [type(x) for x in m.modules()]
    places = [p.data_ptr() for p in m.parameters()]
    f = on_route(m, "fast")
    src = random_src(1, 3, 40)
    with torch.no_grad():
        f.decode(torch.full((3, 1), BOS_ID), f.encode(src), f.new_cache(3))
    assert f.model is m and [type(x) for x in m.modules()] == classes
    assert [p.data_ptr() for p in m.parameters()] == places and all(p.is_contiguous() for p in m.parameters())
    assert m.state_dict().keys() == state.keys() and all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    assert type(m.decoder[0].self_attn.wq) is torch.nn.Linear
    models = routed(Models(m, Path("m.pt"), small=EarlyExit(m, 1)), "fast", False)
    assert isinstance(models.model, FastRoute) and models.small.base is models.model
    large = models.model
    assert (
        large.reference.kernels == Kernels(few_rows=True)
        and FastRoute(m, few_rows=False).reference.kernels == Kernels()
    )
    t5 = Transformer(dataclasses.replace(m.cfg, positions="relative", scale_attention=False))
    with pytest.raises(ValueError, match="does not write"):
        FastRoute(t5)
    assert isinstance(on_route(t5, "fast"), KernelRoute) and on_route(t5, "fast").kernels == Kernels(few_rows=True)


def test_packed_weights_follow_every_weight_change():
    """A weight written in place, given a new tensor, loaded, or changed by an optimizer step after a
    decoding call: the next call decodes with the new values (its logits equal the reference route's
    on the same weights). A write through `.data` in place, which no stamp sees, after `refresh`."""
    m = tiny_model(6)
    f = fast_copy(m)
    src = random_src(6, 3, 40)
    tgt = torch.full((3, 1), BOS_ID)

    def logits(model):
        with torch.no_grad():
            return model.decode(tgt, model.encode(src), model.new_cache(3))

    assert (logits(m) - logits(f)).abs().max() < TOL
    encoder_changes = [  # the encoder's layout follows its parameters as the decoder's does
        (lambda mm: mm.encoder[0].ff.w1.weight.mul_(1.3), True),
        (lambda mm: mm.encoder[-1].attn.wv.weight.data.mul_(1.4), False),
    ]
    for change, seen in [
        (lambda mm: mm.decoder[0].ff.w1.weight.mul_(1.5), True),
        (lambda mm: mm.decoder[-1].self_attn.wq.bias.add_(0.3), True),
        (lambda mm: setattr(mm.out_proj.weight, "data", mm.out_proj.weight.data * 0.7), True),
        (lambda mm: mm.out_proj.weight.data.mul_(1.1), False),
        (
            lambda mm: setattr(
                mm.decoder[1].cross_attn.wo.weight, "data", mm.decoder[1].cross_attn.wo.weight.data + 0.2
            ),
            True,
        ),
        (lambda mm: mm.load_state_dict({k: v * 0.9 for k, v in mm.state_dict().items()}), True),
        (lambda mm: mm.decoder[0].self_attn.wk.weight.data.add_(0.1), False),
        *encoder_changes,
    ]:
        before = logits(m)
        for mm in (m, f.model):
            with torch.no_grad():
                change(mm)
        if not seen:
            f.refresh()
        assert (logits(m) - logits(f)).abs().max() < TOL
        if any(change is c for c, _ in encoder_changes):  # a change the logits show (a uniform shift would not)
            assert (logits(m) - before).abs().max() > 1e-6
    for fused in (False, True):
        opt = torch.optim.Adam(f.model.parameters(), lr=0.1, fused=fused)
        f.model.train()
        f.model(src, torch.randint(5, 40, (3, 5))).sum().backward()
        opt.step()
        f.model.eval()
        m.load_state_dict(f.model.state_dict())
        assert (logits(m) - logits(f)).abs().max() < TOL


def test_the_configurations_the_fast_route_writes():
    """The paper's layers (and BART's, Marian's, NLLB's) and nothing else: RMS norm, a gated
    feed-forward network, relative positions, no biases or unscaled attention are refused."""
    cfg = tiny_model(8).cfg
    for change in (
        {"norm": "rms"},
        {"gated_ff": True},
        {"positions": "relative"},
        {"bias": False},
        {"scale_attention": False},
    ):
        other = dataclasses.replace(cfg, **change)
        assert not applies_to(other), change
    assert applies_to(cfg)
