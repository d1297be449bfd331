"""python -m refdec train-drafters: the one command that trains the mt-en-de drafters on a GPU, from
a copy of the repository holding only the files it lists."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from refdec.checkpoint import load_checkpoint


def test_the_listed_files_are_there_and_under_60_mb():
    """Guards what is sent to a GPU machine: every file a run reads, and small enough to send."""
    from refdec.commands.train_drafters import needed_files

    files = needed_files()
    assert all((REPO / f).is_file() for f in files)
    assert (
        "train.py" in files
        and "checkpoints/mt-en-de/model.pt" in files
        and "refdec/commands/train_drafters.py" in files
    )
    assert sum((REPO / f).stat().st_size for f in files) < 60e6


@pytest.mark.slow
def test_a_copy_of_the_listed_files_trains_both_drafters(tmp_path):
    """Guards the GPU command on the CPU: from a copy holding only the files --files prints, a run
    with tiny limits writes a GAD drafter and heads that load (the heads on the verifier they name)."""
    r = subprocess.run([sys.executable, "-m", "refdec", "train-drafters", "--files"], cwd=REPO, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    copy = tmp_path / "copy"
    for name in r.stdout.decode().split():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, copy / name)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "refdec",
            "train-drafters",
            "--out-dir",
            "runs/d",
            "--max-steps",
            "2",
            "--train-limit",
            "200",
            "--dev-limit",
            "8",
        ],
        cwd=copy,
        capture_output=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert "gad-drafter: runs/d/gad-drafter/model.pt" in r.stdout.decode() and "training tokens/s" in r.stdout.decode()
    drafter = load_checkpoint(copy / "runs/d/gad-drafter/model.pt")
    heads = load_checkpoint(copy / "runs/d/blockwise-heads/model.pt")
    assert drafter["drafter"]["k"] == 8 and heads["proposal"]["config"]["k"] == 10
    assert heads["frozen_base"]["path"] == os.path.join("..", "..", "..", "checkpoints", "mt-en-de", "model.pt")
    assert "dev_tokens_per_call" in drafter["meta"] and "dev_tokens_per_call" in heads["meta"]


def test_every_job_runs_with_the_compile_option_given():
    """Guards --compile reaching train.py: off (eager) unless told otherwise."""
    from refdec.commands.train_drafters import JOBS, build_parser, job_command

    for argv, value in (([], "off"), (["--compile", "auto"], "auto")):
        args = build_parser().parse_args(argv)
        for job in JOBS:
            cmd = job_command(args, *job)
            assert cmd[cmd.index("--compile") + 1] == value


@pytest.fixture
def fake_jobs(tmp_path, monkeypatch):
    """train_drafters in tmp_path with its train.py jobs replaced by one that records its command and
    environment and writes what a finished job leaves (log.jsonl, model.pt)."""
    from refdec.commands import train_drafters

    monkeypatch.chdir(tmp_path)
    ran = []

    def run_job(cmd, env):
        ran.append((cmd, env))
        out = Path(cmd[cmd.index("--out-dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.jsonl").write_text('{"dev_tokens_per_call": 1.5, "tokens_per_s": 1000}\n')
        (out / "model.pt").write_bytes(b"")
        return 0, False

    monkeypatch.setattr(train_drafters, "run_job", run_job)
    return train_drafters, ran


def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_cuda_a_full_run_is_refused_before_anything_is_written(fake_jobs, monkeypatch, capsys, tmp_path):
    """Case: on a machine with no GPU the command started the GPU-sized training on the CPU with no
    warning, and a stop left runs/drafters/gad-drafter/tokenizer.json behind. Now it refuses in one
    line saying how to ask for a CPU run; --device cuda is refused even for a smoke run."""
    td, ran = fake_jobs
    no_cuda(monkeypatch)
    for argv in ([], ["--device", "cuda", "--max-steps", "2"]):
        assert td.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: no CUDA GPU here") and "--device cpu" in err[0], err
    assert not ran and not list(tmp_path.iterdir())


def test_a_cpu_run_is_a_smoke_run_or_asked_for(fake_jobs, monkeypatch, capsys):
    """Guards the CPU runs that stay possible: a smoke run without CUDA, and --device cpu, whose jobs
    see no GPU even where there is one."""
    td, ran = fake_jobs
    no_cuda(monkeypatch)
    assert td.main(["--max-steps", "2"]) == 0
    assert [cmd[cmd.index("--out-dir") + 1] for cmd, _ in ran] == [
        "runs/drafters/gad-drafter",
        "runs/drafters/blockwise-heads",
    ]
    assert all(cmd[cmd.index("--max-steps") + 1] == "2" and "--resume" not in cmd for cmd, _ in ran)
    assert "gad-drafter: runs/drafters/gad-drafter/model.pt | best dev tokens per call 1.500" in capsys.readouterr().out
    ran.clear()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert td.main(["--device", "cpu", "--overwrite", "--only", "gad-drafter"]) == 0
    assert len(ran) == 1 and ran[0][1]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_folder_holding_a_run_is_refused_before_any_job_starts(fake_jobs, capsys, tmp_path):
    """Case: a rerun after a stop was refused by the first job's train.py, saying "pass --resume", an
    option the command did not have. Now the command checks every job's folder before the first job
    starts, and names its own --resume and --overwrite."""
    td, ran = fake_jobs
    (tmp_path / "runs/drafters/blockwise-heads").mkdir(parents=True)
    (tmp_path / "runs/drafters/blockwise-heads/tokenizer.json").write_text("{}")
    assert td.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs/drafters/blockwise-heads already holds a run (tokenizer.json)" in err[0], err
    assert "--resume" in err[0] and "--overwrite" in err[0] and not ran
    assert td.main(["--device", "cpu", "--resume", "--overwrite"]) == 2 and "choose one" in capsys.readouterr().err


def test_resume_keeps_finished_jobs_and_continues_stopped_ones(fake_jobs, capsys, tmp_path):
    """Guards --resume: a finished job (model.pt) is kept, a job with a last.pt continues with train.py
    --resume, and one stopped before its first checkpoint (tokenizer.json alone) starts again."""
    td, ran = fake_jobs
    drafter, heads = tmp_path / "runs/drafters/gad-drafter", tmp_path / "runs/drafters/blockwise-heads"
    for folder, files in ((drafter, ("model.pt", "last.pt")), (heads, ("last.pt",))):
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_bytes(b"")
    (drafter / "log.jsonl").write_text('{"dev_tokens_per_call": 2.0}\n{"tokens_per_s": 500}\n')
    assert td.main(["--device", "cpu", "--resume"]) == 0
    assert len(ran) == 1 and "runs/drafters/blockwise-heads" in ran[0][0] and ran[0][0][-1] == "--resume"
    out = capsys.readouterr().out
    assert (
        "gad-drafter: runs/drafters/gad-drafter/model.pt | best dev tokens per call 2.000 | 500 training tokens/s "
        "| finished before" in out
    )
    assert json.loads((tmp_path / "runs/drafters/summary.json").read_text())["gad-drafter"]["minutes"] is None
    ran.clear()
    for name in ("model.pt", "last.pt", "log.jsonl"):
        (drafter / name).unlink()
    (drafter / "tokenizer.json").write_text("{}")
    assert td.main(["--device", "cpu", "--resume", "--only", "gad-drafter"]) == 0
    assert len(ran) == 1 and ran[0][0][-1] == "--overwrite"


def test_an_interrupted_job_ends_the_command_saying_how_to_resume(fake_jobs, monkeypatch, capsys, tmp_path):
    """Guards Ctrl-C: the job that saved its last.pt and exited 130 ends the command (exit 130, no
    summary, no later job) with the line saying to rerun with --resume."""
    td, ran = fake_jobs
    monkeypatch.setattr(td, "run_job", lambda cmd, env: ran.append(cmd) or (130, True))
    assert td.main(["--device", "cpu"]) == 130
    assert len(ran) == 1 and not (tmp_path / "runs/drafters/summary.json").exists()
    assert "interrupted in job gad-drafter: continue with the same command and --resume" in capsys.readouterr().err


def test_ctrl_c_waits_for_the_job_to_save_its_checkpoint(tmp_path):
    """Case: the command ran each job with subprocess.run, which kills the job a quarter of a second
    after Ctrl-C, before train.py has saved its last.pt. Here the job itself sends the Ctrl-C to
    this process and takes a second to finish: run_job waits for it and reports the Ctrl-C."""
    from refdec.commands.train_drafters import run_job

    done = tmp_path / "saved"
    script = (
        "import os, signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "os.kill(os.getppid(), signal.SIGINT)\ntime.sleep(1)\n"
        f"open({str(done)!r}, 'w').close()\nsys.exit(130)\n"
    )
    assert run_job([sys.executable, "-c", script], dict(os.environ)) == (130, True)
    assert done.exists()


def test_files_prints_the_total_and_a_missing_file_exits_2(capsys, monkeypatch, tmp_path):
    """Case: --files exited 1 with no total size when files were missing (bench's exits 2 and prints
    it). Now: the list, "N files, X MiB" on stderr; from a copy lacking a file, one line naming it
    (exit 2); installed without the repository (pip install .), the line saying to use a clone."""
    from refdec import repo
    from refdec.commands import train_drafters as td

    assert td.main(["--files"]) == 0
    captured = capsys.readouterr()
    assert "train.py" in captured.out.split() and re.search(r"^\d+ files, [\d.]+ MiB", captured.err, re.M)
    monkeypatch.setattr(repo, "REPO", tmp_path)
    assert td.main(["--files"]) == 2 and "pip install -e ." in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    (tmp_path / "data/build.py").write_text("")
    assert td.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        f"error: train.py is not in this copy of the repository "
        f"({len(td.needed_files()) - 1} file(s) missing): copy every file "
        f"`python -m refdec train-drafters --files` lists"
    )


@pytest.mark.slow
def test_ctrl_c_stops_a_run_that_resume_continues(tmp_path):
    """Guards the stop-and-resume of a real run: Ctrl-C (to the command and its job, as a terminal
    sends it) once the drafter's job trains leaves its last.pt and no model.pt, exit 130 saying to
    rerun with --resume; a plain rerun is refused before anything starts; --resume continues the
    job from its last.pt to its end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    smoke = [
        sys.executable,
        "-m",
        "refdec",
        "train-drafters",
        "--only",
        "gad-drafter",
        "--train-limit",
        "200",
        "--dev-limit",
        "8",
        "--out-dir",
        "d",
    ]
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*smoke, "--max-steps", "1000"], cwd=tmp_path, stderr=f, env=env, start_new_session=True
        )
        t0 = time.time()
        while "model: " not in log.read_text():  # the job's last line before its training starts
            assert proc.poll() is None and time.time() - t0 < 300, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    err = log.read_text()
    assert (
        "Traceback" not in err and "interrupted in job gad-drafter: continue with the same command and --resume" in err
    )
    step = int(re.search(r"interrupted at step (\d+)", err).group(1))
    job = tmp_path / "d/gad-drafter"
    assert (job / "last.pt").is_file() and not (job / "model.pt").exists()
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    r = subprocess.run([*smoke, "--max-steps", "1000"], **run)
    assert r.returncode == 2 and "pass --resume" in r.stderr and "== gad-drafter" not in r.stderr
    r = subprocess.run([*smoke, "--max-steps", str(step + 1), "--resume"], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from d/gad-drafter/last.pt at step {step}" in r.stderr and (job / "model.pt").is_file()
    assert load_checkpoint(job / "last.pt")["step"] == step + 1


def test_minutes_sets_every_jobs_time_limit():
    """--minutes replaces each job's own time limit; without it each job keeps its own."""
    from refdec.commands.train_drafters import JOBS, build_parser, job_command

    for argv, expected in (([], [job[3] for job in JOBS]), (["--minutes", "3.5"], [3.5] * len(JOBS))):
        args = build_parser().parse_args(argv)
        limits = [float((cmd := job_command(args, *job))[cmd.index("--time-limit-min") + 1]) for job in JOBS]
        assert limits == expected


def test_minutes_must_be_positive(fake_jobs, capsys):
    td, ran = fake_jobs
    assert td.main(["--minutes", "0", "--max-steps", "1"]) == 2
    assert "--minutes must be more than 0" in capsys.readouterr().err and not ran
