"""Timing helpers the measuring commands share (stepcost, ctranslate2): one decoder call's median
seconds on any route, and the matrix products alone of a fast-route decoder step."""

from __future__ import annotations

import statistics

import torch

from ..machine import clock


def time_decode(model, memory, prefix: int, q: int, reps: int) -> float:
    """Median seconds of one decode call appending q tokens to every row of a cache holding `prefix`
    tokens (one row per batch row of `memory`)."""
    rows, device = memory.states.shape[0], memory.states.device
    cache = model.new_cache(rows, capacity=prefix + q)
    model.decode(torch.full((rows, prefix), 7, device=device), memory, cache)
    new = torch.full((rows, q), 9, device=device)
    times = []
    for _ in range(reps):
        t0 = clock(device)
        model.decode(new, memory, cache)
        times.append(clock(device) - t0)
        cache.truncate(prefix)
    return statistics.median(times)


def time_replay(route, memory, prefix: int, q: int, reps: int) -> float:
    """Median seconds of the graphed route's step alone (refdec.routes.graphed: on a GPU the replay
    of its CUDA graph, on a CPU its function run eagerly) for a call appending q tokens to every row of
    a cache holding `prefix` tokens: the call without the route's Python around the step (its static
    inputs filled, its rows copied out) and without the vocabulary projection after it."""
    rows, device = memory.states.shape[0], memory.states.device
    cache = route.new_cache(rows, capacity=prefix + q)
    route.decode(torch.full((rows, prefix), 7, device=device), memory, cache)
    route.decode(torch.full((rows, q), 9, device=device), memory, cache)  # the step made (and captured)
    step = route.step_of(memory, cache, q)
    times = []
    for _ in range(reps):
        t0 = clock(device)
        step.run()
        times.append(clock(device) - t0)
    return statistics.median(times)


def products(weights, x: torch.Tensor) -> torch.Tensor:
    """The matrix products of a fast-route decoder step over rows x (N, D) and nothing else, in the
    step's order, on its laid-out weights (refdec.routes.fast.DecoderWeights): per layer the
    self-attention's queries-keys-values and output, the cross-attention's queries and output, the two
    feed-forward products; then the vocabulary projection. Not a decoder step (no attention, norms or
    cache): what the step's products alone cost."""
    for w in weights.layers:
        torch.addmm(w["qkv_b"], x, w["qkv"])
        torch.addmm(x, x, w["o"])
        torch.addmm(w["cq_b"], x, w["cq"])
        torch.addmm(x, x, w["co"])
        torch.addmm(x, torch.addmm(w["b1"], x, w["w1"]), w["w2"])
    return x @ weights.vocab


def time_products(model, reps: int, rows: int = 1) -> float:
    """Median seconds of the matrix products alone of one fast-route decoder step that appends one token
    to each of `rows` rows (`products`), on the route's laid-out weights,
    with nothing between them: the part of the step that attention, norms, the cache and dispatch
    come on top of. `model` is on the fast route."""
    weights = model.decoder_weights()
    x = weights.vocab.new_zeros(rows, model.cfg.d_model)
    times = []
    for _ in range(reps):
        t0 = clock(x.device)
        products(weights, x)
        times.append(clock(x.device) - t0)
    return statistics.median(times)
