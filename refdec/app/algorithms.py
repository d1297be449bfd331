"""The algorithms decode.py offers, and their options, read from the decoders themselves.

Each entry of ALGORITHMS names a decoder in refdec/decoding/ and the models it takes besides the
one whose output it produces. A decoder's options are its keyword-only parameters that have a
plain default (bool, int, float or str): their names, types and defaults come from the function's
signature, so the library and the command line cannot disagree. OPTIONS adds what a signature
cannot say: the help text, the allowed range, and the option another one depends on
(--top-k means something only with --block-rule top-k).

    algo = ALGORITHMS["iad"]
    algo.defaults()                      # {"match": "unique", "max_suffix": 0, "max_draft": 0}
    algo.run(models, src, max_len=64, options=algo.defaults())    # -> DecodeResult
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from ..decoding import (
    DecodeResult,
    decode_beam,
    decode_bild,
    decode_blockwise,
    decode_gad,
    decode_greedy,
    decode_iad,
    decode_speculative,
)
from ..decoding.blockwise import BLOCK_RULES
from ..decoding.iad import MATCH_POLICIES
from .loading import Models


@dataclass(frozen=True)
class Option:
    """What the command line says and checks about one decoder option (its type and default come
    from the decoders' signatures)."""

    help: str
    metavar: str | None = None
    minimum: float | None = None  # smallest allowed value
    above_minimum: bool = False  # the minimum itself is not allowed
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    needs: tuple[str, object] | None = None  # (option, value) without which this one has no effect

    def check(self, name: str, value) -> None:
        """Raise ValueError with a one-line message when `value` is not allowed."""
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, not {value}")
        if self.choices and value not in self.choices:
            raise ValueError(f"{flag} must be one of {', '.join(self.choices)}, not {value!r}")
        low, high = self.minimum, self.maximum
        too_low = low is not None and (value < low or (self.above_minimum and value == low))
        if too_low or (high is not None and value > high):
            bound = ("above" if self.above_minimum else "at least") + f" {low:g}" if low is not None else ""
            if high is not None:
                bound = (
                    f"between {low:g} and {high:g}"
                    if low is not None and not self.above_minimum
                    else (bound + " and " if bound else "") + f"at most {high:g}"
                )
            raise ValueError(f"{flag} must be {bound}, not {value}")


OPTIONS: dict[str, Option] = {
    "beam_size": Option("beam: beams kept", "K", minimum=1),
    "length_penalty": Option("beam: score = log p / length^A", "A", minimum=-10, maximum=10),
    "match": Option(
        "iad: which source position to draft from. unique (the paper's): shortest output suffix that "
        "occurs once in the source; leftmost: as unique, but a repeated n-gram drafts from its leftmost "
        "occurrence; longest: longest suffix that occurs, leftmost occurrence (prompt lookup's rule)",
        choices=MATCH_POLICIES,
    ),
    "max_suffix": Option("iad: longest output suffix matched, in tokens (0 = no limit)", "N", minimum=0),
    "max_draft": Option(
        "iad: most tokens drafted per verifier call, the papers' L_max (0 = up to the end of the source)",
        "N",
        minimum=0,
    ),
    "top_beta": Option(
        "gad: GAD++ accepts a drafted token within the verifier's top B (1: GAD, lossless)", "B", minimum=1
    ),
    "tau": Option("gad: ... and within T of the top-1 log-probability", "T", minimum=0),
    "block_rule": Option(
        "blockwise: exact (lossless), top-k (a proposal within p_1's top --top-k), distance (numbers within --epsilon)",
        choices=BLOCK_RULES,
    ),
    "top_k": Option("blockwise --block-rule top-k: K", "K", minimum=1, needs=("block_rule", "top-k")),
    "epsilon": Option("blockwise --block-rule distance: E", "E", minimum=0, needs=("block_rule", "distance")),
    "min_block": Option("blockwise: accept at least L tokens per call (more than 1 is lossy)", "L", minimum=1),
    "block_size": Option(
        "gad, blockwise: tokens drafted per verifier call (0 = the k the drafter or heads were "
        "trained for; blockwise: 2 .. that k, using the first K - 1 heads; lossless at any K)",
        "K",
        minimum=0,
    ),
    "fallback_threshold": Option(
        "bild: the small model writes while its max probability is at least P (above 1: "
        "the large model writes every token)",
        "P",
        minimum=0,
    ),
    "rollback_threshold": Option(
        "bild: roll back at the first small-model token with -log p_large above D (nats)", "D", minimum=0
    ),
    "max_window": Option("bild: the small model writes at most N tokens between large-model calls", "N", minimum=1),
    "gamma": Option("speculative: tokens drafted per large-model call", "N", minimum=1),
    "sample": Option("bild, speculative: sample instead of argmax"),
    "top_p": Option(
        "bild, speculative: nucleus sampling mass (speculative sampling then follows the large "
        "model's nucleus distribution)",
        "P",
        minimum=0,
        above_minimum=True,
        maximum=1,
        needs=("sample", True),
    ),
    "temperature": Option(
        "speculative: sampling temperature", "T", minimum=0, above_minimum=True, needs=("sample", True)
    ),
    "seed": Option("bild, speculative: sampling seed", "N", needs=("sample", True)),
}


@dataclass(frozen=True)
class Algorithm:
    name: str
    decoder: Callable[..., DecodeResult]
    summary: str
    model_args: tuple[str, ...] = ()  # the Models fields it takes after the model: "drafter", "small", "heads"
    lossless_if: Callable[[dict], bool] | None = None  # options that keep it lossless (None: always lossless)
    lossy: bool = False  # never lossless (beam search, BiLD)
    model_dir: str = "{task}"  # checkpoints/<model_dir>/model.pt is its default model
    model_kwargs: Callable[[Models], dict] | None = None  # keyword inputs it takes from the models (not options)

    def defaults(self) -> dict:
        """The decoder's options and their defaults, from its signature."""
        return {
            name: p.default
            for name, p in inspect.signature(self.decoder).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name in OPTIONS
        }

    @cached_property
    def options(self) -> tuple[str, ...]:
        return tuple(self.defaults())

    @property
    def companion_roles(self) -> tuple[str, ...]:
        """The roles of its companion models, the checkpoints it reads besides the model: "drafter",
        "small" (proposal heads live in the model's own file)."""
        return tuple(r for r in self.model_args if r != "heads")

    def is_lossless(self, options: dict) -> bool:
        return not self.lossy and (self.lossless_if is None or self.lossless_if(options))

    def checkpoint_dir(self, task: str) -> str:
        """checkpoints/<this>/model.pt is the algorithm's default model for `task`."""
        return BEST_MODEL.get(task, task) if self.model_dir == "{task}" else self.model_dir.format(task=task)

    def run(self, models: Models, src: torch.Tensor, max_len: int, options: dict, trace: bool = False) -> DecodeResult:
        """Decode `src` with the models; `options`: values of this algorithm's options (refdec.app.plan
        gives every run all of them)."""
        inputs = self.model_kwargs(models) if self.model_kwargs else {}
        return self.decoder(
            models.model,
            *(getattr(models, r) for r in self.model_args),
            src,
            max_len=max_len,
            trace=trace,
            **inputs,
            **options,
        )


# A task's best shipped model where it is not checkpoints/<task>/: on both GEC tasks the deep-encoder,
# shallow-decoder 9+3 model corrects best and is the fastest under IAD (UA-GEC test F0.5 0.481
# against 0.472 for 6+6 and 0.343 for the first, 3+3 model, kept for the figures measured on it;
# gec-en 0.427 against 0.408 for 6+6, which has no 3+3 model).
BEST_MODEL = {"gec-uk": "gec-uk-9x3", "gec-en": "gec-en-9x3"}

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("greedy", decode_greedy, "argmax token by token with a KV cache (the baseline)"),
        Algorithm("beam", decode_beam, "beam search with a length penalty", lossy=True),
        Algorithm(
            "iad",
            decode_iad,
            "input-guided aggressive decoding: draft a copy of the input, verify it in one call "
            "(GEC; SAD = iad on a deep-encoder/shallow-decoder model)",
        ),
        Algorithm(
            "gad",
            decode_gad,
            "generalized aggressive decoding: a non-autoregressive drafter proposes a block, the "
            "model verifies it (GAD++ with --top-beta/--tau)",
            model_args=("drafter",),
            lossless_if=lambda o: o["top_beta"] == 1 and o["tau"] == 0,
        ),
        Algorithm(
            "blockwise",
            decode_blockwise,
            "blockwise parallel decoding: proposal heads on the model guess k tokens, "
            "one call verifies them and proposes the next block",
            model_args=("heads",),
            model_dir="{task}-blockwise",
            lossless_if=lambda o: o["block_rule"] == "exact" and o["min_block"] == 1,
            model_kwargs=lambda m: {"values": m.number_values},
        ),
        Algorithm(
            "bild",
            decode_bild,
            "big-little decoder: a small model writes while confident; the large model falls back and rolls back",
            model_args=("small",),
            lossy=True,
        ),
        Algorithm(
            "speculative",
            decode_speculative,
            "speculative sampling: the small model drafts gamma tokens, "
            "rejection sampling against the large model (greedy without --sample)",
            model_args=("small",),
            lossless_if=lambda o: not o["sample"],
        ),
    )
}


def option_defaults() -> dict[str, dict[str, object]]:
    """option -> {algorithm: its default} over every algorithm that takes the option."""
    out: dict[str, dict[str, object]] = {name: {} for name in OPTIONS}
    for algo in ALGORITHMS.values():
        for name, default in algo.defaults().items():
            out[name][algo.name] = default
    return out


def check_options(algo: Algorithm, options: dict, given: set[str]) -> None:
    """Raise ValueError for a value out of range, or for an option given where the option it
    depends on does not let it act (refused, never silently ignored)."""
    for name, value in options.items():
        OPTIONS[name].check(name, value)
        needs = OPTIONS[name].needs
        if name in given and needs and options.get(needs[0]) != needs[1]:
            want = f"--{needs[0].replace('_', '-')}" + ("" if needs[1] is True else f" {needs[1]}")
            raise ValueError(f"--{name.replace('_', '-')} has no effect without {want}")


def parse_value(name: str, text: str, default):
    """An option's value from text, read as its command-line flag reads it."""
    if isinstance(default, bool):
        if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"{name.replace('_', '-')}={text} is not true or false")
        return text.lower() in ("1", "true", "yes", "on")
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"{name.replace('_', '-')}={text} is not a {type(default).__name__}") from None
