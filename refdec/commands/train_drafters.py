"""Train the mt-en-de drafters on one GPU in about 8 minutes: GAD's block drafter and blockwise
parallel decoding's proposal heads, one after the other, each a train.py run with a time limit.

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

The files --files lists are all a run needs: copy them (e.g. `tar -cf drafters.tar $(python -m
refdec train-drafters --files)`), unpack the copy on the GPU machine, run the command there, and
bring back the folders under --out-dir (their model.pt files name the verifier as
../../../checkpoints/mt-en-de/model.pt, relative to themselves: keep the copy's layout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import as_typed
from ..config import COMPILE_MODES
from ..errors import UsageError, run_command
from ..app.inputs import check_outputs
from ..repo import REPO, check_files, list_files

MAX_BYTES = 62 * 2**20  # what a copy of the repository for a GPU machine may hold (as bench's)
# (name, preset, the options a GPU run changes, minutes of training). The minutes leave room in 8 for
# each run's start (loading, the first job's tokenizing) and its evaluations.
JOBS = (
    ("gad-drafter", "mt-en-de-drafter-from-verifier",
     ["--batch-tokens", "32768", "--lr", "1e-3", "--warmup-steps", "300", "--eval-every", "500",
      "--glancing-decay-steps", "1500", "--speed-sentences", "100"], 3.0),
    ("blockwise-heads", "mt-en-de-blockwise-continue",
     ["--batch-tokens", "32768", "--lr", "5e-4", "--warmup-steps", "100", "--eval-every", "500",
      "--eval-sentences", "100", "--speed-sentences", "100"], 2.0),
)
DATA = "data/distilled/mt-en-de-mono/mt-en-de"
CHECKPOINTS = ("checkpoints/mt-en-de", "checkpoints/mt-en-de-blockwise")
SMOKE = ("max_steps", "train_limit", "dev_limit")  # the options of a smoke run, which may run on a CPU
# What --resume does with a job, by what its folder holds: a finished run is kept, a run with last.pt
# continued, one stopped before its first checkpoint started again; the train.py flag of each.
FLAGS = {"new": [], "resume": ["--resume"], "replace": ["--overwrite"]}


def needed_files() -> list[str]:
    """What a run reads, relative to the repository: the code, data/build.py (which marks a copy of
    the repository: refdec.repo.repo_file), the verifier and the shipped heads, and the distilled
    corpus's training and dev files."""
    code = sorted(str(p.relative_to(REPO)) for p in (REPO / "refdec").rglob("*.py") if "__pycache__" not in p.parts)
    ckpts = [f"{d}/{name}" for d in CHECKPOINTS for name in ("model.pt", "tokenizer.json")]
    data = [f"{DATA}/{split}.{side}.gz" for split in ("train", "dev") for side in ("src", "tgt", "doc")]
    return ["train.py", *code, "data/build.py", *ckpts, *data]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=as_typed("train-drafters"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", action="store_true", help="print the files a run needs, one a line, and their total "
                   "size on stderr (checked against 62 MiB); run nothing")
    p.add_argument("--out-dir", default="runs/drafters", help="one folder per job under it (default: %(default)s; "
                   "inside the repository's checkpoints/ or data/ only with --overwrite, as train.py)")
    p.add_argument("--only", choices=[name for name, *_ in JOBS], action="append",
                   help="run only this job (repeatable; default: all)")
    p.add_argument("--resume", action="store_true", help="continue a stopped run in --out-dir: keep the finished "
                   "jobs, resume those with a last.pt, start the others again")
    p.add_argument("--overwrite", action="store_true", help="replace the runs already in --out-dir (and let it lie in "
                   "checkpoints/ or data/)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the jobs train: cuda (the default, refused where "
                   "there is none, but for a smoke run, which then trains on the CPU) or cpu (even beside a GPU)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="off",
                   help="train.py --compile for every job: off, on, or auto (on a GPU, off on a CPU); default %(default)s: "
                   "on an H100 the compiled drafter made 2 updates in its 3.2 minutes, the eager heads 2,364")
    p.add_argument("--minutes", type=float, help="each job's time limit in minutes of training (default: the job's "
                   f"own, {' and '.join(str(j[3]) for j in JOBS)}: about 8 minutes in all with the starts and evaluations, "
                   "which the limit does not count)")
    p.add_argument("--max-steps", type=int, help="smoke runs: stop each job after this many updates")
    p.add_argument("--train-limit", type=int, help="smoke runs: train on the first N pairs only")
    p.add_argument("--dev-limit", type=int, help="smoke runs: validate on the first N dev pairs only")
    return p


def job_command(args, name: str, preset: str, options: list[str], minutes: float, state: str = "new") -> list[str]:
    """The train.py command of a job; `state`: what its folder needs (FLAGS)."""
    cmd = [sys.executable, str(REPO / "train.py"), "--preset", preset, "--out-dir", str(Path(args.out_dir) / name),
           "--time-limit-min", str(args.minutes or minutes), "--compile", args.compile, *options]
    for flag in SMOKE:
        value = getattr(args, flag)
        if value is not None:  # (a run evaluates at its end whatever its eval-every)
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    return cmd + FLAGS[state]


def job_environment(args) -> dict[str, str]:
    """The jobs' environment: this one, with no GPU visible to them on a CPU run. Without CUDA, a run
    that is neither a smoke run nor asked for with --device cpu is refused."""
    import torch
    if args.device == "cpu":
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if not torch.cuda.is_available() and (args.device == "cuda" or all(getattr(args, f) is None for f in SMOKE)):
        raise UsageError("no CUDA GPU here, and the jobs' batches and time limits are set for one (on this CPU they "
                         "make few updates): run this on a GPU machine (--files lists what to copy there), "
                         "pass --device cpu to train here anyway, or check the command with a smoke run "
                         "(--max-steps 2 --train-limit 200 --dev-limit 10)")
    return dict(os.environ)


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
        raise UsageError(f"{out} already holds a run ({', '.join(present)}): pass --resume to continue the stopped "
                         f"jobs (the finished ones are kept), --overwrite to start them again, or another --out-dir")
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
    return {"model": str(out / "model.pt"), "minutes": minutes,
            "dev_tokens_per_call": max(rec.get("dev_tokens_per_call", 0.0) for rec in log),
            "tokens_per_s": log[-1].get("tokens_per_s", 0)}


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(build_parser().parse_args(argv)))


def run(args: argparse.Namespace) -> int:
    if args.files:
        return list_files(needed_files(), as_typed("train-drafters"), MAX_BYTES)
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
    jobs = [(job, job_state(Path(args.out_dir) / job[0], args)) for job in JOBS if not args.only or job[0] in args.only]
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
            print(f"interrupted {'after' if status == 0 else 'in'} job {name}: continue with the same command and "
                  f"--resume", file=sys.stderr)
            return 130
        if status:
            print(f"error: job {name} failed (exit {status}); its log is above", file=sys.stderr)
            return status
        summary[name] = job_summary(out, round((time.time() - started) / 60, 2))
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: {s['model']} | best dev tokens per call {s['dev_tokens_per_call']:.3f} | "
              f"{s['tokens_per_s']:,} training tokens/s | "
              + ("finished before" if s["minutes"] is None else f"{s['minutes']} min"))
    print(f"all jobs: {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
