"""Where the repository's files are: REPO, the folder holding refdec/, data/ and checkpoints/; shown,
a path as the user would type it; repo_file, a default that a command reads from it;
check_not_shipped, the rule that keeps every command's output out of the shipped checkpoints/ and
data/ (cache_folder, where caches go instead); install_hint, how to install an optional feature;
check_files and list_files, the files a command needs in a copy of the repository (its --files)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from .errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the current folder when it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def repo_file(*parts: str, flag: str | None = None) -> Path:
    """A file of the repository's data/ or checkpoints/ that a command reads by default. They sit beside
    refdec/ in the repository, which `pip install -e .` keeps where they are; `pip install .` copies
    refdec/ alone, and there such a default is one line saying so and what to do, not a file "not found"
    inside site-packages. `flag`: the option that gives the file instead."""
    if not (REPO / "data" / "build.py").is_file():
        instead = f"give {flag}, or " if flag else ""
        raise UsageError(
            f"{Path(*parts).as_posix()} is in refdec's repository, and this refdec "
            f"({Path(__file__).parent}) is installed without it: {instead}run the command from a clone "
            f"of the repository installed with pip install -e ."
        )
    return REPO.joinpath(*parts)


# The optional features, as pyproject.toml's extras: what each one installs.
EXTRAS = {
    "html": ("matplotlib",),
    "hf": ("transformers", "sentencepiece"),
    "ctranslate2": ("ctranslate2", "transformers", "sentencepiece"),
}


def install_hint(extra: str) -> str:
    """The command that installs an optional feature (EXTRAS), as it works where the message is read:
    `pip install "refdec[EXTRA]"` where refdec is installed (pip keeps that refdec and adds what the
    extra names), and in a clone its pinned requirements.txt too (the path as the user would type it);
    elsewhere (a copied refdec/ folder) the packages themselves."""
    forms = []
    try:
        importlib.metadata.distribution("refdec")
        forms.append(f'pip install "refdec[{extra}]"')
    except importlib.metadata.PackageNotFoundError:
        pass
    if (REPO / "requirements.txt").is_file():
        forms.append(f"in this clone pip install -r {shown(REPO / 'requirements.txt')}")
    return ", or ".join(forms) or f"pip install {' '.join(EXTRAS[extra])}"


def cache_folder(*parts: str) -> Path:
    """A folder of refdec's caches, outside the repository: $XDG_CACHE_HOME/refdec/..., else
    ~/.cache/refdec/... (created by whoever writes into it)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "refdec", *parts)


# The folders the repository ships, which commands read and never write unless told to (data/build.py,
# which rebuilds data/, is the one script that writes there by design).
SHIPPED = {"checkpoints": "the shipped models", "data": "the shipped data sets"}


def check_not_shipped(
    flag: str, path: str | Path, opt_in: tuple[str, bool] | None = None, instead: str = "another path"
) -> None:
    """Refuse an output path that is, or lies in, the repository's checkpoints/ or data/, however it is
    spelled (relative to the current folder, with `..`, through a symbolic link). A path inside one passes only where
    the command has an opt-in flag and it was given (`opt_in`: its name, and whether given: --overwrite of train.py,
    refdec.commands.distill and refdec.commands.train_drafters); the folder itself never.
    `instead`: what the message suggests in its place."""
    p = Path(path).resolve()
    for name, what in SHIPPED.items():
        folder = (REPO / name).resolve()
        if p == folder:
            raise UsageError(f"{flag} {path} is the folder of {what} itself ({name}/): give {instead}")
        if folder in p.parents and not (opt_in and opt_in[1]):
            told = f", or add {opt_in[0]} to write there (replacing what is there)" if opt_in else ""
            raise UsageError(f"{flag} {path} is inside {name}/, the folder of {what}: give {instead}{told}")


def check_files(paths: list[str], command: str) -> None:
    """Refuse, in one line, a run from a copy that lacks some of the repository files `paths` (relative,
    what `command --files` lists): without the repository at all (`pip install .`), repo_file's line."""
    missing = [p for p in paths if not (REPO / p).is_file()]
    if missing:
        repo_file(missing[0])
        raise UsageError(
            f"{missing[0]} is not in this copy of the repository ({len(missing)} file(s) missing): "
            f"copy every file `{command} --files` lists"
        )


def list_files(paths: list[str], command: str, max_bytes: int) -> int:
    """A command's --files: `paths` on stdout, one a line, and their count and total size on stderr;
    a missing file or a total over `max_bytes` (what a copy for a GPU machine may hold) is a UsageError."""
    check_files(paths, command)
    total = sum((REPO / p).stat().st_size for p in paths)
    print("\n".join(paths))
    print(
        f"{len(paths)} files, {total / 2**20:.1f} MiB ({total:,} bytes; at most {max_bytes / 2**20:.0f} MiB)",
        file=sys.stderr,
    )
    if total > max_bytes:
        raise UsageError(
            f"the files come to {total / 2**20:.1f} MiB, more than the {max_bytes / 2**20:.0f} MiB a copy may hold"
        )
    return 0
