"""Position tables of the Hugging Face families a refdec model can be imported from; the paper's own
sinusoidal table (section 3.5) is refdec.model.sinusoidal_positions.

Each table is (n, d) float64 with row p the encoding of position p, built as transformers builds it,
so an imported model adds the values its Hugging Face twin adds. ModelConfig.positions names the
table; `FAMILY_TABLES` maps each name other than "sinusoidal" to its builder. `table_rows` reads a
call's rows of whichever table, one offset for the call or one per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
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
    return emb[pad_id + 1 :].double()


def marian_positions(n: int, d: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding's (n, d) table in float64: the paper's frequencies
    10000^(-2i/d) laid out [sin | cos], computed in numpy's float64 and rounded to float32, as
    transformers computes it (the values a float64 transformers model holds too)."""
    denom = np.array([np.power(10000, 2 * (j // 2) / d) for j in range(d)])  # (d,) one scalar power each
    position_enc = np.arange(n)[:, None] / denom[None, :]  # (n, d)
    out = torch.empty(n, d, dtype=torch.float32)
    sentinel = d // 2 if d % 2 == 0 else d // 2 + 1
    out[:, :sentinel] = torch.tensor(np.sin(position_enc[:, 0::2]), dtype=torch.float32)
    out[:, sentinel:] = torch.tensor(np.cos(position_enc[:, 1::2]), dtype=torch.float32)
    return out.double()


FAMILY_TABLES: dict[str, Callable[[ModelConfig], torch.Tensor]] = {
    "m2m100": lambda cfg: m2m100_positions(cfg.max_positions, cfg.d_model, cfg.pad_id),
    "marian": lambda cfg: marian_positions(cfg.max_positions, cfg.d_model),
    # learned tables are parameters (refdec.variants.learned_positions); T5 has none (a bias per
    # attention score instead): zeros, which add nothing
    "learned": lambda cfg: torch.zeros(cfg.max_positions, cfg.d_model, dtype=torch.float64),
    "relative": lambda cfg: torch.zeros(cfg.max_positions, cfg.d_model, dtype=torch.float64),
}


def table_rows(
    table: torch.Tensor, offset: int | torch.Tensor, tokens: torch.Tensor, real: torch.Tensor | None, limit: int
) -> torch.Tensor:
    """The rows of a position table (limit, D) for tokens (B, T) at positions offset .. offset + T - 1:
    (T, D) for one offset; (B, T, D) for an offset (B,) per row (a ragged cache) or with `real` (B,), each
    row's real tokens (the padding's positions beyond them clamped to the table's end: never read). A
    position past the table is refused."""
    T = tokens.shape[1]
    ends = offset + (T if real is None else real)
    top = int(ends.max()) if torch.is_tensor(ends) else ends
    if top > limit:
        raise ValueError(f"sequence of {top} positions exceeds max_positions={limit}")
    if torch.is_tensor(offset) or real is not None:
        at = torch.as_tensor(offset, device=tokens.device).reshape(-1, 1) + torch.arange(T, device=tokens.device)
        return table[at.clamp(max=limit - 1)]  # (B or 1, T, D): the same table rows
    return table[offset : offset + T]
