"""What the measuring commands share: a parser whose --help is the command's docstring and whose name
is the command as the user typed it, the options every timed command takes (--device, --threads) and --report,
the machine set up from them, and the writers of tables and JSON reports (refdec.app.report's columns
and write_report, as decode.py writes its own). The decoders they time against each other go
through refdec.app.runner.decode_lines on the models of a refdec.app.loading.Models, as decode.py's do (the
ceiling's scripted loop aside: its time_runs says why); the repository's files through refdec.repo."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from . import COMMANDS, as_typed
from ..errors import UsageError
from ..machine import allocator_option, check_device, set_allocator
from ..app.report import columns, write_report

__all__ = ["columns", "command_parser", "invocation", "machine_options", "report_option", "set_up_machine",
           "write_report"]

SYNCHRONISED = "times are read after a device synchronisation"


def command_parser(doc: str | None, command: str) -> argparse.ArgumentParser:
    """The parser of `refdec <command>`, its docstring as the description, kept as written but for its
    examples, which read as the user typed the command (refdec.commands.as_typed)."""
    typed = as_typed(command)
    return argparse.ArgumentParser(prog=typed, description=doc and doc.replace(f"python -m refdec {command}", typed),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def machine_options(p: argparse.ArgumentParser, *, device: str = "cpu", threads: int = 2,
                    timed: str = SYNCHRONISED) -> None:
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
