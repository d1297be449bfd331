"""What putting a model on a route (refdec.routes.on_route) must leave alone and must follow: the
model's hooks and modules, its training mode in both directions, a model that is gone, and a write
through `.data` after `refresh()`. Every route: row-invariant, int8 on the model's own layers and on
the fast layout, fast and graphed. Tiny float64 models; a few seconds."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import random_src, tiny_model

from refdec.config import BOS_ID
from refdec.decoding import decode_greedy
from refdec.routes import on_route

ROUTES = {
    "invariant": ("invariant", False),
    "int8": ("reference", True),
    "fast": ("fast", False),
    "fast-int8": ("fast", True),
    "graphed": ("graphed", False),
}


def routed(model, name: str):
    route, int8 = ROUTES[name]
    return on_route(model, route, int8)


def step_logits(m, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return m.decode(tgt, m.encode(src), m.new_cache(src.shape[0]))


@pytest.mark.parametrize("name", list(ROUTES))
def test_a_hook_on_the_model_or_on_the_route_fires_on_that_one_alone(name):
    """Guards the twin that shared the model's hook dictionaries: a hook registered on the model
    after routing fired when the route decoded, and one registered on the route's module fired when
    the model did."""
    m = tiny_model(0)
    r = routed(m, name)
    twin = (r.reference if hasattr(r, "reference") else r).twin
    fired = {"model": 0, "twin": 0}
    m.decoder[0].ff.w1.register_forward_hook(lambda *a: fired.__setitem__("model", fired["model"] + 1))
    twin.decoder[0].ff.w1.register_forward_hook(lambda *a: fired.__setitem__("twin", fired["twin"] + 1))
    src = random_src(0, 2, 40)
    tgt = torch.full((2, 1), BOS_ID)
    step_logits(m, src, tgt)
    assert fired == {"model": 1, "twin": 0}
    with torch.inference_mode():  # the route's own layers: an early exit's call takes them on every route
        r.decode_hidden(tgt, r.encode(src), r.new_cache(2, 4), layers=1)
    assert fired["model"] == 1


@pytest.mark.parametrize("name", list(ROUTES))
def test_the_route_follows_the_models_training_mode_both_ways(name):
    """Guards a training flag copied as a value: routed in eval mode then model.train(), the route
    decoded with dropout on (five runs, five outputs); routed in training mode then model.eval(), it
    still refused. The route is in training mode exactly while its model is."""
    m = tiny_model(1)
    r = routed(m, name)
    src = random_src(1, 2, 40)
    m.train()
    assert r.training
    with pytest.raises(ValueError, match="model.eval"):
        decode_greedy(r, src, max_len=6)
    trained = tiny_model(2).train()
    r2 = routed(trained, name)
    trained.eval()
    assert not r2.training
    assert torch.equal(
        step_logits(r2, src, torch.full((2, 1), BOS_ID)),
        step_logits(routed(trained, name), src, torch.full((2, 1), BOS_ID)),
    )
    r2.eval()  # eval on the route puts the model in eval mode
    assert not trained.training


@pytest.mark.parametrize("name", list(ROUTES))
def test_the_routes_modules_are_its_own(name):
    """Guards a twin that handed back the model's own modules where nothing below them was routed:
    the route's twin.train() flipped the model's dropout and embedding modules. No module of the
    twin is the model's, and the model's stay as they were whatever the twin's do."""
    m = tiny_model(3)
    r = routed(m, name)
    twin = (r.reference if hasattr(r, "reference") else r).twin
    assert not {id(x) for x in twin.modules()} & {id(x) for x in m.modules()}
    twin.train()
    assert not any(x.training for x in m.modules())
    assert all(a is b for a, b in zip(twin.parameters(), m.parameters()))


@pytest.mark.parametrize("name", list(ROUTES))
def test_no_route_is_handed_a_gone_models_twin(name):
    """Guards a memo keyed by id(model) shared across calls: a new model that took a collected one's
    id got the old model's twin (19 of 20 such models crashed in a fuzz). Each route computes its own model."""
    src, tgt = random_src(4, 1, 40), torch.full((1, 1), BOS_ID)
    for seed in range(4):
        m = tiny_model(seed, d_model=16 + 8 * (seed % 3), n_heads=2)
        r = routed(m, name)
        assert r.model is m
        assert torch.equal(step_logits(r, src, tgt), step_logits(routed(copy.deepcopy(m), name), src, tgt))
        del m, r
        gc.collect()


@pytest.mark.parametrize("name", list(ROUTES))
def test_refresh_after_a_data_write_gives_a_fresh_routes_logits(name):
    """Guards the int8 forms that `refresh()` left stale on the fast route's int8 form (its encoder's
    and cross-attention's, kept by the layers it defers to): after an in-place write through `.data`
    to an encoder weight, a cross-attention key weight and a decoder weight, which no stamp sees, a
    refreshed route computes what a route made now computes, bitwise."""
    m = tiny_model(5)
    r = routed(m, name)
    src, tgt = random_src(5, 2, 40), torch.tensor([[BOS_ID, 7, 8]] * 2)
    step_logits(r, src, tgt)  # every kept form made from the weights as they were
    decode_greedy(r, src, max_len=4)
    m.encoder[0].attn.wq.weight.data.mul_(1.7)
    m.decoder[0].cross_attn.wk.weight.data.add_(0.3)
    m.decoder[1].ff.w2.weight.data.mul_(-1.0)
    r.refresh()
    assert torch.equal(step_logits(r, src, tgt), step_logits(routed(m, name), src, tgt))
    assert torch.equal(
        decode_greedy(r, src, max_len=8).tokens[0], decode_greedy(routed(m, name), src, max_len=8).tokens[0]
    )


@pytest.mark.parametrize("name", ["invariant", "int8"])
def test_a_route_follows_its_model_cast_to_another_dtype(name):
    """A model cast after routing (.to(), whose new buffers a twin made before does not hold): the
    route computes the cast model, as a route made now does."""
    m = tiny_model(6).float()
    r = routed(m, name)
    src, tgt = random_src(6, 2, 40), torch.full((2, 1), BOS_ID)
    step_logits(r, src, tgt)
    m.double()
    got = step_logits(r, src, tgt)
    assert got.dtype == torch.float64 and torch.equal(got, step_logits(routed(m, name), src, tgt))
