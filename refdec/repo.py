"""Where the repository's files are: REPO, the folder holding refdec/, data/ and checkpoints/, and
repo_file, a default that a command reads from it."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def repo_file(*parts: str, flag: str | None = None) -> Path:
    """A file of the repository's data/ or checkpoints/ that a command reads by default. They sit beside
    refdec/ in the repository, which `pip install -e .` keeps where they are; `pip install .` copies
    refdec/ alone, and there such a default is one line saying so and what to do, not a file "not found"
    inside site-packages. `flag`: the option that gives the file instead."""
    if not (REPO / "data" / "build.py").is_file():
        instead = f"give {flag}, or " if flag else ""
        raise UsageError(f"{Path(*parts).as_posix()} is in refdec's repository, and this refdec "
                         f"({Path(__file__).parent}) is installed without it: {instead}run the command from a clone "
                         f"of the repository installed with pip install -e .")
    return REPO.joinpath(*parts)
