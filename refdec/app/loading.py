"""The checkpoints one decode.py invocation needs, each file loaded once.

A run decodes with a "model" (the one whose output it produces) and, for some algorithms, a
companion model beside it: GAD's block drafter, or BiLD's and speculative sampling's small model
(`Algorithm.companion_roles`); blockwise decoding reads proposal heads from the model's own file.
`RunLoader` loads the main checkpoint, the other checkpoints compared runs name (`--compare
ALGO@CKPT`, same tokenizer), and the companion models, and hands each run a `Models` record: the
models its algorithm reads (`Algorithm.run(models, ...)`).

A companion model trained on a large model's encoder (train.py --encoder-from) reads the large model
already in memory, so the encoder runs once for both; with another large model it loads the
encoder it was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..adapters import EarlyExit, SharedEncoder
from ..checkpoint import CheckpointError, file_sha256, load_model
from ..drafter import Drafter
from ..errors import UsageError
from ..proposal import load_proposal
from ..routes import check_route, on_route
from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class Models:
    """The models one run decodes with."""

    model: torch.nn.Module  # the model whose output is produced (the verifier, the large model)
    path: Path  # its checkpoint
    drafter: Drafter | None = None  # GAD's block drafter, with the block size and layout it was trained for
    small: torch.nn.Module | None = None  # BiLD's and speculative decoding's small model (or an EarlyExit)
    heads: torch.nn.Module | None = None  # blockwise decoding's proposal heads, from the model's checkpoint
    number_values: torch.Tensor | None = None  # blockwise --block-rule distance: each token's numeric value

    def all(self) -> list[torch.nn.Module]:
        drafter = self.drafter.model if self.drafter is not None else None
        return [m for m in (self.model, drafter, self.small, self.heads) if isinstance(m, torch.nn.Module)]


class LoadError(CheckpointError):
    """A checkpoint that does not fit the run (another tokenizer, no heads, not a drafter): one line."""


def load_any(
    path: str | Path,
    *,
    task: str | None,
    device,
    dtype: torch.dtype,
    loaded: dict | None = None,
    languages: tuple[str | None, str | None] = (None, None),
):
    """load_model for a refdec checkpoint; a transformers model folder (refdec.hf, which carries no
    task) for a folder, with `languages` (source, target) its forced language tokens."""
    if Path(path).is_dir():
        from ..hf.importing import load_folder

        return load_folder(path, device=device, dtype=dtype, src_lang=languages[0], tgt_lang=languages[1])
    if any(languages):
        raise LoadError(
            "--src-lang and --tgt-lang choose the language tokens of a transformers model folder; "
            f"{path} is a refdec checkpoint"
        )
    return load_model(path, task=task, device=device, dtype=dtype, loaded=loaded)


class RunLoader:
    def __init__(
        self,
        main_path: str | Path,
        *,
        task: str,
        device: str,
        dtype: torch.dtype,
        languages: tuple[str | None, str | None] = (None, None),
    ):
        self.task, self.device, self.dtype, self.languages = task, device, dtype, languages
        self.main_path = Path(main_path)
        model, self.tokenizer, checkpoint = load_any(
            main_path, task=task, device=device, dtype=dtype, languages=languages
        )
        self.loaded = {self.main_path.resolve(): (model, checkpoint)}  # large models by file
        self.loaded_companions: dict = {}  # (role, file, large model's file) -> {role: model}
        self.hashes: dict = {}
        self.shared: dict = {}  # companion models of every run that names none of its own

    @property
    def model(self):
        return self.loaded[self.main_path.resolve()][0]

    @property
    def checkpoint(self) -> dict:
        return self.loaded[self.main_path.resolve()][1]

    @property
    def max_positions(self) -> int:
        """Positions left for a source (or an output) once the models' forced tokens are in."""
        return min(
            m.cfg.max_positions - max(len(m.cfg.encoder_prefix), len(m.cfg.decoder_prefix))
            for m, _ in self.loaded.values()
        )

    def add(self, path: str | Path) -> None:
        """Another large model for compared runs (`ALGO@CKPT`), on the main model's tokenizer."""
        if Path(path).resolve() in self.loaded:
            return
        model, tok, checkpoint = load_any(
            path,
            task=self.task,
            device=self.device,
            dtype=self.dtype,
            languages=self.languages if Path(path).is_dir() else (None, None),
        )
        if tok.sha256 != self.tokenizer.sha256:
            raise LoadError(f"{path} has a different tokenizer from {self.main_path}; compared runs must share one")
        self.loaded[Path(path).resolve()] = (model, checkpoint)

    def share(self, role: str, value: str) -> None:
        """The companion model (`role`: drafter or small) of every run that names none of its own."""
        self.shared.update(self.load_companion(role, value, self.main_path))

    def load_companion(self, role: str, value: str, large_path: Path) -> dict:
        """A small model or drafter (a file, or 'early-exit': the exit inside the large model of
        `large_path`), each file loaded once per large model."""
        large, large_checkpoint = self.loaded[large_path.resolve()]
        if value == "early-exit":  # BiLD section 4.4
            if "early_exit" not in large_checkpoint:
                raise LoadError(f"{large_path} has no early exit; train one with train.py --early-exit N")
            return {"small": EarlyExit(large, large_checkpoint["early_exit"])}
        key = (role, Path(value).resolve(), large_path.resolve())
        if key not in self.loaded_companions:
            model, tok, checkpoint = load_any(
                value,
                task=self.task,
                device=self.device,
                dtype=self.dtype,
                loaded={self.sha256(large_path): large},
                languages=self.languages if Path(value).is_dir() else (None, None),
            )
            if tok.sha256 != self.tokenizer.sha256:
                raise LoadError(f"{role} {value} does not share the tokenizer of {self.main_path}")
            if (model.cfg.encoder_prefix, model.cfg.decoder_prefix) != (
                large.cfg.encoder_prefix,
                large.cfg.decoder_prefix,
            ):
                raise LoadError(f"{role} {value} does not force the tokens {large_path} forces (language codes, <s>)")
            if role == "drafter" and "drafter" not in checkpoint:
                raise LoadError(f"{value} is not a block drafter (train one with train.py --drafter-k)")
            if role == "drafter":  # the model with the block size and layout it was trained for
                model = Drafter(model, k=checkpoint["drafter"]["k"], layout=checkpoint["drafter"]["layout"])
            self.loaded_companions[key] = {role: model}
        return self.loaded_companions[key]

    def sha256(self, path: Path) -> str:
        if path.resolve() not in self.hashes:
            self.hashes[path.resolve()] = file_sha256(path) if path.is_file() else f"folder {path.resolve()}"
        return self.hashes[path.resolve()]

    def models_for(self, path: Path, model_args: tuple[str, ...] = (), companions: dict | None = None) -> Models:
        """The models of one run on the large model of `path`, with the Models fields `model_args`
        names ("drafter", "small", "heads"); `companions` names the run's own companion models
        ({"small": PATH, "drafter": PATH}), the others are the shared ones."""
        large, checkpoint = self.loaded[path.resolve()]
        found = dict(self.shared)
        for role, value in (companions or {}).items():
            found.update(self.load_companion(role, value, path))
        if "heads" in model_args:
            heads = load_proposal(checkpoint, device=self.device, dtype=self.dtype)
            if heads is None:
                what = "is a transformers folder, with" if path.is_dir() else "has"
                raise LoadError(
                    f"{path} {what} no proposal heads; blockwise runs on a refdec checkpoint with heads "
                    "trained by train.py --proposal-k (docs/usage.md, section Training)"
                )
            found.update(heads=heads, number_values=number_values(self.tokenizer).to(self.device))
        keep = set(model_args) | ({"number_values"} if "heads" in model_args else set())
        return Models(large, path, **{k: v for k, v in found.items() if k in keep})


def load_models(
    specs: list,
    shared: dict,
    *,
    task: str,
    device,
    dtype: torch.dtype,
    route: str = "reference",
    languages: tuple[str | None, str | None] = (None, None),
) -> tuple[RunLoader, list[Models]]:
    """The models of each of refdec.app.plan's `specs`, every checkpoint loaded once: the first run's
    model, the other checkpoints compared runs name, the `shared` companion models (role -> path) and
    each run's own, each wrapped for `route` (one of refdec.routes.ROUTES: `routed`): reference,
    row-invariant mode (invariant), the fast route (refdec.routes.fast) or the graphed route
    (refdec.routes.graphed); a spec with `int8` in int8 (refdec.routes.int8), on a route object of its
    own around the same model, the same one for every int8 run (so each lossless int8 run is checked
    against greedy on int8). Returns the loader (the tokenizer, the main checkpoint) and one Models per spec."""
    try:  # before anything is loaded
        check_route(route, any(s.int8 for s in specs))
    except ValueError as e:
        raise UsageError(str(e)) from None
    loader = RunLoader(specs[0].path, task=task, device=device, dtype=dtype, languages=languages)
    for s in specs[1:]:
        loader.add(s.path)
    for role, value in shared.items():
        loader.share(role, value)
    models = [loader.models_for(s.path, s.algo.model_args, s.companions) for s in specs]
    large: dict = {}  # (checkpoint, int8) -> its model on the route: the runs on it share one route object
    for s, m in zip(specs, models):
        if (m.path, s.int8) not in large:
            large[m.path, s.int8] = on_route(m.model, route, s.int8)
    return loader, [routed(m, route, s.int8, large[m.path, s.int8]) for s, m in zip(specs, models)]


def routed(models: Models, route: str, int8: bool, large=None) -> Models:
    """`models` on `route` (refdec.routes.on_route), with `int8` in int8: new wrappers around the same
    models, which stay as they are (float runs and int8 runs read one model each). The large model is
    put on the route once (or is `large`, its route already made: the runs of one checkpoint read one
    route object, so each lossless run is checked against greedy on that route), and an adapter that
    reads it (an early exit, a decoder on its encoder) is built again around that route, so that the
    pair still shares one encoder pass."""
    large = on_route(models.model, route, int8) if large is None else large
    drafter = models.drafter
    if drafter is not None:
        drafter = replace(drafter, model=beside(drafter.model, models.model, large, route, int8))
    return replace(
        models,
        model=large,
        drafter=drafter,
        small=beside(models.small, models.model, large, route, int8),
        heads=None if models.heads is None else on_route(models.heads, route, int8),
    )


def beside(module, model, model_routed, route: str, int8: bool):
    """A companion `module` of `model` on `route`: an adapter reading `model` reads `model_routed`, the
    model's route; any other adapter or model is put on the route itself (None stays None)."""

    def on(m):
        return model_routed if m is model else on_route(m, route, int8)

    if isinstance(module, EarlyExit):
        return EarlyExit(on(module.base), module.layers)
    if isinstance(module, SharedEncoder):
        return SharedEncoder(on(module.small), on(module.base))
    return None if module is None else on(module)


def number_values(tokenizer: Tokenizer) -> torch.Tensor:
    """For blockwise distance-based selection: each token's numeric value (NaN if it is not a number)."""
    vals = torch.full((tokenizer.vocab_size,), float("nan"))
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i]).strip()
        if text and text.replace(".", "", 1).replace(",", "", 1).lstrip("-").isdigit():
            try:
                vals[i] = float(text.replace(",", ""))
            except ValueError:
                pass
    return vals
