"""Train the mt-en-de drafters on one GPU in about 8 minutes: GAD's block drafter and blockwise
parallel decoding's proposal heads, one after the other, each a train.py run with a time limit.

    python -m refdec.train_drafters --files          # the files a copy of the repository needs (code,
                                                     # checkpoints/mt-en-de, the distilled data)
    python -m refdec.train_drafters                  # on a GPU: runs/drafters/<job>/model.pt
    python -m refdec.train_drafters --max-steps 2 --train-limit 200 --dev-limit 10   # a smoke run (CPU)

The jobs (JOBS) start from what the verifier knows: the drafter's decoder from the verifier's own
embeddings, first 2 decoder layers, final norm and output projection, on its frozen encoder
(preset mt-en-de-drafter-from-verifier); the heads continue the shipped ones on the frozen verifier
(mt-en-de-blockwise-continue). Both learn the verifier's greedy outputs for 283k sentences
(data/distilled/mt-en-de-mono), in token batches sized for a GPU, and keep as model.pt the
checkpoint whose decoder (GAD with the verifier; blockwise) accepts the most tokens per call on dev
sentences. The first job tokenizes the corpus once and caches the ids beside it for the second.

On a GPU each run compiles its forward/backward passes with torch.compile (train.py --compile auto,
the default: launches and Python bound the eager passes there); the compiling, a minute or more per
job, counts against its time limit. This is unmeasured on a GPU: if a run's tokens/s (its log, and
summary.json) come out lower than with --compile off, train with --compile off.

The files --files lists are all a run needs: copy them (e.g. `tar -cf drafters.tar $(python -m
refdec.train_drafters --files)`), unpack the copy on the GPU machine, run the command there, and
bring back the folders under --out-dir (their model.pt files name the verifier as
../../../checkpoints/mt-en-de/model.pt, relative to themselves: keep the copy's layout).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ..config import COMPILE_MODES
from ..errors import run_command
from ..inputs import check_outputs
from ..repo import REPO

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


def needed_files() -> list[str]:
    """What a run reads, relative to the repository: the code, the verifier and the shipped heads,
    and the distilled corpus's training and dev files."""
    code = sorted(str(p.relative_to(REPO)) for p in (REPO / "refdec").rglob("*.py"))
    ckpts = [f"{d}/{name}" for d in CHECKPOINTS for name in ("model.pt", "tokenizer.json")]
    data = [f"{DATA}/{split}.{side}.gz" for split in ("train", "dev") for side in ("src", "tgt", "doc")]
    return ["train.py", *code, *ckpts, *data]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refdec.train_drafters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", action="store_true", help="print the files a run needs, one a line, and exit")
    p.add_argument("--out-dir", default="runs/drafters", help="one folder per job under it (default: %(default)s; "
                   "inside the repository's checkpoints/ or data/ only with --overwrite, as train.py)")
    p.add_argument("--only", choices=[name for name, *_ in JOBS], action="append",
                   help="run only this job (repeatable; default: all)")
    p.add_argument("--overwrite", action="store_true", help="replace runs already in --out-dir (and let it lie in "
                   "checkpoints/ or data/)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="train.py --compile for every job: auto (on a GPU, off on a CPU), on or off (default: %(default)s)")
    p.add_argument("--max-steps", type=int, help="smoke runs: stop each job after this many updates")
    p.add_argument("--train-limit", type=int, help="smoke runs: train on the first N pairs only")
    p.add_argument("--dev-limit", type=int, help="smoke runs: validate on the first N dev pairs only")
    return p


def job_command(args, name: str, preset: str, options: list[str], minutes: float) -> list[str]:
    cmd = [sys.executable, str(REPO / "train.py"), "--preset", preset, "--out-dir", str(Path(args.out_dir) / name),
           "--time-limit-min", str(minutes), "--compile", args.compile, *options]
    for flag in ("max_steps", "train_limit", "dev_limit"):
        value = getattr(args, flag)
        if value is not None:  # (a run evaluates at its end whatever its eval-every)
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    return cmd + (["--overwrite"] if args.overwrite else [])


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(build_parser().parse_args(argv)))


def run(args: argparse.Namespace) -> int:
    if args.files:
        missing = [f for f in needed_files() if not (REPO / f).is_file()]
        if missing:
            print(f"error: {len(missing)} needed file(s) are not in this copy: {', '.join(missing[:3])}", file=sys.stderr)
            return 1
        print("\n".join(needed_files()))
        return 0
    check_outputs({"--out-dir": args.out_dir}, {}, folders_made=True, opt_in=("--overwrite", args.overwrite))
    summary, t0 = {}, time.time()
    for name, preset, options, minutes in JOBS:
        if args.only and name not in args.only:
            continue
        cmd = job_command(args, name, preset, options, minutes)
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        started = time.time()
        r = subprocess.run(cmd, cwd=REPO)
        if r.returncode:
            print(f"error: job {name} failed (exit {r.returncode}); its log is above", file=sys.stderr)
            return r.returncode
        out = Path(args.out_dir) / name
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line]
        summary[name] = {"model": str(out / "model.pt"), "minutes": round((time.time() - started) / 60, 2),
                         "dev_tokens_per_call": max(rec.get("dev_tokens_per_call", 0.0) for rec in log),
                         "tokens_per_s": log[-1].get("tokens_per_s", 0)}
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: {s['model']} | best dev tokens per call {s['dev_tokens_per_call']:.3f} | "
              f"{s['tokens_per_s']:,} training tokens/s | {s['minutes']} min")
    print(f"all jobs: {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
