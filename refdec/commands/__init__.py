"""refdec's command line: `refdec <command> ...` once installed (pyproject.toml's entry point), or
`python -m refdec <command> ...` (refdec/__main__.py), both through main() below. The commands stand
on top of the library and nothing in it imports them (docs/layout.md); what the measuring commands
repeat is in harness.py. decode.py and train.py at the repository's root run decode and train too.

    decode.py          decode a test set or any file with one of refdec's algorithms
    train.py           train a model, a drafter, proposal heads or a small model
    bench.py           every GPU table in one command
    ceiling.py         draft-then-verify speed when the draft is right (GAD's loop, scripted drafts)
    ctranslate2.py     refdec against CTranslate2 on the same weights
    distill.py         sequence-level distillation into a data folder
    fuzz.py            every lossless decoder against greedy on random tiny models
    hfcli.py           refdec hf import|export|audit (the audit: refdec.app.hfaudit)
    int8bench.py       the candidate int8 products timed on a model's shapes
    machine.py         what this machine's probes choose for the routes, with their figures
    stepcost.py        the cost of one decoder call appending q tokens
    train_drafters.py  a drafter and heads: the mt-en-de ones on one GPU, or your model's (--verifier)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# name typed -> (module in this package, one line for `refdec --help`). A command's module is imported
# only when that command runs, so `refdec --help` needs neither torch nor any optional package.
COMMANDS = {
    "decode": ("decode", "decode a test set or any file with one of refdec's algorithms"),
    "train": ("train", "train a model, drafter, proposal heads or small model from a preset"),
    "bench": ("bench", "every GPU table in one command"),
    "hf": (
        "hfcli",
        "Hugging Face transformers folders: import one as a checkpoint, export a checkpoint, "
        "audit transformers' decoders",
    ),
    "ctranslate2": ("ctranslate2", "refdec against CTranslate2 on the same weights"),
    "stepcost": ("stepcost", "the cost of one decoder call appending q tokens"),
    "ceiling": ("ceiling", "draft-then-verify speed when the draft is right"),
    "distill": ("distill", "sequence-level distillation of a teacher's outputs into a data folder"),
    "fuzz": ("fuzz", "every lossless decoder against greedy on random tiny models"),
    "train-drafters": ("train_drafters", "a drafter and heads: the mt-en-de ones on one GPU, or your model's"),
    "int8bench": ("int8bench", "the candidate int8 products timed on a model's shapes"),
    "machine": ("machine", "this machine's kernel choices and rounding properties, probed, with their figures"),
}


def entry() -> str:
    """How this process was started, as the user typed it: `refdec` (the installed entry point) or
    `python -m refdec`."""
    return "refdec" if Path(sys.argv[0]).name.removesuffix(".exe") == "refdec" else "python -m refdec"


def as_typed(command: str) -> str:
    """A command as the user typed it, for its usage line and the commands it names: `python decode.py`
    from the repository's script of that name, else `refdec decode` or `python -m refdec decode`."""
    script = f"{command}.py"
    return f"python {script}" if Path(sys.argv[0]).name == script else f"{entry()} {command}"


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = [
        f"usage: {entry()} <command> [options]  ({entry()} <command> --help: the command's own)",
        "",
        "A reference implementation of lossless and speculative decoding for seq2seq Transformers.",
        "",
        "commands:",
    ]
    lines += [f"  {name:{width}}{summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command argv[0] names with the rest of argv; --help (or nothing) lists the commands, an
    unknown name is one line and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__

        print(f"refdec {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"error: {entry()}: no command {argv[0]!r}; choose from {', '.join(COMMANDS)} ({entry()} --help)",
            file=sys.stderr,
        )
        return 2
    return command_main(argv[0])(argv[1:])


def command_main(name: str):
    """The main function of the command typed as `name` (a key of COMMANDS), its module imported now:
    how one command runs another (bench runs stepcost, ceiling and hf)."""
    return importlib.import_module(f"{__name__}.{COMMANDS[name][0]}").main
