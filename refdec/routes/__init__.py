"""The speed routes beside the reference route.

refdec.model is the paper's Transformer computed as written: the reference route, what a loaded
checkpoint is (nn.Linear, nn.LayerNorm), the code a learner reads and every exactness test is
written against. A route is an object that wraps a model and computes the same model another way: it
holds the model (unchanged: its classes, parameters and state-dict keys stay as they are), the weight
layout it computes with, and hands each decoding call what the call keeps (its Memory, its cache);
it offers the verbs a decoder calls (encode, new_cache, decode_hidden, project, decode, cfg: the
Companion protocol of refdec.decoding.pairing), so every decoder runs on it unchanged, and each route
is tested equal to the reference route:

    kernels.py   the model's own layers again, computing by other kernels (on_kernels): the few-row
                 product, row-invariant compute (row_invariant), the int8 products
    fast.py      FastRoute(model): fewer, larger operations, laid-out weights, fused attention (--fast);
                 FastRoute(model, int8=True) its products in int8
    graphed.py   GraphedRoute(model): the fast route's calls on static shapes, CUDA graphs on a GPU (--graphed)
    int8.py      int8 products with one activation scale per row, exact in int32 (--int8)
    stamps.py    when a route's copy of a weight is out of date

`refdec.app.loading.on_route(module, route)` puts a run's model, or an adapter, drafter model or proposal
heads holding one, on a route by name. The routes import the model; the model imports no route, and
no route imports an adapter, a checkpoint or a decoder (tests/test_layout.py).
"""
