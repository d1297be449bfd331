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
from collections.abc import Callable

import torch

from ..app.inputs import add_device, add_threads, check_threads
from ..app.report import columns, write_report
from ..machine import allocator_option, check_device, set_allocator, usable_cores
from ..timing import median_seconds
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
    """--device (cpu or cuda) and --threads (torch's intra-op threads, refdec.app.inputs' one definition of
    each) with their defaults (threads: at most the machine's usable cores); `timed` says how the command
    reads its times."""
    add_device(p, default=device, says=timed)
    add_threads(p, default=min(threads, usable_cores()), says=f"{threads}, or the cores there are if fewer")
    allocator_option(p)


def report_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="FILE", help="write the figures as JSON here")


def set_up_machine(args: argparse.Namespace) -> torch.device:
    """The device --device names (one line saying why where it cannot serve) and torch set to --threads."""
    device = check_device(args.device)
    torch.set_num_threads(check_threads(args.threads))
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
    return median_seconds(
        lambda: model.decode(new, memory, cache), reps, device, between=lambda: cache.truncate(prefix)
    )


def time_replay(route, memory, prefix: int, q: int, reps: int) -> float:
    """Median seconds of the graphed route's step alone (refdec.routes.graphed: on a GPU the replay
    of its CUDA graph, on a CPU its function run eagerly) for a call appending q tokens to every row of
    a cache holding `prefix` tokens: the call without the route's Python around the step (its static
    inputs filled, its rows copied out) and without the vocabulary projection after it."""
    rows, device = memory.states.shape[0], memory.states.device
    cache = route.new_cache(rows, capacity=prefix + q)
    route.decode(torch.full((rows, prefix), 7, device=device), memory, cache)
    route.decode(torch.full((rows, q), 9, device=device), memory, cache)  # the step made (and captured)
    return median_seconds(route.step_of(memory, cache, q).run, reps, device)


def time_products(model, reps: int, rows: int = 1) -> float:
    """Median seconds of the matrix products alone of one fast-route decoder step that appends one token
    to each of `rows` rows (`products`), on the route's laid-out weights,
    with nothing between them: the part of the step that attention, norms, the cache and dispatch
    come on top of. `model` is on the fast route (refdec.routes.fast.DecoderWeights.products)."""
    weights = model.decoder_weights()
    x = weights.vocab.in_out.new_zeros(rows, model.cfg.d_model)
    return median_seconds(lambda: weights.products(x), reps, x.device)
