"""Position tables of the Hugging Face families a refdec model can be imported from; the paper's own
sinusoidal table (section 3.5) is refdec.model.sinusoidal_positions.

Each table is (n, d) float64 with row p the encoding of position p, built as transformers builds it,
so an imported model adds the values its Hugging Face twin adds. ModelConfig.positions names the
table; `FAMILY_TABLES` maps each name other than "sinusoidal" to its builder.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .config import ModelConfig


def m2m100_positions(n: int, d: int, pad_id: int) -> torch.Tensor:
    """Hugging Face M2M100's (and NLLB's) table, (n, d): row p is its row p + pad_id + 1, [sin | cos]
    halves at frequencies 10000^(-i / (d/2 - 1)), computed in float32 as transformers computes it (so
    a float64 model holds the same float32-rounded values its Hugging Face twin holds)."""
    rows, half = n + pad_id + 1, d // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    emb = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if d % 2:
        emb = torch.cat([emb, torch.zeros(rows, 1)], dim=1)
    return emb[pad_id + 1:].double()


FAMILY_TABLES: dict[str, Callable[[ModelConfig], torch.Tensor]] = {
    "m2m100": lambda cfg: m2m100_positions(cfg.max_positions, cfg.d_model, cfg.pad_id),
}
