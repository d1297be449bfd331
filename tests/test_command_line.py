"""refdec's one command line: `refdec <command>` (the installed entry point) and `python -m refdec
<command>` over refdec.commands' table. Case: the commands were eight `python -m refdec.<name>` shims
in the package root plus refdec.hf's __main__, and `pip install .` gave no command to decode with.
The installed copy itself is test_packaging's (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, random_checkpoint, run_py

from refdec.commands import COMMANDS, as_typed, main


def test_help_lists_every_command_with_its_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/refdec", "--help"])
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: refdec <command>")
    for name, (_, summary) in COMMANDS.items():
        assert f"  {name}" in out and summary in out, name


def test_no_command_is_the_usage_and_status_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "decode" in err


def test_an_unknown_command_is_one_line_and_status_2(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/refdec"])
    assert main(["decod", "--algo", "greedy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: refdec: no command 'decod'; choose from {', '.join(COMMANDS)} (refdec --help)"]


def test_version(capsys):
    import refdec

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"refdec {refdec.__version__}"


@pytest.mark.parametrize(
    "argv0,typed",
    [
        ("/venv/bin/refdec", "refdec decode"),
        ("decode.py", "python decode.py"),
        ("/x/refdec/__main__.py", "python -m refdec decode"),
        ("train.py", "python -m refdec decode"),
    ],
)
def test_a_command_is_named_as_the_user_typed_it(monkeypatch, argv0, typed):
    """The usage line and the examples of `refdec decode --help` read `refdec decode`, those of the
    script's `python decode.py`, so that a user can copy them."""
    monkeypatch.setattr(sys, "argv", [argv0])
    assert as_typed("decode") == typed
    from refdec.commands.decode import build_parser

    text = build_parser().format_help()
    assert text.startswith(f"usage: {typed} ") and f"    {typed} --algo greedy --task mt-en-de" in text


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_runs_through_the_table(capsys, monkeypatch, name):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/refdec"])
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: refdec {name}")


def test_help_imports_no_command_and_no_torch():
    """`refdec --help` is instant and needs no optional package: a command's module (and torch) is
    imported only when that command runs."""
    code = (
        "import sys\nfrom refdec.commands import main\nmain(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'refdec', 'transformers')))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "['refdec', 'refdec.commands']", r.stdout + r.stderr


def test_python_m_refdec_is_the_same_command_line():
    r = run_py("-m", "refdec", "nocommand")
    assert r.returncode == 2 and r.stderr.decode().startswith("error: python -m refdec: no command 'nocommand'")


def test_decode_needs_only_a_checkpoint_and_an_input(tmp_path, capsys):
    """`refdec decode --model FILE --input FILE` decodes with a user's own checkpoint: greedy, no
    --task (which only picks the defaults of the repository's tasks)."""
    ckpt = random_checkpoint(tmp_path / "ckpt", eos_bias=14)
    (tmp_path / "in.txt").write_text("the cat\na dog ran\n", encoding="utf-8")
    argv = [
        "--model",
        str(ckpt),
        "--input",
        str(tmp_path / "in.txt"),
        "--output",
        str(tmp_path / "out.txt"),
        "--threads",
        "1",
        "--quiet",
        "--max-len",
        "6",
    ]
    assert main(["decode", *argv]) == 0, capsys.readouterr().err
    assert len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == 2
    assert main(["decode", *argv[2:]]) == 2  # no --model: the task's defaults are needed
    assert "--task is needed unless --model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["decode", "--task", "mt-en-de"], "checkpoints/mt-en-de/model.pt is in refdec's repository, and this refdec"),
        (["decode", "--task", "mt-en-de", "--model", "{ckpt}"], "data/mt-en-de/test.src.gz is in refdec's repository"),
        (
            ["decode", "--algo", "bild", "--task", "mt-en-de", "--model", "{ckpt}", "--input", "{input}"],
            "checkpoints/mt-en-de-small-aligned/model.pt is in refdec's repository",
        ),
        (["train", "--preset", "tiny", "--out-dir", "{tmp}/run"], "data is in refdec's repository"),
        (["train", "--preset", "mt-en-de-distilled", "--out-dir", "{tmp}/run"], "is in refdec's repository"),
    ],
)
def test_an_installed_copy_names_the_flag_for_a_default_it_lacks(tmp_path, capsys, monkeypatch, argv, needle):
    """Case: `refdec decode --task mt-en-de` from `pip install .` said "no checkpoint at
    site-packages/checkpoints/mt-en-de/model.pt", and `refdec train` "no folder site-packages/data/...":
    a default that is the repository's is one line saying so and naming the flag that gives it."""
    from refdec import repo

    ckpt = random_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.txt").write_text("the cat\n", encoding="utf-8")
    monkeypatch.setattr(repo, "REPO", tmp_path / "site-packages")  # a copy without data/build.py beside it
    argv = [a.format(ckpt=ckpt, input=tmp_path / "in.txt", tmp=tmp_path) for a in argv]
    assert main([*argv, "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "pip install -e ." in err, err
    assert ("give --" in err) and not (tmp_path / "run").exists(), err


def test_a_checkpoint_without_task_asks_for_the_companion_model(tmp_path, capsys):
    """`--model CKPT --input FILE --algo bild` without --task: no shipped small model to default to,
    said in one line naming the flag (not a transformers folder's wording)."""
    ckpt = random_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.txt").write_text("the cat\n", encoding="utf-8")
    assert main(["decode", "--algo", "bild", "--model", str(ckpt), "--input", str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --algo bild needs a small model") and len(err.splitlines()) == 1, err
    assert err.endswith("and without --task there is no shipped one to take: pass --small PATH"), err
