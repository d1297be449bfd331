"""Checkpoints: written atomically, loaded safely, averaged.

A checkpoint is a plain dict of tensors and primitives, so it loads with
`torch.load(..., weights_only=True)`: a file from an untrusted source can never run code.

    {"format": FORMAT, "task": str, "model_config": dict, "model": state_dict,
     "tokenizer_sha256": str, "step": int, "meta": dict, ...training state in last.pt only}

The tokenizer lives beside the checkpoint as tokenizer.json; its sha256 is recorded so a
checkpoint paired with the wrong vocabulary is refused instead of decoding garbage.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import torch

from .adapters import SharedEncoder
from .config import ModelConfig
from .errors import CheckpointError, first_line
from .model import Transformer
from .tokenizer import Tokenizer

FORMAT = "refdec-checkpoint-1"


def save_atomic(obj: dict, path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, then rename: a kill never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():  # train.py's output folder given for the model.pt in it
        inside = (
            f": give the checkpoint in it, {path / 'model.pt'}"
            if (path / "model.pt").is_file()
            else " with no model.pt in it: give a checkpoint file (a model.pt written by train.py)"
        )
        raise CheckpointError(f"{path} is a folder{inside}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a legacy pickle
        raise CheckpointError(
            f"{path} is not a checkpoint (a model.pt written by train.py); "
            f"give the model.pt file of a checkpoint folder"
        )
    size = path.stat().st_size
    if head.startswith(b"PK") and not zipfile.is_zipfile(path):  # a zip's directory is at its end: cut off
        raise CheckpointError(
            f"{path} is truncated or not a checkpoint ({size:,} bytes, and no zip directory at "
            f"its end, where a whole checkpoint file has one): copy or download it again"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file, a foreign pickle
        raise CheckpointError(
            f"{path} is truncated, damaged or not a checkpoint ({size:,} bytes; torch cannot read it: "
            f"{type(e).__name__}: {first_line(e, 160)})"
        ) from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a refdec checkpoint (format {FORMAT})")
    if "frozen_base" in checkpoint and "model" not in checkpoint:
        checkpoint["model"] = frozen_base(path, checkpoint)["model"]
    return checkpoint


def referenced_file(path: str | Path, spec: dict, role: str) -> Path:
    """The file another checkpoint stands on ({path: relative to the folder of `path`, sha256}),
    checked to be there and to be the very file it was trained on."""
    target = Path(path).parent / spec["path"]
    if not target.is_file():
        raise CheckpointError(f"{path} {role} {target}, which is not there")
    if file_sha256(target) != spec["sha256"]:
        raise CheckpointError(
            f"{target} is not the model {path} was trained on (its sha256 differs); retrain {path} on it"
        )
    return target


def frozen_base(path: str | Path, checkpoint: dict) -> dict:
    """The checkpoint whose weights a heads-only file (proposal heads on a frozen base, written by
    the trainer without the base's weights) stands on: the file its `frozen_base` entry names,
    relative to its folder, checked to be the very file it was trained on."""
    base_path = referenced_file(path, checkpoint["frozen_base"], "holds proposal heads on the frozen model")
    base = load_checkpoint(base_path)
    shape = model_shape(base)
    if (
        base.get("tokenizer_sha256") != checkpoint.get("tokenizer_sha256")
        or shape is None
        or shape != model_shape(checkpoint)
    ):
        raise CheckpointError(f"{base_path} does not have the shape and vocabulary of the heads in {path}")
    return base


def model_shape(checkpoint: dict) -> ModelConfig | None:
    """The shape of a checkpoint's model, every field filled in (a file written before a field
    existed holds its default) and dropout left out (training's, not the shape's): two files'
    models are the same network exactly when these are equal."""
    try:
        return replace(ModelConfig.from_dict(checkpoint.get("model_config") or {}), dropout=0.0)
    except (TypeError, ValueError):
        return None


def model_state(model: Transformer, half: bool = False) -> dict:
    """A detached copy of the weights (float16 if `half`). Tied weights stay one tensor under
    several names, so the shared embedding is stored once."""
    copies: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in copies:
            c = t.detach().to("cpu", copy=True)  # a file trained on a GPU loads anywhere
            copies[t.data_ptr()] = c.half() if half and c.is_floating_point() else c
        state[name] = copies[t.data_ptr()]
    return state


def make_checkpoint(
    model: Transformer, task: str, tokenizer: Tokenizer, step: int, meta: dict | None = None, half: bool = False
) -> dict:
    """half=True for shipped files: half the size, loaded back in the dtype the caller asks for."""
    state = model_state(model, half)
    return {
        "format": FORMAT,
        "task": task,
        "model_config": model.cfg.to_dict(),
        "model": state,
        "tokenizer_sha256": tokenizer.sha256,
        "step": step,
        "meta": dict(meta or {}),
    }


def average_states(states: list[dict]) -> dict:
    """Element-wise mean of several state dicts (checkpoint averaging, Vaswani et al. section 6.1)."""
    if not states:
        raise ValueError("nothing to average")
    out = {}
    for k in states[0]:
        if states[0][k].is_floating_point():
            out[k] = sum(s[k].double() for s in states).div(len(states)).to(states[0][k].dtype)
        else:
            out[k] = states[0][k].clone()
    return out


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_model(
    path: str | Path,
    *,
    task: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer_path: str | Path | None = None,
    loaded: dict[str, Transformer] | None = None,
) -> tuple[Transformer, Tokenizer, dict]:
    """Model (in eval mode) + its tokenizer (tokenizer.json beside the checkpoint unless given).

    A decoder trained on another model's encoder (train.py's encoder_from) comes back as a
    SharedEncoder over that model, loaded from the path its checkpoint records (relative to its
    folder) and checked to be the very file it was trained on. `loaded` maps the sha256 of files
    the caller has already loaded (same device and dtype) to their models: such an encoder is
    taken from there, not loaded a second time."""
    checkpoint = load_checkpoint(path)
    if task is not None and checkpoint.get("task") != task:
        raise CheckpointError(f"{path} was trained for task {checkpoint.get('task')!r}, not {task!r}")
    tok_path = Path(tokenizer_path) if tokenizer_path else Path(path).parent / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"tokenizer {tok_path} not found (it is saved beside the checkpoint)")
    try:
        cfg = ModelConfig.from_dict(checkpoint["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its model config cannot be read: {first_line(e, 200)}") from None
    try:  # refdec's own vocabulary, or an imported model's with its special ids (refdec.hf.convert)
        tokenizer = Tokenizer.for_model(
            tok_path.read_text(encoding="utf-8"), pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id
        )
    except Exception as e:
        raise CheckpointError(f"cannot load tokenizer {tok_path}: {first_line(e, 200)}") from None
    if tokenizer.sha256 != checkpoint.get("tokenizer_sha256"):
        raise CheckpointError(f"{tok_path} is not the vocabulary {path} was trained with")
    try:
        model = Transformer(cfg)
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in checkpoint["model"].items()})
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: model weights do not fit its config: {first_line(e, 200)}") from None
    # an imported model may have more embeddings than tokens (t5-small: 32,128 for 32,100), never fewer
    if cfg.vocab_size != tokenizer.vocab_size and not (
        checkpoint.get("imported") and cfg.vocab_size > tokenizer.vocab_size
    ):
        raise CheckpointError(f"{path} has {cfg.vocab_size} embeddings but {tok_path} {tokenizer.vocab_size} tokens")
    model.to(device=device, dtype=dtype).eval()
    if "shared_encoder" in checkpoint:
        model = SharedEncoder(
            model, load_shared_encoder(path, checkpoint, tokenizer, task, device, dtype, loaded)
        ).eval()
    return model, tokenizer, checkpoint


def load_shared_encoder(
    path: str | Path,
    checkpoint: dict,
    tokenizer: Tokenizer,
    task,
    device,
    dtype,
    loaded: dict[str, Transformer] | None = None,
) -> Transformer:
    """The model whose encoder the decoder of checkpoint `path` reads."""
    spec = checkpoint["shared_encoder"]
    enc_path = referenced_file(path, spec, "reads the encoder of")
    if loaded and spec["sha256"] in loaded:
        return loaded[spec["sha256"]]  # the same file (its sha256 was checked above), already in memory
    base, base_tok, _ = load_model(enc_path, task=task, device=device, dtype=dtype)
    if base_tok.sha256 != tokenizer.sha256:
        raise CheckpointError(f"{enc_path} does not share the vocabulary of {path}")
    return base
