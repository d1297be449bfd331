"""train.py and decode.py under misuse: nothing lost, nothing clobbered, nothing that takes the
machine down. Each test names the case it guards; every failure is one line and exit 2."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, fake_models, own_corpus, run_py

TINY = ["train.py", "--preset", "tiny", "--train-limit", "400", "--threads", "1", "--dev-limit", "16"]
DECODE = ["decode.py", "--task", "mt-en-de", "--threads", "1", "--quiet"]


def one_line_error(r, code: int = 2) -> str:
    err = r.stderr.decode().strip()
    assert r.returncode == code, (r.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error:"), err
    return err


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def readme_training_commands() -> list[str]:
    """Every `python train.py ...` command the documentation gives (README.md, then docs/*.md, then
    checkpoints/README.md), in the order it gives them."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "checkpoints" / "README.md"]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages if p.exists())
    text = re.sub(r"\\\n\s+", " ", text)  # a command continued on the next line with a backslash
    found = re.findall(r"`(python train\.py [^`]*)`|^    (python train\.py [^#\n]*)", text, flags=re.M)
    commands = (" ".join((inline or block).split()) for inline, block in found)
    return list(dict.fromkeys(c for c in commands if "--preset" in c))


# -- train.py ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_readme_training_commands_leave_the_shipped_checkpoints_untouched(tmp_path):
    """Case: `python train.py --preset gec-uk ...` from the README overwrote the shipped
    checkpoints/gec-uk/model.pt. Every training command the documentation gives (and that one), run
    for one step from another folder, writes under runs/ there or fails in one line; checkpoints/ is
    byte-identical."""
    commands = readme_training_commands()
    assert len(commands) >= 10 and any("--resume" in c for c in commands)
    commands.append("python train.py --preset gec-uk --max-steps 2 --eval-every 1 --eval-sentences 2 --threads 1")
    before = tree_digest(REPO / "checkpoints")
    quick = [
        "--max-steps",
        "1",
        "--eval-every",
        "1",
        "--eval-sentences",
        "2",
        "--train-limit",
        "64",
        "--dev-limit",
        "8",
        "--threads",
        "1",
    ]
    ran, folder_of = 0, {}
    for n, command in enumerate(commands):
        args = shlex.split(command)[2:]
        preset = args[args.index("--preset") + 1]
        # each command in a folder of its own; --resume in the folder of the run it continues; the
        # own-corpus recipe's commands (--data-dir mydata) one after the other in one folder that
        # holds such a corpus, so that a later one finds the model an earlier one wrote
        own = "--data-dir" in args and args[args.index("--data-dir") + 1] == "mydata"
        if "--resume" in args:
            cwd = folder_of[preset]
        elif own:
            cwd = tmp_path / "own"
            if not cwd.exists():
                own_corpus(cwd / "mydata")
        else:
            cwd = tmp_path / str(n)
        cwd.mkdir(exist_ok=True)
        folder_of[preset] = cwd
        r = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args, *quick],
            cwd=cwd,
            capture_output=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        err = r.stderr.decode()
        assert "Traceback" not in err, (command, err)
        if r.returncode == 0:
            ran += 1
            out = args[args.index("--out-dir") + 1] if "--out-dir" in args else f"runs/{preset}"
            assert (cwd / out / "model.pt").exists(), command
        else:  # e.g. a distilled folder that is not shipped: one line naming what to build
            assert r.returncode == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, (
                command,
                err,
            )
    assert ran >= len(commands) - 2
    assert tree_digest(REPO / "checkpoints") == before


@pytest.mark.slow
def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    """Case: rerunning into an existing --out-dir restarted silently at step 0 and overwrote its
    checkpoints (log.jsonl then read 20, 40, 60, 20, 22). Now it is refused; --overwrite starts afresh."""
    out = tmp_path / "run"
    assert run_py(*TINY, "--out-dir", str(out), "--max-steps", "4", "--eval-every", "2").returncode == 0
    before = tree_digest(out)
    err = one_line_error(run_py(*TINY, "--out-dir", str(out), "--max-steps", "2", "--eval-every", "1"))
    assert "already holds a training run" in err and "--resume" in err and "--overwrite" in err
    assert tree_digest(out) == before
    r = run_py(*TINY, "--out-dir", str(out), "--max-steps", "2", "--eval-every", "1", "--overwrite")
    assert r.returncode == 0, r.stderr.decode()
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "choose one" in one_line_error(run_py(*TINY, "--out-dir", str(out), "--resume", "--overwrite"))


@pytest.mark.slow
def test_resume_refuses_another_configuration(tmp_path):
    """Cases: --resume with another --task trained the old model on other data under the new task's
    name; another --lr or --batch-tokens was accepted silently; another preset or --d-model died with
    a 26 KB traceback; --resume without last.pt started from scratch silently."""
    out = tmp_path / "run"
    assert run_py(*TINY, "--out-dir", str(out), "--max-steps", "2", "--eval-every", "2").returncode == 0
    for flags, needle in (
        (["--task", "gec-en"], "task"),
        (["--lr", "0.01"], "lr"),
        (["--batch-tokens", "900"], "batch_tokens"),
        (["--d-model", "64"], "d_model"),
    ):
        err = one_line_error(run_py(*TINY, "--out-dir", str(out), "--max-steps", "4", "--resume", *flags))
        assert "another configuration" in err and needle in err, err
    err = one_line_error(run_py("train.py", "--preset", "gec-uk", "--out-dir", str(out), "--resume", "--threads", "1"))
    assert "another configuration" in err
    err = one_line_error(run_py(*TINY, "--out-dir", str(tmp_path / "empty"), "--resume"))
    assert "nothing to resume" in err
    # what may change on resume: how long it runs
    r = run_py(*TINY, "--out-dir", str(out), "--max-steps", "3", "--eval-every", "3", "--resume")
    assert r.returncode == 0 and b"resumed from" in r.stderr, r.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-steps", "0"], "max-steps must be at least 1"),
        (["--eval-every", "0"], "eval-every must be at least 1"),
        (["--threads", "-1"], "threads must be at least 0"),
        (["--threads", "10000"], "cores"),
        (["--lr", "nan"], "lr must be a positive number"),
        (["--warmup-steps", "0"], "warmup-steps must be at least 1"),
        (["--dropout", "1"], "dropout must be in [0, 1)"),
    ],
)
def test_bad_training_options_are_one_line_errors(tmp_path, args, needle):
    """Cases: --max-steps 0 exited 0 with no model and no message; --eval-every 0 and --threads -1
    gave tracebacks; --threads 10000 was accepted."""
    assert needle in one_line_error(run_py(*TINY, "--out-dir", str(tmp_path / "x"), *args))
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_an_out_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    """Case: --out-dir naming a file gave a traceback."""
    f = tmp_path / "file"
    f.write_text("not a folder")
    assert "is a file" in one_line_error(run_py(*TINY, "--out-dir", str(f)))


def train_script():
    """train.py's command, refdec.commands.train."""
    return importlib.import_module("refdec.commands.train")


def test_out_dir_rule_for_the_shipped_checkpoints_folder():
    """Case: `--out-dir checkpoints/newmodel` wrote a run without --overwrite, and `--out-dir
    checkpoints` put model.pt, last.pt and snapshots/ straight into the checkpoints/ root. The rule
    the README states: checkpoints/<name> only with --overwrite (--resume continues such a run),
    checkpoints/ itself never, however the path is spelled."""
    from refdec.errors import UsageError

    check = train_script().check_out_dir_place
    root = REPO / "checkpoints"
    for spelled in (root, root / "mt-en-de" / "..", Path(os.path.relpath(root)) / "."):
        for overwrite in (False, True):
            with pytest.raises(UsageError, match="shipped models itself"):
                check(str(spelled), overwrite=overwrite, resume=False)
    for inside in (root / "newmodel", root / "mt-en-de", root / "newmodel" / "deeper"):
        with pytest.raises(UsageError, match="inside checkpoints/.*--overwrite"):
            check(str(inside), overwrite=False, resume=False)
        check(str(inside), overwrite=True, resume=False)  # told: allowed
        check(str(inside), overwrite=False, resume=True)  # continuing a run started so (needs its last.pt)
    check(str(REPO / "runs" / "x"), overwrite=False, resume=False)  # beside it: allowed


@pytest.mark.slow
def test_train_py_refuses_the_checkpoints_folder_before_any_work(tmp_path):
    """The commands of the case, run as written: one line, exit 2, nothing created in checkpoints/."""
    before = sorted(p.name for p in (REPO / "checkpoints").iterdir())
    assert "shipped models itself" in one_line_error(run_py(*TINY, "--out-dir", "checkpoints"))
    assert "shipped models itself" in one_line_error(run_py(*TINY, "--out-dir", "checkpoints", "--overwrite"))
    err = one_line_error(run_py(*TINY, "--out-dir", "checkpoints/newmodel-refused"))
    assert "inside checkpoints/" in err and "--overwrite" in err and "runs/" in err
    assert sorted(p.name for p in (REPO / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_an_out_dir_under_a_file_is_a_one_line_error(tmp_path):
    """Case: an --out-dir that cannot be created gave a bare OSError (exit 1). A folder under a
    regular file cannot be created by anyone, root included."""
    f = tmp_path / "file"
    f.write_text("not a folder")
    err = one_line_error(run_py(*TINY, "--out-dir", str(f / "run")))
    assert "--out-dir" in err and str(f) in err and "is a file, not a folder" in err


@pytest.mark.slow
def test_a_read_only_out_dir_is_a_one_line_error(tmp_path):
    """Case: `train.py --out-dir` on a read-only folder exited 1 with a bare OSError. Now one line
    naming the flag and the folder, exit 2, before any work."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user writes into a read-only folder anyway (root)")
        err = one_line_error(run_py(*TINY, "--out-dir", str(ro / "run")))
        assert "--out-dir" in err and str(ro) in err and "not writable" in err
    finally:
        ro.chmod(0o755)


def test_a_write_that_fails_in_the_out_dir_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Case: a write into --out-dir that failed (a read-only disk, a full one, or a folder made
    read-only once the run had started; also for root) ended in a bare OSError and exit 1."""
    import errno

    from refdec import training

    out = tmp_path / "run"

    def read_only_disk(self):
        raise OSError(errno.EROFS, "Read-only file system", str(out / "tokenizer.json"))

    monkeypatch.setattr(training.Trainer, "run", read_only_disk)
    previous = signal.getsignal(signal.SIGINT)  # main() holds Ctrl-C while it imports
    try:
        code = train_script().main(["--preset", "tiny", "--threads", "1", "--out-dir", str(out)])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --out-dir") and "tokenizer.json" in err and "Read-only file system" in err


def test_train_py_refuses_an_out_dir_among_its_training_data(tmp_path, capsys):
    """Case: `train.py --data-dir D --out-dir D/mt-en-de` wrote model.pt, tokenizer.json, log.jsonl and
    snapshots/ among the train and dev files it read. The folder of the run's data files, a folder inside
    it and the data folder itself are refused in one line, exit 2, before anything is written (with
    --overwrite too, and the repository's data/mt-en-de as well); a folder above the data folder and
    another task's folder pass."""
    from refdec.errors import UsageError

    data = tmp_path / "d"
    (data / "mt-en-de").mkdir(parents=True)
    for name in ("train.src.gz", "train.tgt.gz", "dev.src.gz", "dev.tgt.gz"):
        (data / "mt-en-de" / name).write_bytes(b"")
    before = tree_digest(tmp_path)
    for out, extra in (
        (data / "mt-en-de", []),
        (data / "mt-en-de", ["--overwrite"]),
        (data, []),
        (data / "mt-en-de" / "run", []),
    ):
        previous = signal.getsignal(signal.SIGINT)  # main() holds Ctrl-C while it imports
        try:
            code = train_script().main(
                ["--preset", "tiny", "--threads", "1", "--data-dir", str(data), "--out-dir", str(out), *extra]
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: --out-dir {out} "), err
        assert "training data" in err and "runs/<name>" in err
    assert tree_digest(tmp_path) == before and not list(data.rglob("*.pt"))
    from refdec.training import check_out_dir_data as check

    with pytest.raises(UsageError, match="is the folder of the run's training data"):
        check(str(REPO / "data" / "mt-en-de"), "", "mt-en-de")  # the default data folder
    check(str(tmp_path), str(data), "mt-en-de")  # the folder that holds the data folder
    check(str(data / "gec-uk"), str(data), "mt-en-de")  # another task's folder


@pytest.mark.slow
def test_train_py_logs_the_vocabulary_size_it_trained(tmp_path):
    """Case: train.py logged "tokenizer: 8000 BPE tokens trained" when the vocabulary it trained had
    1,607 (too little text for 8,000). It logs the size it trained and the size asked for."""
    from refdec.tokenizer import Tokenizer

    out = tmp_path / "run"
    r = run_py(
        *TINY,
        "--train-limit",
        "50",
        "--vocab-size",
        "8000",
        "--out-dir",
        str(out),
        "--max-steps",
        "1",
        "--eval-every",
        "1",
        "--eval-sentences",
        "2",
    )
    assert r.returncode == 0, r.stderr.decode()
    size = Tokenizer.load(out / "tokenizer.json").vocab_size
    assert size < 8000
    assert f"tokenizer: {size} BPE tokens trained (8000 asked for:" in r.stderr.decode(), r.stderr.decode()


def _wait_for(proc, path: Path, needle: str, timeout: float = 120) -> None:
    t0 = time.time()
    while needle not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, "the process ended before it could be interrupted"
        assert time.time() - t0 < timeout
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_saves_a_resumable_checkpoint(tmp_path):
    """Case: Ctrl-C during training gave a traceback and lost the steps since the last evaluation.
    Now it stops after the current update with last.pt saved, exits 130 in one line, and --resume
    continues to exactly the weights of an uninterrupted run."""
    common = ["--max-steps", "400", "--eval-every", "200", "--log-every", "5"]
    split, log = tmp_path / "split", tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *TINY, "--out-dir", str(split), *common],
            cwd=REPO,
            stderr=f,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        _wait_for(proc, log, "| loss ")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    err = log.read_text()
    assert "Traceback" not in err and "last.pt saved" in err and "--resume" in err, err
    step = int(re.search(r"interrupted at step (\d+)", err).group(1))
    assert 5 <= step < 400 and not (split / "model.pt").exists()
    r = run_py(*TINY, "--out-dir", str(split), *common, "--resume")
    assert r.returncode == 0 and f"at step {step}".encode() in r.stderr, r.stderr.decode()
    straight = tmp_path / "straight"
    assert run_py(*TINY, "--out-dir", str(straight), *common).returncode == 0
    from refdec.checkpoint import load_checkpoint

    a, b = load_checkpoint(straight / "last.pt")["model"], load_checkpoint(split / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """Case: Ctrl-C while train.py or decode.py was still starting gave a traceback."""
    for cmd in ([*TINY, "--out-dir", str(tmp_path / "x")], [*DECODE, "--algo", "greedy"]):
        proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.3)  # importing torch
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        # 130 after a one-line message; -SIGINT if the signal came before Python set up its handler
        assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
        assert b"Traceback" not in err and len(err.decode().strip().splitlines()) <= 2, err


def test_ctrl_c_is_held_until_the_imports_are_done():
    """Case: a Ctrl-C that landed inside `import torch` broke numpy for the rest of the process, so
    the script printed an ImportError traceback (or aborted) instead of 'interrupted'."""
    from refdec import interrupt

    previous = signal.getsignal(signal.SIGINT)
    try:
        interrupt.hold_sigint()
        os.kill(os.getpid(), signal.SIGINT)  # held: recorded, nothing raised here
        time.sleep(0.05)
        with pytest.raises(KeyboardInterrupt):  # the held one, raised once the imports are done
            interrupt.release_sigint()
        with pytest.raises(KeyboardInterrupt):  # released: the next one raises where it lands
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupt._pressed = interrupt._holding = False


# -- decode.py -----------------------------------------------------------------------------------


def decode(ckpt, *args, **kw):
    return run_py(*DECODE, "--model", str(ckpt / "model.pt"), *args, **kw)


@pytest.fixture(scope="module")
def many_lines(tmp_path_factory) -> Path:
    """2,000 real test sentences: long enough to interrupt a decode half-way."""
    from refdec.data import DATA_DIR, read_lines

    path = tmp_path_factory.mktemp("input") / "in.txt"
    lines = read_lines(DATA_DIR / "mt-en-de" / "test.src.gz")
    path.write_text("\n".join((lines * 2)[:2000]) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_output_paths_are_checked_before_decoding(trained_tiny, tmp_path, many_lines):
    """Case: an unwritable --report or --output (a missing folder, a folder, /proc) was discovered only
    after all the decoding, and nothing was written. Now the run stops at once, in one line, and an
    --output equal to the input is refused instead of overwriting it."""
    cases = [
        ("--output", str(tmp_path / "missing" / "out.txt"), "does not exist"),
        ("--report", str(tmp_path), "is a folder"),
        ("--report", "/proc/refdec-report.json", "cannot be written"),
        ("--output", str(many_lines), "is also the input"),
    ]
    for flag, path, needle in cases:
        t0 = time.time()
        r = decode(trained_tiny, "--algo", "greedy", "--input", str(many_lines), flag, path)
        assert needle in one_line_error(r) and time.time() - t0 < 60
    assert len(many_lines.read_text().splitlines()) == 2000
    assert not (tmp_path / "refdec-report.json").exists()


def _interrupt_decode(ckpt, many_lines, out, report, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            *DECODE,
            "--model",
            str(ckpt / "model.pt"),
            "--algo",
            "greedy",
            "--input",
            str(many_lines),
            "--ref",
            str(many_lines),
            "--max-len",
            "30",
            "--output",
            str(out),
            "--report",
            str(report),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    t0 = time.time()
    while not (out.exists() and out.read_text(encoding="utf-8").count("\n") >= 10):
        assert proc.poll() is None and time.time() - t0 < 120, "decode.py ended before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(sig)
    table, err = proc.communicate(timeout=120)
    return proc.returncode, table.decode(), err.decode()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_decode_keeps_every_finished_line(trained_tiny, tmp_path, many_lines, sig):
    """Case: Ctrl-C printed "interrupted" and wrote neither the outputs decoded so far nor a report.
    Now outputs are written as they are decoded, in input order, whole lines only: after Ctrl-C
    (exit 130, a report marked interrupted) or kill -9, the file holds the first lines of a full
    run's output, each complete. Case: SIGTERM (kill, timeout, batch schedulers) exited 143 with no
    table, no report and no message; it now ends as Ctrl-C does, with exit status 143. The table's
    BLEU and chrF are the report's: those of the lines written."""
    out, report = tmp_path / "out.txt", tmp_path / "r.json"
    code, table, err = _interrupt_decode(trained_tiny, many_lines, out, report, sig)
    text = out.read_text(encoding="utf-8")
    assert text.endswith("\n")
    kept = text.splitlines()
    assert 10 <= len(kept) < 2000
    full = decode(
        trained_tiny, "--algo", "greedy", "--input", str(many_lines), "--max-len", "30", "--limit", str(len(kept))
    )
    assert full.returncode == 0 and full.stdout.decode("utf-8").splitlines() == kept
    if sig != signal.SIGKILL:
        said = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"
        assert code == (130 if sig == signal.SIGINT else 143), (code, err)
        assert "Traceback" not in err and f"warning: {said} after {len(kept)} of 2000 input lines" in err, err
        rep = json.loads(report.read_text())
        assert rep["interrupted"] is True and rep["lines_decoded"] == len(kept) == rep["decoded"]
        assert re.search(rf"^greedy +{len(kept)} ", table, re.M), table  # the table of the lines written
        assert re.search(rf"BLEU +chrF\n.*\ngreedy .* {rep['bleu']:.2f} +{rep['chrf']:.2f}$", table, re.M), table
    else:
        assert code == -signal.SIGKILL


@pytest.mark.slow
def test_options_are_bounded_by_the_machine(trained_tiny, monkeypatch):
    """Cases: --beam-size 100000 reached 22.8 GB and was killed by the kernel; --threads 10000 ran
    3 sentences in 290 s; --batch-size 100000 peaked at 11.8 GB. Beams and batch rows are bounded by
    the memory free (the refusal says how many fit); threads by the cores."""
    r = decode(trained_tiny, "--algo", "beam", "--beam-size", "100000000", "--limit", "3")
    assert "GiB" in one_line_error(r) and "use at most" in r.stderr.decode()
    assert "cores" in one_line_error(decode(trained_tiny, "--algo", "greedy", "--threads", "10000"))
    from refdec.app import runner
    from refdec.app.algorithms import ALGORITHMS
    from refdec.app.loading import Models
    from refdec.checkpoint import load_model
    from refdec.errors import UsageError

    model, _, _ = load_model(trained_tiny / "model.pt")
    run = runner.Run(ALGORITHMS["greedy"], {}, Models(model, trained_tiny / "model.pt"), batch_size=100000)
    ids = [[7] * 50 for _ in range(4000)]
    monkeypatch.setattr(runner.memory, "available_memory", lambda: 2**26)
    with pytest.raises(UsageError, match="sentences per batch"):
        runner.check_fits(run, ids, None, 128, torch.float32)
    run.batch_size = 8
    runner.check_fits(run, ids, None, 128, torch.float32)  # fits


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--algo", "beam", "--length-penalty", "nan"], "finite"),
        (["--algo", "beam", "--length-penalty", "1e300"], "between -10 and 10"),
        (["--algo", "bild", "--small", "x.pt", "--fallback-threshold", "-1"], "at least 0"),
        (["--algo", "bild", "--small", "x.pt", "--rollback-threshold", "inf"], "finite"),
    ],
)
def test_non_finite_and_negative_thresholds_are_refused(trained_tiny, args, needle):
    """Case: --length-penalty nan and --fallback-threshold -1 were accepted silently (and a huge
    length penalty overflowed)."""
    assert needle in one_line_error(decode(trained_tiny, *args))


def test_warm_up_is_a_few_sentences_whatever_the_batch_size():
    """Case: --batch-size 100000 made the warm-up decode the whole input twice."""
    from refdec.app import runner
    from refdec.app.algorithms import Algorithm
    from refdec.decoding import DecodeResult, DecodeStats

    seen = []

    def fake(model, src, *, max_len, trace=False):
        seen.append(src.shape[0])
        return DecodeResult([torch.tensor([5])] * src.shape[0], DecodeStats())

    run = runner.Run(Algorithm("fake", fake, "counts rows"), {}, fake_models(), batch_size=100000)
    runner.decode_lines([run], [[5, 6]] * 500, max_len=4, max_positions=64, device="cpu", warmup=2, progress=False)
    assert seen == [runner.WARMUP_ROWS, 500]


def test_a_run_that_fails_in_the_warm_up_is_warned_of_and_the_others_go_on(capsys):
    """Case: `hf audit` stopped at the first failure inside the warm-up (`Error: RuntimeError: IndexError:
    index out of range in self`, exit 1, naming neither the method nor the line), while the same failure in
    the timed loop is one warning and an empty output line. The warm-up now fails as the timed loop does:
    a warning naming the run and the line, the other runs and lines decoded, the line tried again timed."""
    from refdec.app import runner
    from refdec.app.algorithms import Algorithm
    from refdec.decoding import DecodeResult, DecodeStats

    tried = []

    def fails_on_long(model, src, *, max_len, trace=False):
        tried.append(src.shape[1])
        if src.shape[1] > 3:
            raise RuntimeError("IndexError: index out of range in self")
        return DecodeResult([torch.tensor([5])] * src.shape[0], DecodeStats())

    def fine(model, src, *, max_len, trace=False):
        return DecodeResult([torch.tensor([6])] * src.shape[0], DecodeStats())

    runs = [
        runner.Run(Algorithm("fine", fine, "never fails"), {}, fake_models()),
        runner.Run(Algorithm("fragile", fails_on_long, "fails on long lines"), {}, fake_models()),
    ]
    ids = [[5, 6, 7], [5, 6], [5], [5, 6, 7, 8]]  # chunks in input order: line 1 is the warm-up's first
    assert runner.decode_lines(runs, ids, max_len=4, max_positions=64, device="cpu", warmup=2, progress=False) == 4
    err = capsys.readouterr().err
    assert "fragile failed on input line(s) 1 in the warm-up: IndexError: index out of range in self" in err, err
    assert "fragile failed on input line(s) 1: IndexError" in err and "fragile failed on input line(s) 4: " in err
    assert tried.count(4) == 2  # line 1 (3 ids and eos) in the warm-up and again timed
    assert [o is None for o in runs[1].outputs] == [True, False, False, True]
    assert all(o is not None for o in runs[0].outputs)


@pytest.mark.slow
def test_exit_codes_are_one_for_every_usage_error(trained_tiny, tiny_extras, tmp_path):
    """Cases: a non-gzip .gz input and an out-of-range --block-size exited 1 where every other usage
    error exits 2; a text file as --model said "IndexError: pop from empty list"."""
    bad = tmp_path / "in.gz"
    bad.write_text("plain text\n")
    assert "not a valid gzip file" in one_line_error(decode(trained_tiny, "--algo", "greedy", "--input", str(bad)))
    r = run_py(
        *DECODE, "--algo", "blockwise", "--model", str(tiny_extras["heads"]), "--block-size", "9", "--limit", "1"
    )
    assert "--block-size must be between 2 and the 3" in one_line_error(r)
    r = run_py(*DECODE, "--algo", "greedy", "--model", str(REPO / "README.md"))
    assert "is not a checkpoint" in one_line_error(r)


@pytest.mark.slow
def test_a_missing_default_checkpoint_names_the_tasks_that_have_one():
    """Case: --algo gad --task gec-uk failed on a missing checkpoint and nothing said which algorithms
    have shipped models for which task."""
    r = run_py("decode.py", "--algo", "gad", "--task", "gec-uk", "--limit", "1")
    assert "--algo gad has shipped models for --task mt-en-de" in one_line_error(r)


@pytest.mark.slow
def test_the_relative_column_says_what_it_means(trained_tiny):
    """Case: the table printed `greedy ... speedup 0.55x` for the faster algorithm, its meaning in a
    footnote. The column now reads "speed vs <first row>" with "... slower" or "... faster"."""
    r = decode(trained_tiny, "--algo", "greedy", "--limit", "4", "--compare", "beam", "--max-len", "8")
    err = r.stderr.decode()
    assert r.returncode == 0 and "speed vs greedy" in err and re.search(r"\d\.\d\dx (slower|faster)|same", err), err
    assert "speedup = " not in err


@pytest.mark.slow
def test_invalid_utf8_from_the_model_is_named_in_a_warning(tmp_path):
    """Case: outputs for Chinese or emoji input held U+FFFD with nothing saying why. Such lines are
    counted (the model wrote part of a multi-byte character, shown as Unicode's replacement
    character) and named in a warning; valid text is decoded unchanged."""
    from refdec.app import runner
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    text = "我们今天去公园。 I love 🍕 pizza. Привіт, é\u00a0\ufffd"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.invalid_bytes(ids) == 0
    emoji = tok.encode("🍕")
    assert len(emoji) > 1  # byte tokens: cut one off and the character is incomplete
    line, invalid = runner.text_line(tok, torch.tensor(tok.encode("pizza ") + emoji[:-1]))
    assert line.startswith("pizza ") and "\ufffd" in line and invalid == len(emoji[:-1])
    # end to end: the shipped GEC model writes part of a character on Chinese input
    src = tmp_path / "zh.txt"
    src.write_text("我们今天去公园。\nДякую.\n", encoding="utf-8")
    r = run_py("decode.py", "--algo", "greedy", "--task", "gec-uk", "--input", str(src), "--threads", "1", "--quiet")
    assert r.returncode == 0 and len(r.stdout.decode("utf-8").splitlines()) == 2
    if "\ufffd" in r.stdout.decode("utf-8").splitlines()[0]:
        assert "line(s) 1" in r.stderr.decode() and "U+FFFD" in r.stderr.decode()


@pytest.mark.slow
def test_busy_cores_sees_another_process():
    """Case: with another job on the machine a 2-thread decode ran 45x slower than --threads 1 and
    nothing said so. decode.py's probe of other processes' CPU use sees a busy loop beside it."""
    from refdec.machine import BusyCores

    probe = BusyCores()
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    burner.wait()
    busy = probe.others()
    assert busy is not None and busy >= 0.5, busy


@pytest.mark.slow
def test_decode_given_no_thread_count_leaves_the_busy_core(trained_tiny, tmp_path):
    """Case: with another process spinning on one of 2 cores, decode.py at torch's default of 2
    threads ran many times slower than with --threads 1, which looked like a hang. Given no
    --threads it now takes only the cores left idle, says so, and the report records the choice."""
    from refdec.machine import usable_cores

    if usable_cores() < 2:
        pytest.skip("one core: there is no thread to leave to another process")
    rep = tmp_path / "r.json"
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:  # torch's count is every core, as with no OMP_NUM_THREADS on a machine with one thread per core
        r = run_py(
            "decode.py",
            "--task",
            "mt-en-de",
            "--model",
            str(trained_tiny / "model.pt"),
            "--algo",
            "greedy",
            "--limit",
            "2",
            "--max-len",
            "4",
            "--output",
            str(tmp_path / "out.txt"),
            "--report",
            str(rep),
            env={"OMP_NUM_THREADS": str(usable_cores())},
        )
    finally:
        spinner.kill()
        spinner.wait()
    assert r.returncode == 0, r.stderr.decode()
    note = re.search(r"note: using (\d+) thread\(s\), not (\d+): .*--threads N overrides", r.stderr.decode())
    assert note and int(note[2]) == usable_cores(), r.stderr.decode()
    environment = json.loads(rep.read_text())["environment"]
    assert environment["threads"] == int(note[1]) < usable_cores() and environment["threads_auto"] is True
    assert environment["other_busy_cores_at_start"] >= 0.5


def test_a_line_handed_over_is_a_line_counted_whenever_the_signal_lands():
    """Case: SIGTERM that arrived while a finished line was being written was delivered as the write
    ended, before the line was counted: the output file held 11 lines and the warning, table and
    report said 10. decode_lines now writes and counts a line with the signals held back together,
    so the count it returns is the lines written."""
    from refdec.app import runner
    from refdec.app.algorithms import Algorithm
    from refdec.decoding import DecodeResult, DecodeStats
    from refdec.interrupt import hold_sigint, release_sigint

    def decode(model, src, *, max_len, trace=False):
        return DecodeResult([torch.tensor([7, 2])] * src.shape[0], DecodeStats(sentences=src.shape[0]))

    handed = []

    def on_line(i, tokens):
        handed.append(i)
        if i == 2:  # the signal lands while line 2 is handed over
            signal.raise_signal(signal.SIGTERM)

    run = runner.Run(Algorithm("fake", decode, "fake"), {}, fake_models(), batch_size=1)
    hold_sigint(sigterm=True)
    release_sigint()  # SIGTERM now raises KeyboardInterrupt where it is delivered, as in decode.py
    try:
        done = runner.decode_lines(
            [run], [[5, 6]] * 6, max_len=4, max_positions=64, device="cpu", warmup=0, progress=False, on_line=on_line
        )
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert handed == [0, 1, 2] and done == 3
