"""What every part of refdec.hf shares: its error, the optional imports, a folder's files read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError, first_line
from ..repo import install_hint

LOGIT_TOLERANCE = 1e-12  # float64 logits of refdec and transformers on the same weights
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class HFError(CheckpointError):
    """A folder or checkpoint refdec cannot import or export: one line."""


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise HFError(f"this needs the transformers package ({install_hint('hf')})") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def require_safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise HFError(
            f"reading and writing model.safetensors needs the safetensors package "
            f"(it comes with transformers: {install_hint('hf')})"
        ) from None
    return safetensors.torch


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path}: {first_line(e, 200)}") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors (safetensors preferred; .bin files load with weights_only=True), keys
    without the "model." prefix."""
    found = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if found is None:
        raise HFError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    files = [found]
    if found.name.endswith(".index.json"):
        files = [folder / f for f in sorted(set(read_json(found).get("weight_map", {}).values()))]
        if not files or not all(f.is_file() for f in files):
            raise HFError(f"{found} names shards that are not in {folder}")
    state = {}
    for f in files:
        try:
            if f.name.endswith(".safetensors"):
                part = require_safetensors().load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except HFError:
            raise
        except Exception as e:
            raise HFError(f"cannot load {f}: {type(e).__name__}: {first_line(e, 200)}") from None
        state.update({k.removeprefix("model."): v for k, v in part.items()})
    return state
