"""torch.compile as refdec uses it, with nothing changed for the rest of the process: the C++ compiler its
CPU kernels need (`cpp_compiler`), and a function compiled with a recompile limit of its own
(`compiled`).

torch.compile keeps at most 8 compilations of one function by default (torch._dynamo.config's
recompile_limit) and, with fullgraph, raises past that. A function that meets many shapes on purpose (a
graphed step per call shape, a proposal head per index) needs more; raising the process-wide setting would
change every other compiled function of the process for good. So `compiled` sets the limit only around
each call of its own function, where a recompilation happens, and restores it on the way out.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile would build CPU kernels with (g++, clang++, $CXX), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception:  # none found (torch raises its own error), or a torch without this helper
        return None
    return compiler if shutil.which(compiler) else None


def compiled(fn: Callable, recompile_limit: int | None = None, **options) -> Callable:
    """`fn` through torch.compile(fn, **options); with `recompile_limit`, each call runs with that many
    compilations of it allowed (torch._dynamo.config.patch: the process's setting is back after the call)."""
    import torch._dynamo  # torch.compile's configuration, patched per call below

    compiled_fn = torch.compile(fn, **options)
    if recompile_limit is None:
        return compiled_fn

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=recompile_limit, accumulated_recompile_limit=recompile_limit):
            return compiled_fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call
