"""What the measuring commands share: a parser whose --help is the command's docstring and whose name
is its `python -m` line, the options every timed command takes (--device, --threads) and --report,
the machine set up from them, and the writers of tables and JSON reports (refdec.report's columns
and write_report, as decode.py writes its own). The decoders they time against each other go
through refdec.runner.decode_lines on the models of a refdec.loading.Models, as decode.py's do (the
ceiling's scripted loop aside: its time_runs says why); the repository's files through refdec.repo."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from ..errors import UsageError
from ..machine import allocator_option, check_device, set_allocator
from ..report import columns, write_report

__all__ = ["columns", "command_parser", "invocation", "machine_options", "report_option", "set_up_machine",
           "write_report"]

SYNCHRONISED = "times are read after a device synchronisation"


def command_parser(doc: str | None, command: str) -> argparse.ArgumentParser:
    """The parser of `python -m refdec.<command>`, its docstring as the description, kept as written."""
    return argparse.ArgumentParser(prog=f"python -m refdec.{command}", description=doc,
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
    """The module `python -m` runs a command's main as: refdec.commands.X as refdec.X, and the Hugging
    Face command line (refdec.commands.hfcli) as refdec.hf."""
    name = main.__module__.rpartition(".")[2]
    return "refdec.hf" if name == "hfcli" else f"refdec.{name}"
