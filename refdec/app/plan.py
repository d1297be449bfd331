"""What one decode.py invocation runs: a RunSpec per run, every choice resolved before any model loads.

A run is an algorithm on a checkpoint with its option values, its own companion models (or the shared ones) and its
batches: a batch size, or a token budget. The first run is --algo's; `--compare ALGO[@CKPT][:OPTION=VALUE...]` adds the
others (`:int8` puts one on the int8 route, refdec.routes.int8); `--batch-sizes` repeats all of them at each size. Every
run finds its default checkpoint by the same rule (`default_checkpoint`), so `--compare blockwise` runs on the model
`--algo blockwise` would use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UsageError
from ..repo import REPO, repo_file, shown
from .algorithms import ALGORITHMS, OPTIONS, Algorithm, check_options, option_defaults, parse_value
from .hints import check_checkpoint_path, train_hint
from .inputs import checkpoint_files

CHECKPOINTS = REPO / "checkpoints"
COMPANION_DIRS = {"drafter": "{task}-drafter", "small": "{task}-small-aligned"}
COMPANION_WORDS = {
    "drafter": "block drafter on the same tokenizer (a checkpoint of train.py --drafter-k)",
    "small": "small model on the same tokenizer (a refdec checkpoint or a transformers folder)",
}


@dataclass(frozen=True)
class Compared:
    """One item of --compare: ALGO, its checkpoint (None: the default) and what it sets itself."""

    name: str
    path: str | None = None
    options: dict = field(default_factory=dict)  # option -> value
    companions: dict = field(default_factory=dict)  # "small" / "drafter" -> PATH or "early-exit"
    batch_size: int | None = None
    batch_tokens: int | None = None
    int8: bool = False  # :int8, the run on the int8 route (refdec.routes.int8)


@dataclass(frozen=True)
class RunSpec:
    algo: Algorithm
    path: Path  # the checkpoint whose output the run produces
    options: dict  # every option of the algorithm, with its value
    companions: dict  # the run's own companion models (the others are the shared ones)
    batch_size: int  # most sentences per batch (0: no limit, with a token budget)
    label: str
    batch_tokens: int = 0  # most source tokens per batch, padding included (0: batches by batch_size alone)
    int8: bool = False  # its models on the int8 route (refdec.routes.int8)


def check_counts(
    *,
    batch_size: int | None,
    max_len: int | None,
    limit: int | None,
    warmup: int,
    refs: list,
    input: str | None,
    batch_tokens: int | None = None,
) -> None:
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
    """ "greedy,beam@ckpt.pt:beam-size=4" -> [Compared("greedy"), Compared("beam", "ckpt.pt", {"beam_size": 4})];
    a bare ":int8" puts that run on the int8 route."""
    out = []
    for item in spec.split(","):
        head, *settings = item.strip().split(":")
        name, _, path = head.partition("@")
        if name not in ALGORITHMS:
            raise UsageError(f"--compare: unknown algorithm {name!r}; choose from {', '.join(sorted(ALGORITHMS))}")
        if path:
            check_checkpoint_path(f"--compare {name}@", path)
        algo, options, companions, size, tokens, int8 = ALGORITHMS[name], {}, {}, None, None, False
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
                    raise UsageError(
                        f"--compare {item}: {key.replace('_', '-')} must be a whole number of at least 1, not {value!r}"
                    )
                size, tokens = (int(value), tokens) if key == "batch_size" else (size, int(value))
            elif key in ("small", "drafter"):
                if key not in algo.companion_roles:
                    raise UsageError(f"--compare {item}: {name} uses no {key} model")
                if not (key == "small" and value == "early-exit"):
                    check_checkpoint_path(f"--compare {head}:{setting.partition('=')[0]}=", value)
                companions[key] = value
            elif key in algo.options:
                try:
                    options[key] = parse_value(key, value, algo.defaults()[key])
                except ValueError as e:
                    raise UsageError(f"--compare {item}: {e}") from None
            else:
                raise UsageError(
                    f"--compare {item}: {key.replace('_', '-')} is not an option of {name} "
                    f"(its options: {', '.join(k.replace('_', '-') for k in algo.options) or 'none'})"
                )
        out.append(Compared(name, path or None, options, companions, size, tokens, int8))
    return out


def default_checkpoint(algo: Algorithm, task: str) -> Path:
    """checkpoints/<the algorithm's folder for task>/model.pt, or a one-line error saying what is shipped
    (or, in a copy installed without the repository, that the checkpoints are the repository's)."""
    repo_file("checkpoints", algo.checkpoint_dir(task), "model.pt", flag="--model PATH")
    path = CHECKPOINTS / algo.checkpoint_dir(task) / "model.pt"
    if not path.exists():
        raise UsageError(
            f"--algo {algo.name} --task {task}: no checkpoint at {shown(path)}; {shipped_for(algo)}; "
            f"pass --model PATH or {train_hint(algo.checkpoint_dir(task), task)}"
        )
    return path


def default_companion(role: str, task: str, algo: Algorithm) -> str:
    folder = COMPANION_DIRS[role].format(task=task)
    repo_file("checkpoints", folder, "model.pt", flag=f"--{role} PATH")
    path = CHECKPOINTS / folder / "model.pt"
    if not path.exists():
        raise UsageError(
            f"--algo {algo.name} --task {task}: no {role} checkpoint at {shown(path)}; {shipped_for(algo)}; "
            f"pass --{role} PATH or {train_hint(folder, task)}"
        )
    return str(path)


def shipped_for(algo: Algorithm) -> str:
    """Which tasks have a shipped checkpoint for `algo` (and its companion models): said when one is missing."""
    from ..data import TASKS

    tasks = [
        t
        for t in TASKS
        if all(
            (CHECKPOINTS / d / "model.pt").exists()
            for d in [algo.checkpoint_dir(t)] + [COMPANION_DIRS[r].format(task=t) for r in algo.companion_roles]
        )
    ]
    return (
        f"--algo {algo.name} has shipped models for --task {' and '.join(tasks)}"
        if tasks
        else f"no task has shipped models for --algo {algo.name}"
    )


def plan_runs(
    algo_name: str,
    task: str,
    *,
    model: str | None,
    given: dict,
    compares: list[Compared],
    batch_size: int | None,
    sizes: list[int],
    batch_tokens: int | None = None,
    int8: bool = False,
) -> list[RunSpec]:
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
        raise UsageError(
            f"--{sorted(unread)[0].replace('_', '-')} is not used by --algo {algo_name}"
            + (" or by any --compare algorithm" if compares else "")
        )
    if sizes:
        if batch_tokens or any(c.batch_size or c.batch_tokens for c in compares):
            raise UsageError(
                "--batch-sizes sets every run's batches: leave out --batch-tokens; a --compare run "
                "cannot set its own batch-size or batch-tokens"
            )
        items = [Compared(c.name, c.path, c.options, c.companions, n, int8=c.int8) for n in sizes for c in items]
    if model:
        check_checkpoint_path("--model ", model)
    main = Path(model) if model else default_checkpoint(first, task)
    specs = []
    for c in items:
        algo = ALGORITHMS[c.name]
        # Without --model, ALGO runs on the checkpoint --algo ALGO would use, except that an algorithm
        # on the task's plain model (greedy, beam, iad, ...) beside --algo blockwise runs on the heads'
        # file, whose base model it is, so the lossless check compares the two on one model.
        run_path = c.path or (
            None if model or algo.model_dir in (first.model_dir, "{task}") else default_checkpoint(algo, task)
        )
        options = {**algo.defaults(), **{k: v for k, v in given.items() if k in algo.options}, **c.options}
        try:
            check_options(algo, options, set(given) | set(c.options))
        except ValueError as e:
            raise UsageError(f"--compare {c.name}: {e}" if specs else str(e)) from None
        tokens = c.batch_tokens or (0 if c.batch_size else batch_tokens or 0)
        rows = c.batch_size or (0 if c.batch_tokens else batch_size) or (0 if tokens else 1)
        specs.append(
            RunSpec(algo, Path(run_path) if run_path else main, options, c.companions, rows, "", tokens, int8 or c.int8)
        )
    names = model_names([s.path for s in specs])
    return [replace(s, label=label(s, c, names if len(names) > 1 else None, bool(sizes))) for s, c in zip(specs, items)]


def model_name(path: str | Path) -> str:
    """A checkpoint as a row label names it: its folder (checkpoints/gec-uk-9x3/model.pt: gec-uk-9x3), or
    a transformers folder's own name."""
    path = Path(path)
    return path.name if path.is_dir() else path.parent.name


def model_names(paths: list[Path]) -> dict[Path, str]:
    """Each distinct checkpoint's name in row labels: model_name, or where two share one (two folders
    of the same name under different parents) the path to the folder, so that no two rows read alike."""
    names = {p: model_name(p) for p in dict.fromkeys(p.resolve() for p in paths)}
    return {
        p: (shown(p if p.is_dir() else p.parent) if list(names.values()).count(n) > 1 else n) for p, n in names.items()
    }


def label(spec: RunSpec, item: Compared, names: dict[Path, str] | None, with_size: bool) -> str:
    """Row name: the algorithm, plus its checkpoint's name when the runs use several checkpoints
    (`names`, model_names), plus what the run sets itself (a companion model by its folder)."""
    name = f"{spec.algo.name}@{names[spec.path.resolve()]}" if names else spec.algo.name
    settings = {
        **item.options,
        **item.companions,
        **({"batch_size": spec.batch_size} if with_size or item.batch_size else {}),
        **({"batch_tokens": spec.batch_tokens} if item.batch_tokens else {}),
    }
    for k, v in settings.items():
        v = (
            model_name(v)
            if k in ("small", "drafter") and v != "early-exit"
            else f"{v:g}"
            if isinstance(v, float)
            else v
        )
        name += f":{k.replace('_', '-')}={v}"
    return name + (":int8" if item.int8 else "")


def shared_companions(specs: list[RunSpec], task: str, given: dict) -> dict:
    """The companion models of the runs that name none of their own: --small / --drafter, or the
    shipped default. A --small or --drafter that no run reads is refused."""
    need = {r for s in specs for r in s.algo.companion_roles if r not in s.companions}
    for role, value in given.items():
        if value and role not in need:
            raise UsageError(f"--{role} is not used by --algo {specs[0].algo.name}")
    first, out = specs[0].algo, {}
    for role in sorted(need):
        if task is None and not given.get(role):  # --model and --input without --task: no shipped default
            s = next(s for s in specs if role in s.algo.companion_roles and role not in s.companions)
            flag = f"--algo {s.algo.name}" if s is specs[0] else f"--compare {s.algo.name}"
            raise UsageError(
                f"{flag} needs a {COMPANION_WORDS[role]}, and without --task there is no shipped one "
                f"to take: pass --{role} PATH"
                + (f" (or --compare {s.algo.name}:{role}=PATH)" if s is not specs[0] else "")
            )
        out[role] = given.get(role) or default_companion(role, task, first)
        if out[role] != "early-exit" and given.get(role):
            check_checkpoint_path(f"--{role} ", out[role])
    return out


def checkpoints_read(specs: list[RunSpec], shared: dict) -> dict:
    """Every checkpoint the runs load, for refdec.app.inputs.check_outputs: each run's model and own companion
    models, and the shared ones (--small, --drafter)."""
    found = {}
    for s in specs:
        found |= checkpoint_files(f"the model of {s.label}", s.path)
        for role, value in s.companions.items():
            found |= checkpoint_files(f"the {role} of {s.label}", value)
    for role, value in shared.items():
        found |= checkpoint_files(f"the {role} (--{role})", value)
    return found


def help_default(name: str) -> str:
    """ "default 5", or "default: bild 0.9, speculative 1" where algorithms differ."""
    per = option_defaults()[name]
    show = {
        k: ("on" if v is True else "off" if v is False else f"{v:g}" if isinstance(v, float) else str(v))
        for k, v in per.items()
    }
    if len(set(show.values())) == 1:
        return f"default {next(iter(show.values()))}"
    return "default: " + ", ".join(f"{k} {v}" for k, v in show.items())


def add_route_flags(group) -> None:
    """decode.py's routes, the ways to compute one model: the reference route by default, or one of
    row-invariant mode, the fast route and the graphed route; the int8 route combines with the first two."""
    route = group.add_mutually_exclusive_group()  # two ways to compute one model: one at a time
    route.add_argument(
        "--invariant",
        action="store_true",
        help="row-invariant compute for every model: each position's "
        "logits bitwise the same whatever the call shape, so lossless algorithms equal greedy exactly, "
        "ties included (slower; docs/algorithms.md, 'Row-invariant mode')",
    )
    route.add_argument(
        "--fast",
        action="store_true",
        help="the fast route for every model it applies to: the same "
        "model computed with fewer, fused operations (PyTorch's fused attention, the residual sum inside "
        "each product); float32 logits differ from the reference route's in the last bits "
        "(docs/fast.md)",
    )
    route.add_argument(
        "--graphed",
        action="store_true",
        help="the graphed route: the fast route's decoder call and "
        "encoder on static shapes (a preallocated KV cache, calls padded to buckets), captured once per "
        "shape as a CUDA graph and replayed on a GPU, run as they are on a CPU (docs/graphed.md)",
    )
    group.add_argument(
        "--int8",
        action="store_true",
        help="the int8 route for every model (a --compare run alone: :int8): "
        "linear layers as int8 products with per-row scales, so lossless algorithms still equal greedy; "
        "combines with --fast or --invariant (docs/int8.md)",
    )


def chosen_route(args) -> str:
    """The route add_route_flags' flags choose: one of refdec.routes.ROUTES (the int8 route is a flag of
    its own, args.int8)."""
    return "invariant" if args.invariant else "graphed" if args.graphed else "fast" if args.fast else "reference"


def add_option_flags(group) -> None:
    """One flag per algorithm option (--fallback-threshold ...), its type and help read from the
    decoders' signatures (refdec.app.algorithms), onto decode.py's argparse group."""
    for name, default in ((n, next(iter(d.values()))) for n, d in option_defaults().items() if d):
        flag, opt = "--" + name.replace("_", "-"), OPTIONS[name]
        help_text = f"{opt.help} ({help_default(name)})"
        if isinstance(default, bool):
            group.add_argument(flag, action="store_const", const=True, help=help_text)
        else:
            group.add_argument(
                flag, type=type(default), metavar=opt.metavar, choices=opt.choices or None, help=help_text
            )


__all__ = [
    "Compared",
    "OPTIONS",
    "RunSpec",
    "add_option_flags",
    "add_route_flags",
    "check_counts",
    "checkpoints_read",
    "chosen_route",
    "default_checkpoint",
    "help_default",
    "parse_compare",
    "parse_sizes",
    "plan_runs",
    "shared_companions",
]
