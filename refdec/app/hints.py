"""What a command says when a path it was given cannot be right, and how to make the checkpoint
that is missing: one-line hints that name the flag the user typed and a fix that exists."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..presets import PRESETS


def train_hint(folder: str, task: str) -> str:
    """How to train the checkpoint of checkpoints/<folder>: its preset, or the mt-en-de preset of the
    same kind whose options docs/usage.md (section Training) explains."""
    if folder in PRESETS:
        return f"train one: python train.py --preset {folder} (docs/usage.md, section Training)"
    like = folder.replace(task, "mt-en-de", 1)
    if like in PRESETS:
        return f"train one with the options of --preset {like} (docs/usage.md, section Training)"
    return "train one (docs/usage.md, section Training)"


def check_checkpoint_path(given: str, value: str) -> None:
    """A checkpoint argument that cannot be right: a missing path, or a folder of train.py's (a
    model.pt inside, no transformers config.json) given instead of the model.pt in it. `given` is
    what the user typed before the path ("--model ", "--compare greedy@")."""
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{given}{value}: no such file or folder")
    if path.is_dir() and not (path / "config.json").is_file():
        if (path / "model.pt").is_file():
            raise UsageError(f"{given}{value} is a folder: give the checkpoint in it, {given}{path / 'model.pt'}")
        raise UsageError(
            f"{given}{value} is a folder with neither a model.pt nor a config.json: give a refdec "
            f"checkpoint (a model.pt written by train.py) or a transformers model folder"
        )
