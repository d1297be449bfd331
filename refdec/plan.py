"""What one decode.py invocation runs: a RunSpec per run, every choice resolved before any model loads.

A run is an algorithm on a checkpoint with its option values, its own second models (or the shared
ones) and its batches: a batch size, or a token budget. The first run is --algo's; `--compare ALGO[@CKPT][:OPTION=VALUE...]` adds
the others (`:int8` puts one on the int8 route, refdec.int8); `--batch-sizes` repeats all of them at each size. Every run finds its default checkpoint
by the same rule (`default_checkpoint`), so `--compare blockwise` runs on the model
`--algo blockwise` would use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .algorithms import ALGORITHMS, OPTIONS, Algorithm, check_options, option_defaults, parse_value
from .errors import UsageError
from .hints import check_checkpoint_path, shown, train_hint

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = REPO / "checkpoints"
SECOND_MODEL_DIRS = {"drafter": "{task}-drafter", "small": "{task}-small-aligned"}


@dataclass(frozen=True)
class Compared:
    """One item of --compare: ALGO, its checkpoint (None: the default) and what it sets itself."""

    name: str
    path: str | None = None
    options: dict = field(default_factory=dict)  # option -> value
    second_models: dict = field(default_factory=dict)  # "small" / "drafter" -> PATH or "early-exit"
    batch_size: int | None = None
    batch_tokens: int | None = None
    int8: bool = False  # :int8, the run on the int8 route (refdec.int8)


@dataclass(frozen=True)
class RunSpec:
    algo: Algorithm
    path: Path  # the checkpoint whose output the run produces
    options: dict  # every option of the algorithm, with its value
    second_models: dict  # the run's own second models (the others are the shared ones)
    batch_size: int  # most sentences per batch (0: no limit, with a token budget)
    label: str
    batch_tokens: int = 0  # most source tokens per batch, padding included (0: batches by batch_size alone)
    int8: bool = False  # its models on the int8 route (refdec.int8)


def check_counts(*, batch_size: int | None, max_len: int | None, limit: int | None, warmup: int, refs: list,
                 input: str | None, batch_tokens: int | None = None) -> None:
    """Numbers that cannot be right whatever the algorithm."""
    for flag, value in (("--batch-size", batch_size), ("--max-len", max_len), ("--batch-tokens", batch_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    for flag, value in (("--limit", limit), ("--warmup", warmup)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} {value}: must be at least 0")
    if refs and not input:
        raise UsageError("--ref needs --input (the default test set brings its own references)")


def parse_sizes(text: str | None, batch_size: int | None) -> list[int]:
    """--batch-sizes as numbers (empty without it); refused beside --batch-size, which it replaces."""
    if not text:
        return []
    if batch_size is not None:
        raise UsageError("--batch-sizes sets every run's batch size: leave out --batch-size")
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes takes whole numbers separated by commas, not {text!r}") from None
    if min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise UsageError("--batch-sizes must be different numbers, each at least 1")
    return sizes


def parse_compare(spec: str) -> list[Compared]:
    """"greedy,beam@ckpt.pt:beam-size=4" -> [Compared("greedy"), Compared("beam", "ckpt.pt", {"beam_size": 4})];
    a bare ":int8" puts that run on the int8 route."""
    out = []
    for item in spec.split(","):
        head, *settings = item.strip().split(":")
        name, _, path = head.partition("@")
        if name not in ALGORITHMS:
            raise UsageError(f"--compare: unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
        if path:
            check_checkpoint_path(f"--compare {name}@", path)
        algo, options, second_models, size, tokens, int8 = ALGORITHMS[name], {}, {}, None, None, False
        for setting in settings:
            if setting == "int8":
                int8 = True
                continue
            key, eq, value = setting.partition("=")
            key = key.replace("-", "_")
            if not eq or not value:
                raise UsageError(f"--compare {item}: write an option as NAME=VALUE (or :int8 alone), not {setting!r}")
            if key in ("batch_size", "batch_tokens"):
                if not value.isdigit() or int(value) < 1:
                    raise UsageError(f"--compare {item}: {key.replace('_', '-')} must be a whole number of at least 1, "
                                     f"not {value!r}")
                size, tokens = (int(value), tokens) if key == "batch_size" else (size, int(value))
            elif key in ("small", "drafter"):
                if key not in algo.roles:
                    raise UsageError(f"--compare {item}: {name} uses no {key} model")
                if not (key == "small" and value == "early-exit"):
                    check_checkpoint_path(f"--compare {head}:{setting.partition('=')[0]}=", value)
                second_models[key] = value
            elif key in algo.options:
                try:
                    options[key] = parse_value(key, value, algo.defaults()[key])
                except ValueError as e:
                    raise UsageError(f"--compare {item}: {e}") from None
            else:
                raise UsageError(f"--compare {item}: {key.replace('_', '-')} is not an option of {name} "
                                 f"(its options: {', '.join(k.replace('_', '-') for k in algo.options) or 'none'})")
        out.append(Compared(name, path or None, options, second_models, size, tokens, int8))
    return out


def default_checkpoint(algo: Algorithm, task: str) -> Path:
    """checkpoints/<the algorithm's folder for task>/model.pt, or a one-line error saying what is shipped."""
    path = CHECKPOINTS / algo.checkpoint_dir(task) / "model.pt"
    if not path.exists():
        raise UsageError(f"--algo {algo.name} --task {task}: no checkpoint at {shown(path)}; {shipped_for(algo)}; "
                         f"pass --model PATH or {train_hint(algo.checkpoint_dir(task), task)}")
    return path


def default_second(role: str, task: str, algo: Algorithm) -> str:
    folder = SECOND_MODEL_DIRS[role].format(task=task)
    path = CHECKPOINTS / folder / "model.pt"
    if not path.exists():
        raise UsageError(f"--algo {algo.name} --task {task}: no {role} checkpoint at {shown(path)}; {shipped_for(algo)}; "
                         f"pass --{role} PATH or {train_hint(folder, task)}")
    return str(path)


def shipped_for(algo: Algorithm) -> str:
    """Which tasks have a shipped checkpoint for `algo` (and its second models): said when one is missing."""
    from .data import TASKS
    tasks = [t for t in TASKS if all((CHECKPOINTS / d / "model.pt").exists() for d in
                                     [algo.checkpoint_dir(t)] + [SECOND_MODEL_DIRS[r].format(task=t) for r in algo.roles])]
    return (f"--algo {algo.name} has shipped models for --task {' and '.join(tasks)}" if tasks
            else f"no task has shipped models for --algo {algo.name}")


def plan_runs(algo_name: str, task: str, *, model: str | None, given: dict, compares: list[Compared],
              batch_size: int | None, sizes: list[int], batch_tokens: int | None = None,
              int8: bool = False) -> list[RunSpec]:
    """The runs, in order: --algo's first, then each compared one (all of them at each of `sizes`).

    Batches: a --compare run that sets its own batch-size or batch-tokens is batched by those alone
    (a token budget, with batch-size as a cap on its rows where both are set); every other run by
    --batch-tokens and --batch-size in the same way, else one sentence at a time.

    `given` holds the options set on the command line; each run takes its algorithm's defaults,
    then those, then its own. An option no run reads is refused, as is a value out of range or an
    option whose condition is not met (--top-k without --block-rule top-k). `int8` (--int8) puts every
    run on the int8 route; without it, the runs that say :int8."""
    first = ALGORITHMS[algo_name]
    items = [Compared(algo_name)] + compares
    unread = set(given) - set().union(*(ALGORITHMS[c.name].options for c in items))
    if unread:
        raise UsageError(f"--{sorted(unread)[0].replace('_', '-')} is not used by --algo {algo_name}"
                         + (" or by any --compare algorithm" if compares else ""))
    if sizes:
        if batch_tokens or any(c.batch_size or c.batch_tokens for c in compares):
            raise UsageError("--batch-sizes sets every run's batches: leave out --batch-tokens; a --compare run "
                             "cannot set its own batch-size or batch-tokens")
        items = [Compared(c.name, c.path, c.options, c.second_models, n, int8=c.int8) for n in sizes for c in items]
    if model:
        check_checkpoint_path("--model ", model)
    main = Path(model) if model else default_checkpoint(first, task)
    specs = []
    for c in items:
        algo = ALGORITHMS[c.name]
        # Without --model, ALGO runs on the checkpoint --algo ALGO would use, except that an algorithm
        # on the task's plain model (greedy, beam, iad, ...) beside --algo blockwise runs on the heads'
        # file, whose base model it is, so the lossless check compares the two on one model.
        own = c.path or (None if model or algo.model_dir in (first.model_dir, "{task}") else default_checkpoint(algo, task))
        options = {**algo.defaults(), **{k: v for k, v in given.items() if k in algo.options}, **c.options}
        try:
            check_options(algo, options, set(given) | set(c.options))
        except ValueError as e:
            raise UsageError(f"--compare {c.name}: {e}" if specs else str(e)) from None
        tokens = c.batch_tokens or (0 if c.batch_size else batch_tokens or 0)
        rows = c.batch_size or (0 if c.batch_tokens else batch_size) or (0 if tokens else 1)
        specs.append(RunSpec(algo, Path(own) if own else main, options, c.second_models, rows, "", tokens,
                             int8 or c.int8))
    several = len({s.path.resolve() for s in specs}) > 1
    return [replace(s, label=label(s, c, several, bool(sizes))) for s, c in zip(specs, items)]


def label(spec: RunSpec, item: Compared, with_model: bool, with_size: bool) -> str:
    """Row name: the algorithm, plus the checkpoint's folder when the runs use several checkpoints,
    plus what the run sets itself (a second model by its folder)."""
    name = f"{spec.algo.name}@{spec.path.parent.name}" if with_model else spec.algo.name
    own = {**item.options, **item.second_models,
           **({"batch_size": spec.batch_size} if with_size or item.batch_size else {}),
           **({"batch_tokens": spec.batch_tokens} if item.batch_tokens else {})}
    for k, v in own.items():
        v = (Path(v).parent.name if k in ("small", "drafter") and v != "early-exit"
             else f"{v:g}" if isinstance(v, float) else v)
        name += f":{k.replace('_', '-')}={v}"
    return name + (":int8" if item.int8 else "")


def shared_second_models(specs: list[RunSpec], task: str, given: dict) -> dict:
    """The second models of the runs that name none of their own: --small / --drafter, or the
    shipped default. A --small or --drafter that no run reads is refused."""
    need = {r for s in specs for r in s.algo.roles if r not in s.second_models}
    for role, value in given.items():
        if value and role not in need:
            raise UsageError(f"--{role} is not used by --algo {specs[0].algo.name}")
    first, out = specs[0].algo, {}
    for role in sorted(need):
        out[role] = given.get(role) or default_second(role, task, first)
        if out[role] != "early-exit" and given.get(role):
            check_checkpoint_path(f"--{role} ", out[role])
    return out


def help_default(name: str) -> str:
    """ "default 5", or "default: bild 0.9, speculative 1" where algorithms differ."""
    per = option_defaults()[name]
    show = {k: ("on" if v is True else "off" if v is False else f"{v:g}" if isinstance(v, float) else str(v))
            for k, v in per.items()}
    if len(set(show.values())) == 1:
        return f"default {next(iter(show.values()))}"
    return "default: " + ", ".join(f"{k} {v}" for k, v in show.items())


__all__ = ["Compared", "OPTIONS", "RunSpec", "check_counts", "default_checkpoint", "help_default", "parse_compare",
           "parse_sizes", "plan_runs",
           "shared_second_models"]
