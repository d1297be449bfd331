"""python -m refdec.train_drafters: the one command that trains the mt-en-de drafters on a GPU, from
a copy of the repository holding only the files it lists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from refdec.checkpoint import load_checkpoint


def test_the_listed_files_are_there_and_under_60_mb():
    """Guards what is sent to a GPU machine: every file a run reads, and small enough to send."""
    from refdec.commands.train_drafters import needed_files
    files = needed_files()
    assert all((REPO / f).is_file() for f in files)
    assert "train.py" in files and "checkpoints/mt-en-de/model.pt" in files and "refdec/commands/train_drafters.py" in files
    assert sum((REPO / f).stat().st_size for f in files) < 60e6


@pytest.mark.slow
def test_a_copy_of_the_listed_files_trains_both_drafters(tmp_path):
    """Guards the GPU command on the CPU: from a copy holding only the files --files prints, a run
    with tiny limits writes a GAD drafter and heads that load (the heads on the verifier they name)."""
    r = subprocess.run([sys.executable, "-m", "refdec.train_drafters", "--files"], cwd=REPO, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    copy = tmp_path / "copy"
    for name in r.stdout.decode().split():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, copy / name)
    r = subprocess.run([sys.executable, "-m", "refdec.train_drafters", "--out-dir", "runs/d", "--max-steps", "2",
                        "--train-limit", "200", "--dev-limit", "8"], cwd=copy, capture_output=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert "gad-drafter: runs/d/gad-drafter/model.pt" in r.stdout.decode() and "training tokens/s" in r.stdout.decode()
    drafter = load_checkpoint(copy / "runs/d/gad-drafter/model.pt")
    heads = load_checkpoint(copy / "runs/d/blockwise-heads/model.pt")
    assert drafter["drafter"]["k"] == 8 and heads["proposal"]["config"]["k"] == 10
    assert heads["frozen_base"]["path"] == os.path.join("..", "..", "..", "checkpoints", "mt-en-de", "model.pt")
    assert "dev_tokens_per_call" in drafter["meta"] and "dev_tokens_per_call" in heads["meta"]


def test_every_job_runs_with_the_compile_option_given():
    """Guards --compile reaching train.py: auto (compiled on a GPU) unless told otherwise."""
    from refdec.commands.train_drafters import JOBS, build_parser, job_command
    for argv, value in (([], "auto"), (["--compile", "off"], "off")):
        args = build_parser().parse_args(argv)
        for job in JOBS:
            cmd = job_command(args, *job)
            assert cmd[cmd.index("--compile") + 1] == value
