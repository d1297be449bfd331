"""Errors that say which flag was wrong and what to do instead, run in-process through the scripts'
main(argv) so that they take a fraction of a second each. Each test names the message it replaced."""

from __future__ import annotations

import importlib
import re
import shutil

import pytest
from conftest import REPO, error_of


@pytest.fixture(scope="module")
def decode():
    return importlib.import_module("refdec.commands.decode")


@pytest.fixture(scope="module")
def train():
    return importlib.import_module("refdec.commands.train")


def sections(page: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", (REPO / page).read_text(encoding="utf-8"), re.M)}


def test_a_missing_default_checkpoint_points_at_a_section_that_exists(decode, capsys, monkeypatch):
    """Was: "train one (README, 'Training')", a section the README does not have."""
    err = error_of(decode.main, ["--algo", "gad", "--task", "gec-uk", "--limit", "1"], capsys, monkeypatch)
    assert err.startswith(
        "error: --algo gad --task gec-uk: no drafter checkpoint at checkpoints/gec-uk-drafter/model.pt"
    )
    assert "pass --drafter PATH" in err and "--preset mt-en-de-drafter" in err
    page, section = re.search(r"\((\S+\.md), section (\w+)\)", err).groups()
    assert section in sections(page)
    assert "README" not in err


def test_every_pointer_into_the_docs_in_the_code_names_a_real_section():
    """Guards the same mistake anywhere else: a message citing "(PAGE, section NAME)" or "(PAGE,
    'NAME')" for a section PAGE does not have."""
    found = 0
    for path in [REPO / "decode.py", REPO / "train.py", *sorted((REPO / "refdec").rglob("*.py"))]:
        text = path.read_text(encoding="utf-8")
        for page, name in re.findall(r"\(([\w/.-]+\.md), (?:section )?'?([\w ]+?)'?\)", text):
            found += 1
            assert name in sections(page), f"{path.name} cites {page} section {name!r}"
    assert found >= 2


@pytest.mark.parametrize("flag", ["--model", "--compare greedy@"])
def test_a_checkpoint_folder_points_at_the_model_pt_in_it(decode, capsys, monkeypatch, flag):
    """Was: "checkpoints/mt-en-de has no config.json (not a transformers model folder)"."""
    argv = ["--algo", "greedy", "--task", "mt-en-de", "--limit", "1"]
    argv += ["--model", "checkpoints/mt-en-de"] if flag == "--model" else ["--compare", "greedy@checkpoints/mt-en-de"]
    err = error_of(decode.main, argv, capsys, monkeypatch)
    given = "--model " if flag == "--model" else "--compare greedy@"
    assert err == (
        f"error: {given}checkpoints/mt-en-de is a folder: give the checkpoint in it, "
        f"{given}checkpoints/mt-en-de/model.pt"
    )


def test_a_missing_checkpoint_names_its_flag(decode, capsys, monkeypatch):
    err = error_of(decode.main, ["--algo", "bild", "--task", "mt-en-de", "--small", "nowhere.pt"], capsys, monkeypatch)
    assert err == "error: --small nowhere.pt: no such file or folder"


@pytest.mark.parametrize(
    "flag,value,bound", [("--max-len", "0", 1), ("--batch-size", "0", 1), ("--limit", "-1", 0), ("--warmup", "-2", 0)]
)
def test_a_bad_count_names_the_flag_given_and_no_other(decode, capsys, monkeypatch, flag, value, bound):
    """Was: `--max-len 0` said "--batch-size and --max-len must be at least 1", naming a flag not given."""
    err = error_of(decode.main, ["--algo", "greedy", "--task", "mt-en-de", flag, value], capsys, monkeypatch)
    assert err == f"error: {flag} {value}: must be at least {bound}"


def test_a_data_dir_that_does_not_exist_is_called_a_typo(train, capsys, monkeypatch, tmp_path):
    """Was: `train.py --data-dir nodir` suggested building a distilled folder with refdec.commands.distill."""
    err = error_of(
        train.main, ["--preset", "tiny", "--data-dir", "nodir", "--out-dir", str(tmp_path / "run")], capsys, monkeypatch
    )
    assert err == "error: --data-dir nodir: no such folder; check the path"
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_folder_given_to_train_points_at_the_model_pt(train, capsys, monkeypatch, tmp_path):
    err = error_of(
        train.main,
        ["--preset", "tiny", "--init-from", "checkpoints/mt-en-de", "--out-dir", str(tmp_path / "run")],
        capsys,
        monkeypatch,
    )
    assert err == (
        "error: --init-from checkpoints/mt-en-de is a folder: give the checkpoint in it, "
        "--init-from checkpoints/mt-en-de/model.pt"
    )


def test_every_command_loading_a_checkpoint_points_a_folder_at_its_model_pt(tmp_path, monkeypatch):
    """Was: `python -m refdec distill --model checkpoints/mt-en-de` (and stepcost, ceiling) said
    "checkpoint checkpoints/mt-en-de not found" of a folder that exists."""
    from refdec.checkpoint import CheckpointError, load_checkpoint

    monkeypatch.chdir(REPO)
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoints/mt-en-de is a folder: give the checkpoint in it, "
        r"checkpoints/mt-en-de/model\.pt$",
    ):
        load_checkpoint("checkpoints/mt-en-de")
    with pytest.raises(CheckpointError, match="is a folder with no model.pt in it"):
        load_checkpoint(tmp_path)


# -- no run writes a file it reads -------------------------------------------------------------


def command(name: str):
    """A command's main(argv): one of refdec.commands (`python -m refdec NAME`)."""
    return importlib.import_module(f"refdec.commands.{name}").main


GEC = ["--algo", "greedy", "--task", "gec-en", "--limit", "2"]


@pytest.mark.parametrize(
    "name,argv,needle",
    [
        ("decode", GEC + ["--report", "data/gec-en/test.src.gz"], "lies in the data folder of --task gec-en"),
        ("decode", GEC + ["--output", "data/gec-en/test.tgt.gz"], "lies in the data folder of --task gec-en"),
        ("decode", GEC + ["--html", "checkpoints/gec-en-9x3/model.pt"], "is also the model of greedy"),
        ("decode", GEC + ["--report", "checkpoints/gec-en-9x3/tokenizer.json"], "is also the tokenizer beside"),
        (
            "decode",
            ["--algo", "gad", "--task", "mt-en-de", "--report", "checkpoints/mt-en-de-drafter/model.pt"],
            "is also the drafter (--drafter)",
        ),
        (
            "ctranslate2",
            ["--task", "gec-en", "--model", "checkpoints/gec-en-9x3/model.pt", "--report", "data/gec-en/test.src.gz"],
            "lies in the data folder of --task gec-en",
        ),
        (
            "hfcli",
            [
                "audit",
                "--task",
                "gec-en",
                "--model",
                "checkpoints/gec-en-9x3/model.pt",
                "--report",
                "data/gec-en/test.src.gz",
            ],
            "lies in the data folder of --task gec-en",
        ),
        ("stepcost", ["--report", "checkpoints/mt-en-de/model.pt"], "is also the model"),
        ("ceiling", ["--task", "mt-en-de", "--report", "data/mt-en-de/test.tgt.gz"], "lies in the data folder"),
        (
            "distill",
            ["--task", "mt-en-de", "--threads", "1", "--out", "data"],
            "--out data/mt-en-de/train.src.gz lies in",
        ),
    ],
)
def test_no_command_writes_a_file_it_reads(capsys, monkeypatch, name, argv, needle):
    """Was: `decode.py --task gec-en --report data/gec-en/test.src.gz` (and --output, refdec.commands.ctranslate2's and
    refdec.hf audit's --report) replaced the shipped test set with JSON: outputs were checked against
    --input alone, not the task's default files or the checkpoints. Every command now checks each output
    against everything it reads, in refdec.app.inputs.check_outputs, and refuses in one line; nothing changes."""
    written = REPO / argv[argv.index(next(a for a in argv if a in ("--report", "--output", "--html", "--out"))) + 1]
    before = {p: p.stat().st_mtime_ns for p in ([written] if written.is_file() else written.rglob("*.gz"))}
    err = error_of(command(name), argv, capsys, monkeypatch)
    assert needle in err and "which this run reads" in err, err
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())


def test_audit_refuses_a_report_over_its_input(capsys, monkeypatch, tmp_path):
    """Was: `python -m refdec hf audit --input s.txt --report s.txt` overwrote its input with the report."""
    from refdec.commands.hfcli import main

    src = tmp_path / "s.txt"
    src.write_text("She go to school.\n", encoding="utf-8")
    err = error_of(
        main,
        [
            "audit",
            "--task",
            "gec-en",
            "--model",
            "checkpoints/gec-en-9x3/model.pt",
            "--input",
            str(src),
            "--report",
            str(src),
        ],
        capsys,
        monkeypatch,
    )
    assert (
        err == f"error: --report {src} is also the input, which this run reads: it would be overwritten; "
        "give another path"
    )
    assert src.read_text(encoding="utf-8") == "She go to school.\n"


def test_one_file_under_two_names_is_caught(decode, capsys, monkeypatch, tmp_path):
    """A hard link (or any second name) of the input is the input: os.path.samefile, not the path's text."""
    src = tmp_path / "in.txt"
    src.write_text("Hello.\n", encoding="utf-8")
    (tmp_path / "link.txt").hardlink_to(src)
    err = error_of(
        decode.main,
        ["--algo", "greedy", "--task", "mt-en-de", "--input", str(src), "--report", str(tmp_path / "link.txt")],
        capsys,
        monkeypatch,
    )
    assert "is also the input" in err


def test_distill_refuses_to_write_the_folder_it_adds(capsys, monkeypatch, tmp_path):
    """--add X --out X would overwrite the training pairs it reads, as --out data overwrites the shipped ones."""
    from refdec.commands.distill import main

    (tmp_path / "x" / "mt-en-de").mkdir(parents=True)
    (tmp_path / "x" / "mt-en-de" / "train.src.gz").write_bytes(b"")
    err = error_of(
        main,
        ["--task", "mt-en-de", "--threads", "1", "--out", str(tmp_path / "x"), "--add", str(tmp_path / "x")],
        capsys,
        monkeypatch,
    )
    assert "lies in the training data of --add" in err


def test_hf_export_into_a_file_is_one_line(capsys, monkeypatch, tmp_path):
    """Was: `python -m refdec hf export ckpt.pt ckpt.pt` exited 1 with NotADirectoryError."""
    from refdec.commands.hfcli import main

    err = error_of(
        main, ["export", "checkpoints/mt-en-de/model.pt", "checkpoints/mt-en-de/model.pt"], capsys, monkeypatch
    )
    assert (
        err == "error: OUT_DIR checkpoints/mt-en-de/model.pt is a file: give the folder to write (a new or empty one)"
    )


def test_a_corrupt_data_file_is_named(decode, capsys, monkeypatch, tmp_path):
    """Was: after the test set was overwritten, every run failed with `BadGzipFile: Not a gzipped file
    (b'{\\n')`, naming no file. Now the one line names it and how to restore it."""
    from refdec import data

    shutil.copytree(REPO / "data" / "gec-en", tmp_path / "gec-en", ignore=shutil.ignore_patterns("train.*"))
    (tmp_path / "gec-en" / "test.src.gz").write_bytes(b"{\n")
    monkeypatch.setattr(data, "DATA_DIR", tmp_path)
    err = error_of(decode.main, GEC, capsys, monkeypatch)
    assert err.startswith(f"error: {tmp_path / 'gec-en' / 'test.src.gz'} is not a valid gzip file"), err


@pytest.mark.parametrize(
    "name,argv",
    [
        ("decode", ["--algo", "greedy", "--task", "gec-en", "--device", "tpu"]),
        ("distill", ["--task", "mt-en-de", "--out", "nowhere", "--device", "tpu"]),
    ],
)
def test_an_unknown_device_is_one_line(capsys, monkeypatch, name, argv):
    """Was: `decode.py --device tpu` exited 1 with torch's RuntimeError listing 20 device types."""
    err = error_of(command(name), argv, capsys, monkeypatch)
    assert err == "error: --device tpu: refdec runs on cpu or cuda (cuda:N for one GPU of several)"


@pytest.mark.parametrize("cut", ["10kB", "half"])
def test_a_truncated_checkpoint_is_said_to_be_truncated_with_its_size(cut, decode, tmp_path, capsys, monkeypatch):
    """Was: a model.pt cut to 10,000 bytes gave `cannot load checkpoint trunc/model.pt: OSError: [Errno 22]
    Invalid argument`, and one cut to half its size torch's message clipped before its key word. Now one
    line says the file is truncated or not a checkpoint, with its size (exit 2)."""
    from conftest import random_checkpoint

    whole = random_checkpoint(tmp_path / "whole").read_bytes()
    size = 10_000 if cut == "10kB" else len(whole) // 2
    assert len(whole) > 2 * 10_000
    (tmp_path / "trunc").mkdir()
    shutil.copy(tmp_path / "whole" / "tokenizer.json", tmp_path / "trunc")
    (tmp_path / "trunc" / "model.pt").write_bytes(whole[:size])
    err = error_of(
        decode.main,
        ["--task", "mt-en-de", "--algo", "greedy", "--limit", "1", "--model", str(tmp_path / "trunc" / "model.pt")],
        capsys,
        monkeypatch,
    )
    assert f"model.pt is truncated or not a checkpoint ({size:,} bytes" in err, err
