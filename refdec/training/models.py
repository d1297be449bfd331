"""The models a training run starts from: a new one of the configuration's shape, the init_from
checkpoint's (build_model), a decoder on another model's frozen encoder started from a whole model's
first decoder layers (decoder_from), and a checkpoint's model frozen for reading (frozen_model: the
encoder of encoder_from, a distillation teacher, a drafter's verifier).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import ModelConfig, TrainConfig
from ..errors import TrainingError
from ..model import Transformer


def frozen_model(checkpoint: dict, device: torch.device) -> Transformer:
    """A checkpoint's model in float32 and eval mode, its weights frozen (an encoder or a teacher)."""
    return _float_model(checkpoint).to(device).eval().requires_grad_(False)


def _float_model(checkpoint: dict, *, part: bool = False, **changes) -> Transformer:
    """A Transformer of the checkpoint's shape with `changes` (ModelConfig fields), holding the checkpoint's
    weights in float32: all of them, or with `part` those the model has (a decoder from a whole model's
    first layers)."""
    model = Transformer(replace(ModelConfig.from_dict(checkpoint["model_config"]), **changes))
    state = {k: v.float() for k, v in checkpoint["model"].items()}
    model.load_state_dict({k: state[k] for k in model.state_dict()} if part else state)
    return model


def build_model(
    cfg: TrainConfig,
    vocab_size: int,
    base: dict | None = None,
    encoder: Transformer | None = None,
    device: torch.device | str = "cpu",
) -> Transformer:
    """The model a run trains: a new one of cfg's shape (reading `encoder`'s states, the frozen encoder
    of encoder_from, if given), or that of the init_from checkpoint `base` with cfg's dropout (on
    `encoder`: decoder_from)."""
    if encoder is not None and base is not None:
        return decoder_from(base, cfg, encoder).to(device)
    if encoder is not None:
        return Transformer(cfg.model_config(vocab_size, d_memory=encoder.cfg.d_model)).to(device)
    if base is not None:
        return _float_model(base, dropout=cfg.dropout).to(device)
    return Transformer(cfg.model_config(vocab_size)).to(device)


def decoder_from(base: dict, cfg: TrainConfig, encoder: Transformer) -> Transformer:
    """A decoder on the frozen encoder of encoder_from (GAD's drafter), started from the init_from
    checkpoint `base`: one already on that encoder (a shipped drafter) goes on as it is; a whole model
    (the verifier) gives its embeddings, its first dec_layers decoder layers, its final norm and its
    output projection, so the drafter starts as the verifier's early exit."""
    shape = ModelConfig.from_dict(base["model_config"])
    if shape.enc_layers == 0:
        if shape.memory_dim != encoder.cfg.d_model:
            raise TrainingError(
                f"{cfg.init_from} reads encoder states of width {shape.memory_dim}, "
                f"{cfg.encoder_from} gives {encoder.cfg.d_model}"
            )
        return _float_model(base, dropout=cfg.dropout)
    else:
        differ = [
            f"{f} {getattr(cfg, f)} (the model's: {getattr(shape, f)})"
            for f in ("d_model", "n_heads", "d_ff")
            if getattr(cfg, f) != getattr(shape, f)
        ]
        if differ or cfg.dec_layers > shape.dec_layers:
            raise TrainingError(
                f"a decoder started from {cfg.init_from} takes its width and at most its "
                f"{shape.dec_layers} decoder layers: {', '.join(differ) or f'dec_layers {cfg.dec_layers}'}"
            )
        return _float_model(  # the first dec_layers layers; no encoder
            base, part=True, enc_layers=0, dec_layers=cfg.dec_layers, d_memory=encoder.cfg.d_model, dropout=cfg.dropout
        )
