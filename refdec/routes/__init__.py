"""The speed routes beside the reference route.

refdec.model is the paper's Transformer computed as written: the route a learner reads and every
exactness test is written against. A route computes the same model another way, on the same
parameters (nothing copied, state-dict keys unchanged), by giving the model's layers subclasses of
their own classes; a switch puts a model on a route and takes it off again, and each route is tested
equal to the reference route:

    kernels.py   other kernels for the same products, per model: the few-row route and the projection
                 copy (on for every loaded checkpoint), row-invariant compute (set_row_invariant),
                 the int8 products' switch (set_int8_route); what a route keeps per decoding call
    fast.py      fewer, larger operations: laid-out weights, fused attention (set_fast_route; --fast)
    graphed.py   the fast route's calls on static shapes, CUDA graphs on a GPU (set_graphed_route; --graphed)
    int8.py      int8 products with one activation scale per row, exact in int32 (--int8)

The routes import the model; the model imports no route (tests/test_layout.py).
"""
