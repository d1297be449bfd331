"""The speed routes beside the reference route, and `on_route`, the one way onto them.

refdec.model is the paper's Transformer computed as written: the reference route, what a loaded
checkpoint is (nn.Linear, nn.LayerNorm), the code a learner reads and every exactness test is
written against. A route is an object that wraps a model and computes the same model another way: it
holds the model (unchanged: its classes, parameters and state-dict keys stay as they are), the weight
layout it computes with, and hands each decoding call what the call keeps (its Memory, its cache);
it offers the verbs a decoder calls (encode, new_cache, decode_hidden, project, decode, cfg: the
Companion protocol of refdec.decoding.pairing), reads its training mode from the model, and makes its
kept forms of the weights again on `refresh()` (after a write through `.data`); so every decoder runs
on it unchanged, and each route is tested equal to the reference route:

    kernels.py   KernelRoute: the model's own layers again, computing by other kernels: the few-row
                 product, row-invariant compute (--invariant), the int8 products (--int8)
    fast.py      FastRoute: fewer, larger operations, laid-out weights, fused attention (--fast), its
                 products in int8 too
    graphed.py   GraphedRoute: the fast route's calls on static shapes, CUDA graphs on a GPU (--graphed)
    int8.py      int8 products with one activation scale per row, exact in int32
    probes.py    every choice made by what this machine does (int8 kernels, grouped attention), its cache,
                 its report, and the decisions read back from a machine report (REFDEC_MACHINE_REPORT)
    stamps.py    when a route's copy of a weight is out of date

Every command and every caller of the decoders puts a model on a route with `on_route`; nothing
outside this package builds a route. Adapters that read a model (an early exit, a decoder on another
model's encoder) are built around the model's route by their caller (refdec.app.loading.routed), so
that a verifier and its early exit share one route. The routes import the model; the model imports no
route, and no route imports an adapter, a checkpoint or a decoder (tests/test_layout.py).
"""

from __future__ import annotations

from torch import nn

from ..model import Transformer
from .fast import FastRoute, applies_to
from .graphed import GraphedRoute
from .kernels import KernelRoute, Kernels, twin

ROUTES = ("reference", "invariant", "fast", "graphed")


def check_route(route: str, int8: bool = False) -> None:
    """A ValueError for a route that is not one of ROUTES, and for the one combination refused: int8
    on the graphed route, which has no int8 form (refdec.app.loading tells a user so before loading)."""
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}: one of {', '.join(ROUTES)}")
    if route == "graphed" and int8:
        raise ValueError(
            "the graphed route has no int8 form: run --int8 (or :int8) without --graphed, on the fast "
            "or the reference route"
        )


def on_route(module: nn.Module, route: str = "reference", int8: bool = False):
    """`module` (a Transformer, or proposal heads) on `route` (ROUTES), with `int8` its products in int8
    (refdec.routes.int8; not on the graphed route). The module is not changed; the reference route without
    int8 returns it as it is.

        reference   the model as model.py reads (int8: a KernelRoute on the int8 products)
        invariant   a KernelRoute in row-invariant mode (int8 too: the int8 products, row-invariant)
        fast        a FastRoute, or, for a family it does not write (applies_to), a KernelRoute on the
                    few-row product
        graphed     a GraphedRoute (the same fallback)

    Proposal heads (any module other than a Transformer) get their twin on the route's kernels
    (refdec.routes.kernels.twin): a module of their own, in eval mode, holding the heads' weights."""
    check_route(route, int8)
    kernels = Kernels(few_rows=route in ("fast", "graphed"), row_invariant=route == "invariant", int8=int8)
    if not isinstance(module, Transformer):
        return module if kernels == Kernels() else twin(module, kernels)
    if route in ("reference", "invariant") or not applies_to(module.cfg):
        return module if kernels == Kernels() else KernelRoute(module, kernels)
    return GraphedRoute(module) if route == "graphed" else FastRoute(module, int8)
