"""Errors that say which flag was wrong and what to do instead, run in-process through the scripts'
main(argv) so that they take a fraction of a second each. Each test names the message it replaced."""

from __future__ import annotations

import importlib.util
import re

import pytest

from conftest import REPO


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"refdec_script_{name}", REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def decode():
    return script("decode")


@pytest.fixture(scope="module")
def train():
    return script("train")


def error_of(main, argv: list[str], capsys, monkeypatch) -> str:
    """The one line main(argv) prints on stderr, checked to be an error with exit status 2."""
    monkeypatch.chdir(REPO)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
    return err


def sections(page: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", (REPO / page).read_text(encoding="utf-8"), re.M)}


def test_a_missing_default_checkpoint_points_at_a_section_that_exists(decode, capsys, monkeypatch):
    """Was: "train one (README, 'Training')", a section the README does not have."""
    err = error_of(decode.main, ["--algo", "gad", "--task", "gec-uk", "--limit", "1"], capsys, monkeypatch)
    assert err.startswith("error: --algo gad --task gec-uk: no drafter checkpoint at checkpoints/gec-uk-drafter/model.pt")
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
    argv += (["--model", "checkpoints/mt-en-de"] if flag == "--model" else ["--compare", "greedy@checkpoints/mt-en-de"])
    err = error_of(decode.main, argv, capsys, monkeypatch)
    given = "--model " if flag == "--model" else "--compare greedy@"
    assert err == (f"error: {given}checkpoints/mt-en-de is a folder: give the checkpoint in it, "
                   f"{given}checkpoints/mt-en-de/model.pt")


def test_a_missing_checkpoint_names_its_flag(decode, capsys, monkeypatch):
    err = error_of(decode.main, ["--algo", "bild", "--task", "mt-en-de", "--small", "nowhere.pt"], capsys, monkeypatch)
    assert err == "error: --small nowhere.pt: no such file or folder"


@pytest.mark.parametrize("flag,value,bound", [("--max-len", "0", 1), ("--batch-size", "0", 1), ("--limit", "-1", 0),
                                              ("--warmup", "-2", 0)])
def test_a_bad_count_names_the_flag_given_and_no_other(decode, capsys, monkeypatch, flag, value, bound):
    """Was: `--max-len 0` said "--batch-size and --max-len must be at least 1", naming a flag not given."""
    err = error_of(decode.main, ["--algo", "greedy", "--task", "mt-en-de", flag, value], capsys, monkeypatch)
    assert err == f"error: {flag} {value}: must be at least {bound}"


def test_a_data_dir_that_does_not_exist_is_called_a_typo(train, capsys, monkeypatch, tmp_path):
    """Was: `train.py --data-dir nodir` suggested building a distilled folder with refdec.distill."""
    err = error_of(train.main, ["--preset", "tiny", "--data-dir", "nodir", "--out-dir", str(tmp_path / "run")],
                   capsys, monkeypatch)
    assert err == "error: --data-dir nodir: no such folder; check the path"
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_folder_given_to_train_points_at_the_model_pt(train, capsys, monkeypatch, tmp_path):
    err = error_of(train.main, ["--preset", "tiny", "--init-from", "checkpoints/mt-en-de", "--out-dir",
                                str(tmp_path / "run")], capsys, monkeypatch)
    assert err == ("error: --init-from checkpoints/mt-en-de is a folder: give the checkpoint in it, "
                   "--init-from checkpoints/mt-en-de/model.pt")


def test_every_command_loading_a_checkpoint_points_a_folder_at_its_model_pt(tmp_path, monkeypatch):
    """Was: `python -m refdec.distill --model checkpoints/mt-en-de` (and stepcost, ceiling) said
    "checkpoint checkpoints/mt-en-de not found" of a folder that exists."""
    from refdec.checkpoint import CheckpointError, load_checkpoint
    monkeypatch.chdir(REPO)
    with pytest.raises(CheckpointError, match=r"^checkpoints/mt-en-de is a folder: give the checkpoint in it, "
                                              r"checkpoints/mt-en-de/model\.pt$"):
        load_checkpoint("checkpoints/mt-en-de")
    with pytest.raises(CheckpointError, match="is a folder with no model.pt in it"):
        load_checkpoint(tmp_path)
