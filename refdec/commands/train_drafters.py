"""Train a verifier's drafters: GAD's block drafter and blockwise parallel decoding's proposal heads,
one after the other, each a train.py run. Without --verifier: the mt-en-de drafters on one GPU in
about 8 minutes, each job with a time limit. With --verifier: a drafter and heads for a model of
one's own, sized from it, on the CPU by default (OWN_DEFAULTS, below).

    python -m refdec train-drafters --verifier runs/up/model.pt --data-dir mydata --distill
                                                     # a model of your own: runs/drafters/<job>/model.pt

    python -m refdec train-drafters --files          # the files a copy of the repository needs (code,
                                                     # checkpoints/mt-en-de, the distilled data), their size
    python -m refdec train-drafters                  # on a GPU: runs/drafters/<job>/model.pt
    python -m refdec train-drafters --resume         # after Ctrl-C: finish the stopped jobs, keep the done ones
    python -m refdec train-drafters --only gad-drafter --minutes 3.5   # one job, its own time limit
    python -m refdec train-drafters --max-steps 2 --train-limit 200 --dev-limit 10   # a smoke run (CPU)

The jobs (JOBS) start from what the verifier knows: the drafter's decoder from the verifier's own
embeddings, first 2 decoder layers, final norm and output projection, on its frozen encoder
(preset mt-en-de-drafter-from-verifier); the heads continue the shipped ones on the frozen verifier
(mt-en-de-blockwise-continue). Both learn the verifier's greedy outputs for 283k sentences
(data/distilled/mt-en-de-mono), in token batches sized for a GPU, and keep as model.pt the
checkpoint whose decoder (GAD with the verifier; blockwise) accepts the most tokens per call on dev
sentences. The first job tokenizes the corpus once and caches its ids (in refdec's cache folder, outside the
repository) for the second.

The jobs train eagerly (--compile off, the default). Compiled, on an H100 (torch 2.11), the
drafter's job made 2 updates in its 3.2 minutes, the compiling taking them all, while the heads'
job beside it made 2,364 eagerly (reports/gpu-h100-drafters.txt); --compile auto or on asks for the
compiled passes all the same, for runs long enough to pay the compiling back.

Without a CUDA GPU the command refuses to start, in one line: the jobs' batches and time limits are
set for a GPU's speed, and on a CPU the same minutes make few updates (the drafter's job made 6 to 9
in its 3 minutes on 2 cores). A smoke run (any of --max-steps, --train-limit, --dev-limit) runs on
the CPU; --device cpu trains there whatever the run (and hides a GPU from the jobs).

A folder under --out-dir that already holds a job's run is refused before any job starts, unless
--resume or --overwrite says what to do with it. Ctrl-C stops the running job (once it trains: after
its current update, with its last.pt saved) and the command; --resume then skips the jobs that
finished (model.pt written), continues those with a last.pt (train.py --resume: the rest of their
time limit), and starts again those stopped before their first checkpoint. --overwrite starts every
job again.

With --verifier CKPT (a whole model train.py wrote) the jobs are for that model and its task (the
checkpoint's, or --task), on the training data of --data-dir (default: the folder its run recorded),
or with --distill on the verifier's own greedy outputs for those training sources (python -m refdec
distill --algo greedy into <out-dir>/distilled/ first: the tokens GAD and exact blockwise decoding
accept are the verifier's greedy ones). Their shape follows the verifier: the drafter takes its
vocabulary, width, heads, feed-forward width and positions, and starts from its embeddings, first
--drafter-layers decoder layers (a third of them, at least one), final norm and output projection,
on its frozen encoder, filling --drafter-k masks; the heads (--proposal-k - 1 of them, each an
eighth of the verifier's feed-forward width wide unless --proposal-d-ff says otherwise, as
mt-en-de-blockwise's) go on the frozen verifier. Each job runs --max-steps updates of 4,096-token
batches (OWN_DEFAULTS), evaluating every quarter of them, and keeps as model.pt the checkpoint whose decoder
accepts the most tokens per call on the first dev sentences; --minutes adds a time limit. A GPU is
used when there is one (--device cpu hides it); nothing is refused on a CPU.

The files --files lists are all a run needs: copy them (e.g. `tar -cf drafters.tar $(python -m
refdec train-drafters --files)`), unpack the copy on the GPU machine, run the command there, and
bring back the folders under --out-dir (their model.pt files name the verifier as
../../../checkpoints/mt-en-de/model.pt, relative to themselves: keep the copy's layout).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..app.inputs import add_device, check_outputs
from ..config import COMPILE_MODES
from ..errors import UsageError, run_command
from ..repo import REPO, check_files, list_files
from . import as_typed, command_main

MAX_BYTES = 62 * 2**20  # what a copy of the repository for a GPU machine may hold (as bench's)
# (name, preset, the options a GPU run changes, minutes of training). The minutes leave room in 8 for
# each run's start (loading, the first job's tokenizing) and its evaluations.
JOBS = (
    (
        "gad-drafter",
        "mt-en-de-drafter-from-verifier",
        [
            "--batch-tokens",
            "32768",
            "--lr",
            "1e-3",
            "--warmup-steps",
            "300",
            "--eval-every",
            "500",
            "--glancing-decay-steps",
            "1500",
            "--speed-sentences",
            "100",
        ],
        3.0,
    ),
    (
        "blockwise-heads",
        "mt-en-de-blockwise-continue",
        [
            "--batch-tokens",
            "32768",
            "--lr",
            "5e-4",
            "--warmup-steps",
            "100",
            "--eval-every",
            "500",
            "--eval-sentences",
            "100",
            "--speed-sentences",
            "100",
        ],
        2.0,
    ),
)
DATA = "data/distilled/mt-en-de-mono/mt-en-de"
CHECKPOINTS = ("checkpoints/mt-en-de", "checkpoints/mt-en-de-blockwise")
SMOKE = ("max_steps", "train_limit", "dev_limit")  # the options of a smoke run, which may run on a CPU
# What --resume does with a job, by what its folder holds: a finished run is kept, a run with last.pt
# continued, one stopped before its first checkpoint started again; the train.py flag of each.
FLAGS = {"new": [], "resume": ["--resume"], "replace": ["--overwrite"]}


# A drafter and heads for a verifier of one's own (--verifier): what they are when the command line
# does not say, and the train.py preset each job borrows (every field that matters given to it).
# The heads' hidden width is the verifier's d_ff / heads_share, mt-en-de-blockwise's 128 of 1024.
OWN_DEFAULTS = {
    "max_steps": 400,
    "drafter_k": 4,
    "proposal_k": 4,
    "heads_share": 8,
    "speed_sentences": 32,
    "warmup_steps": 100,
}
OWN_PRESETS = {"gad-drafter": "mt-en-de-drafter-from-verifier", "blockwise-heads": "mt-en-de-blockwise"}
OWN_OPTIONS = ("data_dir", "task", "distill", "drafter_k", "drafter_layers", "proposal_k", "proposal_d_ff")


def needed_files() -> list[str]:
    """What a run reads, relative to the repository: the code, data/build.py (which marks a copy of
    the repository: refdec.repo.repo_file), the verifier and the shipped heads, and the distilled
    corpus's training and dev files."""
    code = sorted(str(p.relative_to(REPO)) for p in (REPO / "refdec").rglob("*.py") if "__pycache__" not in p.parts)
    ckpts = [f"{d}/{name}" for d in CHECKPOINTS for name in ("model.pt", "tokenizer.json")]
    data = [f"{DATA}/{split}.{side}.gz" for split in ("train", "dev") for side in ("src", "tgt", "doc")]
    return ["train.py", *code, "data/build.py", *ckpts, *data]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=as_typed("train-drafters"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--files",
        action="store_true",
        help="print the files a run needs, one a line, and their total "
        "size on stderr (checked against 62 MiB); run nothing",
    )
    p.add_argument(
        "--out-dir",
        default="runs/drafters",
        help="one folder per job under it (default: %(default)s; "
        "inside the repository's checkpoints/ or data/ only with --overwrite, as train.py)",
    )
    p.add_argument(
        "--only",
        choices=[name for name, *_ in JOBS],
        action="append",
        help="run only this job (repeatable; default: all)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run in --out-dir: keep the finished "
        "jobs, resume those with a last.pt, start the others again",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the runs already in --out-dir (and let it lie in checkpoints/ or data/)",
    )
    add_device(
        p,
        default=None,
        says="None: where the jobs train, cuda, refused where there is none but for a smoke run, which then "
        "trains on the CPU; cpu trains there even beside a GPU",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="off",
        help="train.py --compile for every job: off, on, or auto (on a GPU, off on a CPU); default %(default)s: "
        "on an H100 the compiled drafter made 2 updates in its 3.2 minutes, the eager heads 2,364",
    )
    p.add_argument(
        "--minutes",
        type=float,
        help="each job's time limit in minutes of training (default: the job's "
        f"own, {' and '.join(str(j[3]) for j in JOBS)}: about 8 minutes in all with the starts and evaluations, "
        "which the limit does not count)",
    )
    g = p.add_argument_group("a verifier of your own")
    g.add_argument("--verifier", metavar="CKPT", help="train the drafter and heads of this model (its model.pt)")
    g.add_argument("--task", help="the task's folder in --data-dir (default: the verifier's task)")
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help="the data folder holding <task>/train.src and train.tgt (plain or .gz; default: the one the "
        "verifier's run recorded)",
    )
    g.add_argument(
        "--distill",
        action="store_true",
        help="train on the verifier's greedy outputs for the training sources (distilled into <out-dir>/distilled/ "
        "first), not on the references",
    )
    g.add_argument("--drafter-k", type=int, help=f"masks the drafter fills (default {OWN_DEFAULTS['drafter_k']})")
    g.add_argument(
        "--drafter-layers",
        type=int,
        help="the drafter's decoder layers, the verifier's first ones (default: a third of its, at least 1)",
    )
    g.add_argument(
        "--proposal-k",
        type=int,
        help=f"blockwise block size: k - 1 heads (default {OWN_DEFAULTS['proposal_k']})",
    )
    g.add_argument(
        "--proposal-d-ff",
        type=int,
        help=f"the heads' hidden width each (default: the verifier's d_ff / {OWN_DEFAULTS['heads_share']})",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        help=f"stop each job after this many updates (smoke runs; with --verifier default {OWN_DEFAULTS['max_steps']})",
    )
    p.add_argument("--train-limit", type=int, help="smoke runs: train on the first N pairs only")
    p.add_argument("--dev-limit", type=int, help="smoke runs: validate on the first N dev pairs only")
    return p


def job_command(args, name: str, preset: str, options: list[str], minutes: float, state: str = "new") -> list[str]:
    """The train.py command of a job; `state`: what its folder needs (FLAGS)."""
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "--preset",
        preset,
        "--out-dir",
        str(Path(args.out_dir) / name),
        "--time-limit-min",
        str(args.minutes or minutes),
        "--compile",
        args.compile,
        *options,
    ]
    for flag in SMOKE:
        value = getattr(args, flag)
        if value is not None:  # (a run evaluates at its end whatever its eval-every)
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    return cmd + FLAGS[state]


def job_environment(args) -> dict[str, str]:
    """The jobs' environment: this one, with no GPU visible to them on a CPU run. Without CUDA, an
    mt-en-de run that is neither a smoke run nor asked for with --device cpu is refused (a run for a
    --verifier is sized for a CPU)."""
    import torch

    if args.device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {args.device}: the jobs train on cuda or cpu")
    if args.device == "cpu":
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if args.verifier and args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU here; leave --device out to train on the CPU")
    if (
        not args.verifier
        and not torch.cuda.is_available()
        and (args.device == "cuda" or all(getattr(args, f) is None for f in SMOKE))
    ):
        raise UsageError(
            "no CUDA GPU here, and the jobs' batches and time limits are set for one (on this CPU they "
            "make few updates): run this on a GPU machine (--files lists what to copy there), "
            "pass --device cpu to train here anyway, or check the command with a smoke run "
            "(--max-steps 2 --train-limit 200 --dev-limit 10)"
        )
    return dict(os.environ)


def own_jobs(args) -> tuple[list[tuple[str, str, list[str], float]], dict | None]:
    """The jobs for a verifier of one's own (--verifier), in JOBS' form, and what --distill decodes
    first (None without it: the jobs read --data-dir): the verifier checked (a whole model, its task),
    the data folder found (--data-dir, or the one its run recorded), and the drafter and heads sized
    from it unless the command line says otherwise (OWN_DEFAULTS)."""
    from .. import data as data_mod
    from ..checkpoint import load_checkpoint
    from ..config import ModelConfig

    ckpt = load_checkpoint(args.verifier)
    kind = next(
        (name for key, name in (("drafter", "a GAD drafter"), ("proposal", "proposal heads")) if key in ckpt), None
    )
    shape = ModelConfig.from_dict(ckpt["model_config"])
    if kind or not shape.enc_layers:
        held = kind or "a decoder on another model's encoder"
        raise UsageError(
            f"--verifier {args.verifier} holds {held}: give the whole model whose drafter and heads to train "
            f"(its model.pt from train.py)"
        )
    task = args.task or ckpt["task"]
    if task != ckpt["task"]:
        raise UsageError(f"--task {task}: the verifier {args.verifier} was trained for {ckpt['task']}")
    recorded = ckpt.get("meta", {}).get("train_config", {}).get("data_dir")
    data_dir = args.data_dir or recorded or str(data_mod.DATA_DIR)
    if not args.data_dir and not Path(data_dir).is_dir():
        raise UsageError(
            f"the verifier's run read its data from {recorded}, which is not a folder here: give --data-dir"
        )
    data_mod.split_files(task, "train", data_dir)  # the error naming the missing file, before any work
    for flag in ("drafter_k", "drafter_layers", "proposal_d_ff"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.proposal_k is not None and args.proposal_k < 2:
        raise UsageError("--proposal-k must be at least 2 (head 1 is the verifier itself)")
    layers = args.drafter_layers or max(1, shape.dec_layers // 3)
    if layers > shape.dec_layers:
        raise UsageError(
            f"--drafter-layers {layers}: the drafter starts from the verifier's first decoder layers, and it has "
            f"{shape.dec_layers}"
        )
    distill = None
    if args.distill:
        distill = {"task": task, "data_dir": data_dir, "out": Path(args.out_dir) / "distilled"}
        data_dir = str(distill["out"])
    steps = args.max_steps or OWN_DEFAULTS["max_steps"]
    speed = str(OWN_DEFAULTS["speed_sentences"])
    common = [
        "--task", task, "--data-dir", data_dir, "--init-from", args.verifier,
        "--vocab-size", str(shape.vocab_size), "--d-model", str(shape.d_model), "--n-heads", str(shape.n_heads),
        "--d-ff", str(shape.d_ff), "--max-positions", str(shape.max_positions),
        "--eval-every", str(max(1, steps // 4)), "--warmup-steps", str(min(OWN_DEFAULTS["warmup_steps"], steps)),
        "--speed-sentences", speed, "--eval-sentences", speed,
    ]  # fmt: skip
    drafter = [
        "--encoder-from", args.verifier, "--enc-layers", "0", "--dec-layers", str(layers),
        "--drafter-k", str(args.drafter_k or OWN_DEFAULTS["drafter_k"]), "--glancing-decay-steps", str(steps),
    ]  # fmt: skip
    heads = [
        "--enc-layers", str(shape.enc_layers), "--dec-layers", str(shape.dec_layers),
        "--proposal-k", str(args.proposal_k or OWN_DEFAULTS["proposal_k"]),
        "--proposal-d-ff", str(args.proposal_d_ff or max(1, shape.d_ff // OWN_DEFAULTS["heads_share"])),
    ]  # fmt: skip
    args.max_steps = steps  # job_command gives every job its --max-steps
    jobs = [
        ("gad-drafter", OWN_PRESETS["gad-drafter"], common + drafter, 0.0),
        ("blockwise-heads", OWN_PRESETS["blockwise-heads"], common + heads, 0.0),
    ]
    return jobs, distill


def distill_state(folder: Path, args) -> str:
    """What to do with --distill's folder (<out-dir>/distilled/<task>): "new", "done" (a corpus the
    same verifier distilled: kept on --resume) or "run" (distill continues its own partial work); a
    folder holding one is refused unless --resume or --overwrite says what to do with it, as a job's."""
    from ..checkpoint import file_sha256

    info = folder / "distill.json"
    if not folder.is_dir() or not any(folder.iterdir()):
        return "new"
    if not (args.resume or args.overwrite):
        raise UsageError(
            f"{folder} already holds a distilled corpus: pass --resume to keep it (or continue it), --overwrite "
            f"to distil again, or another --out-dir"
        )
    if args.resume and info.is_file():
        if json.loads(info.read_text(encoding="utf-8")).get("teacher_sha256") == file_sha256(args.verifier):
            return "done"
    return "run"


def run_distill(spec: dict, args, state: str) -> int:
    """--distill: the verifier's greedy outputs for the task's training sources, as a data folder
    that the jobs then train on: python -m refdec distill, run in this process (its JSON report to
    stderr, beside its progress); its exit status."""
    folder = spec["out"] / spec["task"]
    if state == "done":
        print(f"== distill: finished before ({folder}), kept", file=sys.stderr, flush=True)
        return 0
    argv = ["--task", spec["task"], "--model", args.verifier, "--data-dir", spec["data_dir"], "--algo", "greedy"]
    argv += ["--out", str(spec["out"])] + (["--overwrite"] if args.overwrite else [])
    argv += ["--device", args.device] if args.device else []
    print(f"== distill: {' '.join(argv)}", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(sys.stderr):
        return command_main("distill")(argv)


def job_state(out: Path, args) -> str:
    """What to do with a job's folder (FLAGS, or "done": keep its model.pt); a folder that holds a run
    is refused unless --resume or --overwrite says what to do with it."""
    from ..training.folder import RUN_FILES

    present = [name for name in RUN_FILES if (out / name).exists()]
    if not present:
        return "new"
    if args.overwrite:
        return "replace"
    if not args.resume:
        raise UsageError(
            f"{out} already holds a run ({', '.join(present)}): pass --resume to continue the stopped "
            f"jobs (the finished ones are kept), --overwrite to start them again, or another --out-dir"
        )
    return "done" if (out / "model.pt").is_file() else "resume" if (out / "last.pt").is_file() else "replace"


def run_job(cmd: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run a train.py job to its end: its exit status, and whether Ctrl-C was pressed. The job gets the
    terminal's Ctrl-C too and saves its last.pt before it exits, so this waits for it instead of
    killing it."""
    job, pressed = subprocess.Popen(cmd, env=env), False  # in this folder, where --out-dir is
    while True:
        try:
            return job.wait(), pressed
        except KeyboardInterrupt:
            pressed = True


def job_summary(out: Path, minutes: float | None) -> dict:
    """A job's line of summary.json, from its log.jsonl (minutes: this command's; None for a job
    finished before it)."""
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line]
    return {
        "model": str(out / "model.pt"),
        "minutes": minutes,
        "dev_tokens_per_call": max(rec.get("dev_tokens_per_call", 0.0) for rec in log),
        "tokens_per_s": log[-1].get("tokens_per_s", 0),
    }


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(build_parser().parse_args(argv)), known=(FileNotFoundError, ValueError))


def run(args: argparse.Namespace) -> int:
    own = args.verifier is not None
    stray = next((flag for flag in OWN_OPTIONS if getattr(args, flag) not in (None, False)), None)
    if stray and not own:
        raise UsageError(
            f"--{stray.replace('_', '-')} needs --verifier (the model whose drafter and heads to train); "
            f"without it the command trains the mt-en-de ones"
        )
    if args.files:
        if own:
            raise UsageError(
                "--files lists the mt-en-de run's files; a run with --verifier reads the repository's code, the "
                "verifier's folder and its data folder"
            )
        return list_files(needed_files(), as_typed("train-drafters"), MAX_BYTES)
    if not own:
        check_files(needed_files(), as_typed("train-drafters"))
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the runs in --out-dir and --overwrite replaces them: choose one")
    check_outputs({"--out-dir": args.out_dir}, {}, folders_made=True, opt_in=("--overwrite", args.overwrite))
    for flag in SMOKE:
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.minutes is not None and not args.minutes > 0:
        raise UsageError("--minutes must be more than 0")
    env = job_environment(args)
    all_jobs, distilling = own_jobs(args) if own else (JOBS, None)
    jobs = [
        (job, job_state(Path(args.out_dir) / job[0], args)) for job in all_jobs if not args.only or job[0] in args.only
    ]
    if distilling is not None:
        status = run_distill(distilling, args, distill_state(distilling["out"] / distilling["task"], args))
        if status == 130:
            print("interrupted in distill: continue with the same command and --resume", file=sys.stderr)
        if status:
            return status
    summary, t0 = {}, time.time()
    for (name, preset, options, minutes), state in jobs:
        out = Path(args.out_dir) / name
        if state == "done":
            print(f"== {name}: finished before ({out / 'model.pt'}), kept", file=sys.stderr, flush=True)
            summary[name] = job_summary(out, None)
            continue
        cmd = job_command(args, name, preset, options, minutes, state)
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        started = time.time()
        status, pressed = run_job(cmd, env)
        if pressed or status == 130:
            print(
                f"interrupted {'after' if status == 0 else 'in'} job {name}: continue with the same command and "
                f"--resume",
                file=sys.stderr,
            )
            return 130
        if status:
            print(f"error: job {name} failed (exit {status}); its log is above", file=sys.stderr)
            return status
        summary[name] = job_summary(out, round((time.time() - started) / 60, 2))
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, s in summary.items():
        print(
            f"{name}: {s['model']} | best dev tokens per call {s['dev_tokens_per_call']:.3f} | "
            f"{s['tokens_per_s']:,} training tokens/s | "
            + ("finished before" if s["minutes"] is None else f"{s['minutes']} min")
        )
    print(f"all jobs: {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
