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

from .beam import decode_beam
from .bild import decode_bild
from .blockwise import decode_blockwise
from .gad import decode_gad
from .greedy import decode_greedy
from .speculative import decode_speculative
from .iad import MATCH_POLICIES, find_match, decode_iad
from .result import DecodeResult, DecodeStats, check_eval
from .verify import Verified, verify


@dataclass(frozen=True)
class Algorithm:
    name: str
    run: Callable[[dict, torch.Tensor, int, dict], DecodeResult]
    summary: str
    roles: tuple[str, ...] = ("model",)  # checkpoints it needs; "model" is the one it reproduces
    knobs: tuple[str, ...] = ()  # decode.py options it reads
    lossless: bool = True  # output identical to greedy decoding of the "model" role (at default knobs)
    model_dir: str = "{task}"  # checkpoints/<model_dir>/model.pt is its default "model"
    lossless_if: Callable[[dict], bool] | None = None  # knob settings that keep it lossless (None: always)

    def is_lossless(self, knobs: dict) -> bool:
        return self.lossless and (self.lossless_if is None or self.lossless_if(knobs))

    def checkpoint_dir(self, task: str) -> str:
        """checkpoints/<this>/model.pt is the algorithm's default model for `task`."""
        return BEST_MODEL.get(task, task) if self.model_dir == "{task}" else self.model_dir.format(task=task)


# A task's best shipped model where it is not checkpoints/<task>/: on UA-GEC the deep-encoder,
# shallow-decoder 9+3 model corrects best (test F0.5 0.481 against 0.472 for 6+6 and 0.343 for the
# first, 3+3 model, kept for the figures measured on it) and is the fastest under IAD.
BEST_MODEL = {"gec-uk": "gec-uk-9x3"}


ALGORITHMS: dict[str, Algorithm] = {
    "greedy": Algorithm(
        "greedy", lambda models, src, max_len, kn: decode_greedy(models["model"], src, max_len=max_len, trace=kn.get("trace", False)),
        "argmax token by token with a KV cache (the baseline)"),
    "beam": Algorithm(
        "beam", lambda models, src, max_len, kn: decode_beam(
            models["model"], src, max_len=max_len, beam_size=kn["beam_size"], length_penalty=kn["length_penalty"],
            trace=kn.get("trace", False)),
        "beam search with a length penalty", knobs=("beam_size", "length_penalty"), lossless=False),
    "iad": Algorithm(
        "iad", lambda models, src, max_len, kn: decode_iad(
            models["model"], src, max_len=max_len, match=kn["match"], max_suffix=kn["max_suffix"],
            max_draft=kn["max_draft"], trace=kn.get("trace", False)),
        "input-guided aggressive decoding: draft a copy of the input, verify it in one call (GEC; "
        "SAD = iad on a deep-encoder/shallow-decoder model)", knobs=("match", "max_suffix", "max_draft")),
    "gad": Algorithm(
        "gad", lambda models, src, max_len, kn: decode_gad(
            models["model"], models["drafter"], src, max_len=max_len, block_size=kn["block_size"],
            top_beta=kn["top_beta"], tau=kn["tau"], trace=kn.get("trace", False)),
        "generalized aggressive decoding: a non-autoregressive drafter proposes a block, the model verifies "
        "it (GAD++ with --top-beta/--tau)", roles=("model", "drafter"), knobs=("top_beta", "tau", "block_size"),
        lossless_if=lambda kn: kn["top_beta"] == 1 and kn["tau"] == 0),
    "blockwise": Algorithm(
        "blockwise", lambda models, src, max_len, kn: decode_blockwise(
            models["model"], models["heads"], src, max_len=max_len, block_rule=kn["block_rule"], top_k=kn["top_k"],
            values=models["number_values"], epsilon=kn["epsilon"], min_block=kn["min_block"],
            block_size=kn["block_size"], trace=kn.get("trace", False)),
        "blockwise parallel decoding: proposal heads on the model guess k tokens, one call verifies them "
        "and proposes the next block", knobs=("block_rule", "top_k", "epsilon", "min_block", "block_size"), model_dir="{task}-blockwise",
        lossless_if=lambda kn: kn["block_rule"] == "exact" and kn["min_block"] == 1),
    "bild": Algorithm(
        "bild", lambda models, src, max_len, kn: decode_bild(
            models["model"], models["small"], src, max_len=max_len, fallback_threshold=kn["fallback_threshold"],
            rollback_threshold=kn["rollback_threshold"], max_window=kn["max_window"], sample=kn["sample"],
            top_p=kn["top_p"], seed=kn["seed"], trace=kn.get("trace", False)),
        "big-little decoder: a small model writes while confident; the large model falls back and rolls back",
        roles=("model", "small"), knobs=("fallback_threshold", "rollback_threshold", "max_window", "sample", "top_p",
                                         "seed"), lossless=False),
    "speculative": Algorithm(
        "speculative", lambda models, src, max_len, kn: decode_speculative(
            models["model"], models["small"], src, max_len=max_len, gamma=kn["gamma"], sample=kn["sample"],
            temperature=kn["temperature"], top_p=kn["top_p"], seed=kn["seed"], trace=kn.get("trace", False)),
        "speculative sampling: the small model drafts gamma tokens, rejection sampling against the large model "
        "(greedy without --sample)", roles=("model", "small"), knobs=("gamma", "sample", "temperature", "top_p", "seed"),
        lossless_if=lambda kn: not kn["sample"]),
}

__all__ = ["ALGORITHMS", "Algorithm", "DecodeResult", "DecodeStats", "MATCH_POLICIES", "Verified", "beam_search",
           "bild", "blockwise", "check_eval", "find_match", "gad", "greedy", "iad", "speculative", "verify"]
