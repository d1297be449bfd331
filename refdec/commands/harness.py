"""What the measuring commands share: a parser whose --help is the command's docstring and whose name
is the command as the user typed it, the options every timed command takes (--device, --threads) and --report,
the machine set up from them, the writers of tables and JSON reports (refdec.app.report's columns
and write_report, as decode.py writes its own), and the timing of one decoder call on any route
(time_decode; time_replay, the graphed route's step alone; time_products, a fast-route step's products
alone: stepcost, ctranslate2). The decoders they time against each other go through
refdec.app.runner.decode_lines on the models of a refdec.app.loading.Models, as decode.py's do (the
ceiling's scripted loop aside: its time_runs says why); the repository's files through refdec.repo."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from ..app.report import columns, write_report
from ..errors import UsageError
from ..machine import allocator_option, check_device, clock, set_allocator
from . import COMMANDS, as_typed

__all__ = [
    "columns",
    "command_parser",
    "invocation",
    "machine_options",
    "report_option",
    "set_up_machine",
    "time_decode",
    "time_products",
    "time_replay",
    "write_report",
]

SYNCHRONISED = "times are read after a device synchronisation"


def command_parser(doc: str | None, command: str) -> argparse.ArgumentParser:
    """The parser of `refdec <command>`, its docstring as the description, kept as written but for its
    examples, which read as the user typed the command (refdec.commands.as_typed)."""
    typed = as_typed(command)
    return argparse.ArgumentParser(
        prog=typed,
        description=doc and doc.replace(f"python -m refdec {command}", typed),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def machine_options(
    p: argparse.ArgumentParser, *, device: str = "cpu", threads: int = 2, timed: str = SYNCHRONISED
) -> None:
    """--device (cpu or cuda) and --threads (torch's intra-op threads) with their defaults; `timed` says
    how the command reads its times."""
    other = "cpu" if device == "cuda" else "cuda"
    p.add_argument("--device", default=device, help=f"{device} or {other} (default {device}); {timed}")
    p.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    allocator_option(p)


def report_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="FILE", help="write the figures as JSON here")


def set_up_machine(args: argparse.Namespace) -> torch.device:
    """The device --device names (one line saying why where it cannot serve) and torch set to --threads."""
    device = check_device(args.device)
    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, not {args.threads}")
    torch.set_num_threads(args.threads)
    set_allocator(args.allocator)
    return device


def invocation(main: Callable) -> str:
    """The command line that runs a command's main, as the user typed this one: refdec.commands.hfcli's
    as `refdec hf`, refdec.commands.train_drafters's as `refdec train-drafters` (refdec.commands.COMMANDS)."""
    module = main.__module__.rpartition(".")[2]
    return as_typed(next(name for name, (m, _) in COMMANDS.items() if m == module))


# -- timing one decoder call ------------------------------------------------------------------------
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
