"""Decoders, one per file, and the registry decode.py chooses from.

Every decoder has the shape `decode_x(model, src, *, max_len, ...knobs) -> DecodeResult`, runs under
torch.inference_mode() and refuses a model in training mode.

`Algorithm.run(models, src, max_len, knobs)` adapts a decoder to decode.py: `models` maps a role
("model", later "drafter", "small") to a loaded Transformer, `knobs` holds the decoder's options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .beam import beam_search
from .greedy import greedy
from .iad import MATCH_POLICIES, find_match, iad
from .result import DecodeResult, DecodeStats, check_eval
from .verify import Verified, verify


@dataclass(frozen=True)
class Algorithm:
    name: str
    run: Callable[[dict, torch.Tensor, int, dict], DecodeResult]
    summary: str
    roles: tuple[str, ...] = ("model",)  # checkpoints it needs; "model" is the one it reproduces
    knobs: tuple[str, ...] = ()  # decode.py options it reads
    lossless: bool = True  # output identical to greedy decoding of the "model" role


ALGORITHMS: dict[str, Algorithm] = {
    "greedy": Algorithm(
        "greedy", lambda models, src, max_len, kn: greedy(models["model"], src, max_len=max_len, trace=kn.get("trace", False)),
        "argmax token by token with a KV cache (the baseline)"),
    "beam": Algorithm(
        "beam", lambda models, src, max_len, kn: beam_search(
            models["model"], src, max_len=max_len, beam_size=kn["beam_size"], length_penalty=kn["length_penalty"],
            trace=kn.get("trace", False)),
        "beam search with a length penalty", knobs=("beam_size", "length_penalty"), lossless=False),
    "iad": Algorithm(
        "iad", lambda models, src, max_len, kn: iad(
            models["model"], src, max_len=max_len, match=kn["match"], max_suffix=kn["max_suffix"],
            max_draft=kn["max_draft"], trace=kn.get("trace", False)),
        "input-guided aggressive decoding: draft a copy of the input, verify it in one call (GEC; "
        "SAD = iad on a deep-encoder/shallow-decoder model)", knobs=("match", "max_suffix", "max_draft")),
}

__all__ = ["ALGORITHMS", "Algorithm", "DecodeResult", "DecodeStats", "MATCH_POLICIES", "Verified", "beam_search",
           "check_eval", "find_match", "greedy", "iad", "verify"]
