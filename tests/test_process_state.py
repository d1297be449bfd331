"""Nothing process-wide changes by importing refdec or building a route: torch.compile's settings, the
optimizer hooks and the C allocator are left as the process had them, and what refdec needs of them is
scoped to its own calls (refdec.compiling) or taken when it is first needed (refdec.routes.stamps)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import refdec

EVERY_MODULE = [m.name for m in pkgutil.walk_packages(refdec.__path__, "refdec.") if not m.name.endswith("__main__")]


@pytest.mark.slow
def test_importing_every_module_changes_nothing_process_wide():
    """Case: importing refdec.routes.stamps registered a hook on every optimizer of the process, and
    building a graphed route or a compiled objective raised torch._dynamo's recompile limits for good.
    After importing every module of refdec, an optimizer step is counted by no refdec hook, torch.compile's
    limits are torch's defaults and the C allocator is the system's."""
    code = f"""
import importlib, torch, torch._dynamo
before = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
for name in {EVERY_MODULE!r}:
    try:
        importlib.import_module(name)
    except ImportError:  # an optional dependency (transformers, ctranslate2, matplotlib) absent
        pass
from refdec.routes import stamps
from refdec import machine
p = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([p], lr=0.1)
p.sum().backward()
opt.step()
after = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
print(stamps._optimizer_steps[0], before == after, machine._allocator)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["0", "True", "system"]


def test_the_first_route_copy_starts_counting_optimizer_steps():
    """The optimizer hook is registered when the first copy of a weight is stamped, and from then on every
    step of any optimizer marks the copies out of date."""
    from refdec.routes import stamps

    p = torch.nn.Parameter(torch.ones(3))
    first = stamps.stamp(p)
    opt = torch.optim.SGD([p], lr=0.0)
    p.sum().backward()
    opt.step()
    assert stamps.stamp(p) != first and stamps.stamp(p)[-1] == first[-1] + 1


def test_a_compiled_function_has_its_own_recompile_limit_for_its_calls_alone():
    """refdec.compiling.compiled: a function compiled for many shapes (more than torch's 8) runs them all
    with fullgraph, and the process's limit is torch's own before, between and after its calls."""
    import torch._dynamo

    from refdec.compiling import compiled

    limit = torch._dynamo.config.recompile_limit
    double = compiled(lambda x: x * 2, 32, backend="eager", dynamic=False, fullgraph=True)
    for n in range(1, 13):
        assert torch.equal(double(torch.ones(n)), torch.full((n,), 2.0))
        assert torch._dynamo.config.recompile_limit == limit


def test_every_command_defines_and_checks_threads_and_device_one_way():
    """Case: --threads and --device were defined and checked in six ways (decode's bounded by the cores,
    the measuring commands' only >= 1, machine's a comma list, int8bench, distill and ctranslate2 each their
    own). One definition (refdec.app.inputs.add_threads, add_device) and one check (check_threads) now:
    no command adds either flag itself, and every command refuses a count past the cores in the same words."""
    import re

    from refdec.app.inputs import check_threads
    from refdec.errors import UsageError
    from refdec.machine import usable_cores

    sources = [p for p in (REPO / "refdec").rglob("*.py") if p.name != "inputs.py"]
    own = [str(p) for p in sources if re.search(r"add_argument\(\s*\"--(threads|device)\"", p.read_text())]
    assert not own, own
    assert check_threads("2,1", several=True) == sorted({1, 2}) or usable_cores() < 2
    for bad in (0, usable_cores() + 1):
        try:
            check_threads(bad)
        except UsageError as e:
            assert str(e).startswith(f"--threads {bad}: must be between 1 and the {usable_cores()} cores")
        else:
            raise AssertionError(bad)
