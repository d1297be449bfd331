"""No command writes into the repository's shipped checkpoints/ or data/ unless told to.

Case: `python decode.py --task gec-en --algo iad --limit 2 --output checkpoints/gec-en-6x6/model.pt`
replaced the 15.6 MB shipped checkpoint with two lines of text and exited 0, and `--output
data/gec-uk/test.src.gz` overwrote a shipped test set: the outputs were checked against the files
the run reads, and gec-en's default model is the 9x3 one. Now every output option of every command
goes through refdec.repo.check_not_shipped (from refdec.app.inputs.check_outputs): one line, exit 2,
nothing changed. The tests run each command's main(argv) in-process (a fraction of a second each),
with outputs on files and folders the run does not read; the slow ones run the scripts."""

from __future__ import annotations

import importlib
import re

import pytest
from conftest import REPO, error_of, run_py

from refdec.commands import COMMANDS
from refdec.errors import UsageError
from refdec.repo import check_not_shipped

GEC_IAD = ["--task", "gec-en", "--algo", "iad", "--limit", "2"]
CT2 = ["--task", "gec-en", "--model", "checkpoints/gec-en-9x3/model.pt"]
DISTILL = ["--task", "mt-en-de", "--threads", "1"]
BENCH = ["--device", "cpu", "--threads", "1"]

# (command, argv, the shipped folder named): every output option of every command, each into
# checkpoints/ or data/, on files and folders the run does not read.
CASES = [
    ("decode", GEC_IAD + ["--output", "checkpoints/gec-en-6x6/model.pt"], "checkpoints"),
    ("decode", GEC_IAD + ["--output", "data/gec-uk/test.src.gz"], "data"),
    ("decode", GEC_IAD + ["--report", "checkpoints/gec-uk-6x6/log.jsonl"], "checkpoints"),
    ("decode", GEC_IAD + ["--html", "data/gec-uk/page.html"], "data"),
    ("train", ["--preset", "tiny", "--out-dir", "data/gec-en"], "data"),
    ("ctranslate2", CT2 + ["--report", "checkpoints/gec-en-6x6/model.pt"], "checkpoints"),
    ("ctranslate2", CT2 + ["--cache-dir", "data/ctranslate2"], "data"),
    ("stepcost", ["--threads", "1", "--report", "checkpoints/gec-en-6x6/model.pt"], "checkpoints"),
    ("ceiling", ["--threads", "1", "--report", "data/gec-uk/test.src.gz"], "data"),
    ("distill", DISTILL + ["--out", "data/distilled/mt-en-de-greedy"], "data"),
    ("distill", DISTILL + ["--out", "checkpoints/gec-en-6x6"], "checkpoints"),
    ("int8bench", CT2 + ["--report", "checkpoints/gec-en-6x6/model.pt"], "checkpoints"),
    ("bench", BENCH + ["--out", "checkpoints/bench"], "checkpoints"),
    ("bench", BENCH + ["--out", "data"], "data"),
    ("train_drafters", ["--out-dir", "checkpoints/drafters"], "checkpoints"),
    ("train_drafters", ["--out-dir", "data/drafters"], "data"),
    (
        "hfcli",
        [
            "audit",
            "--task",
            "gec-en",
            "--model",
            "checkpoints/gec-en-9x3/model.pt",
            "--report",
            "data/gec-uk/test.tgt.gz",
        ],
        "data",
    ),
    ("hfcli", ["export", "checkpoints/gec-en-9x3/model.pt", "checkpoints/gec-en-9x3-transformers"], "checkpoints"),
    ("hfcli", ["export", "checkpoints/gec-en-9x3/model.pt", "data/gec-en-9x3-transformers"], "data"),
    ("hfcli", ["import", "reports", "--out", "checkpoints/imported"], "checkpoints"),
    ("hfcli", ["import", "reports", "--out", "data/imported"], "data"),
]
# The commands whose --overwrite lets an output lie inside a shipped folder (train.py's rule).
OPT_IN = {"train", "distill", "train_drafters"}


def output_flag(argv: list[str]) -> str:
    """The option a case's last argument is given to (refdec.hf export's second argument: OUT_DIR)."""
    return argv[-2] if argv[-2].startswith("--") else "OUT_DIR"


def command(name: str):
    """A command's main(argv): refdec.commands.NAME's (decode.py's and train.py's among them)."""
    return importlib.import_module(f"refdec.commands.{name}").main


def shipped_state() -> dict[str, tuple[int, int]]:
    """Every file and folder under checkpoints/ and data/ with its size and modification time: a file
    written, replaced, created or created and removed again changes it."""
    return {
        str(p.relative_to(REPO)): (p.stat().st_size, p.stat().st_mtime_ns)
        for folder in ("checkpoints", "data")
        for p in [REPO / folder, *(REPO / folder).rglob("*")]
        if "__pycache__" not in p.parts and ".cache" not in p.parts
    }


@pytest.fixture
def unchanged():
    """Asserts that the test leaves checkpoints/ and data/ as it found them."""
    before = shipped_state()
    yield
    assert shipped_state() == before


@pytest.mark.parametrize("name,argv,folder", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_no_output_goes_into_a_shipped_folder(name, argv, folder, capsys, monkeypatch, unchanged):
    """One line naming the flag, the path and the folder, exit 2; the opt-in named where the command
    has one, and nothing written."""
    err = error_of(command(name), argv, capsys, monkeypatch)
    assert err.startswith(f"error: {output_flag(argv)} {argv[-1]} is ") and f"{folder}/" in err, err
    assert "give another path" in err or "give a folder of the run's own" in err, err
    assert ("or add --overwrite to write there" in err) == (name in OPT_IN and argv[-1] != folder), err


def test_every_output_option_of_every_command_is_covered(capsys):
    """Guards a command (or an option) added later without the check: every option that names a
    file or folder to write, in every command's --help, has a case above."""
    helps = [
        ("decode", []),
        ("train", []),
        ("hfcli", ["export"]),
        ("hfcli", ["audit"]),
        ("hfcli", ["import"]),
        *(
            (name, [])
            for name in (
                "bench",
                "ceiling",
                "ctranslate2",
                "distill",
                "fuzz",
                "int8bench",
                "stepcost",
                "train_drafters",
            )
        ),
    ]
    found = set()
    for name, sub in helps:
        with pytest.raises(SystemExit):
            command(name)([*sub, "--help"])
        text = capsys.readouterr().out
        options = re.findall(r"--(?:output|report|html|out-dir|out|cache-dir)(?![\w-])|(?<!-dir )OUT_DIR", text)
        found |= {(name, option) for option in options}
    assert found == {(name, output_flag(argv)) for name, argv, _ in CASES}
    assert not any(name == "fuzz" for name, _ in found)  # it prints and writes nothing


@pytest.mark.parametrize(
    "spelled",
    [
        "./data/../checkpoints/gec-en-6x6/model.pt",
        str(REPO / "checkpoints" / "gec-en-6x6" / "model.pt"),
        "checkpoints//gec-en-6x6/./new.txt",
        "data/gec-uk/../../data/gec-uk/test.src.gz",
    ],
)
def test_every_spelling_of_a_shipped_path_is_caught(spelled, capsys, monkeypatch, unchanged):
    err = error_of(command("decode"), GEC_IAD + ["--output", spelled], capsys, monkeypatch)
    assert err.startswith(f"error: --output {spelled} is inside "), err


def test_a_symbolic_link_or_another_folder_does_not_hide_a_shipped_folder(tmp_path, monkeypatch):
    """The path is resolved: through a link into data/, and relative to the current folder."""
    (tmp_path / "link").symlink_to(REPO / "data")
    with pytest.raises(UsageError, match=r"is inside data/, the folder of the shipped data sets: give another path$"):
        check_not_shipped("--output", tmp_path / "link" / "gec-uk" / "test.src.gz")
    monkeypatch.chdir(REPO / "docs")
    with pytest.raises(UsageError, match=r"^--report \.\./checkpoints/x\.json is inside checkpoints/"):
        check_not_shipped("--report", "../checkpoints/x.json")
    check_not_shipped("--report", "checkpoints/x.json")  # docs/checkpoints/: not the shipped folder
    check_not_shipped("--report", REPO / "reports" / "x.json")  # the repository's reports/: allowed


def test_the_opt_in_allows_a_folder_inside_never_the_folder_itself():
    """train.py's rule for every command that has an opt-in: checkpoints/<name> or data/<name> only
    when told, checkpoints/ and data/ themselves never."""
    for folder, what in (("checkpoints", "shipped models"), ("data", "shipped data sets")):
        inside = REPO / folder / "new-name"
        with pytest.raises(UsageError, match=f"inside {folder}/.*or add --overwrite to write there"):
            check_not_shipped("--out", inside, ("--overwrite", False))
        check_not_shipped("--out", inside, ("--overwrite", True))
        for opted_in in (False, True):
            with pytest.raises(UsageError, match=f"is the folder of the {what} itself \\({folder}/\\)"):
                check_not_shipped("--out", REPO / folder / "x" / "..", ("--overwrite", opted_in))


def test_distill_writes_into_data_with_overwrite_alone(tmp_path):
    """The documented `python -m refdec distill ... --out data/distilled/<name> --overwrite` passes
    the check (the presets read their distilled folders there); without --overwrite it is one line."""
    from refdec.commands.distill import check_paths

    teacher = REPO / "checkpoints" / "mt-en-de" / "model.pt"

    def check(out, **flags):  # the task's folder under --out, as distill() writes it
        check_paths("mt-en-de", teacher, out / "mt-en-de", REPO / "data", None, None, **flags)

    with pytest.raises(UsageError, match=r"^--out .*data/distilled/new is inside data/.*or add --overwrite"):
        check(REPO / "data" / "distilled" / "new")
    check(REPO / "data" / "distilled" / "new", overwrite=True)
    check(tmp_path)  # outside the shipped folders: no flag needed


def test_train_py_refuses_data_as_it_refuses_checkpoints():
    """Was: `train.py --out-dir data/gec-en` wrote a run among the shipped data sets; checkpoints/ alone
    was refused."""
    from refdec.commands.train import check_out_dir_place as check

    with pytest.raises(UsageError, match="inside data/.*runs/<name>.*--overwrite"):
        check(str(REPO / "data" / "gec-en"), overwrite=False, resume=False)
    with pytest.raises(UsageError, match="shipped data sets itself"):
        check(str(REPO / "data"), overwrite=True, resume=False)


def test_int8bench_writes_its_report_elsewhere(tmp_path, capsys, monkeypatch):
    """Was: any --report made int8bench fail with a TypeError (exit 1), before the check it now shares."""
    monkeypatch.chdir(REPO)
    report = tmp_path / "int8.json"
    code = command("int8bench")(CT2 + ["--rows", "1", "--rounds", "1", "--reps", "1", "--report", str(report)])
    assert code == 0 and report.is_file(), capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["decode.py", *GEC_IAD, "--output", "checkpoints/gec-en-6x6/model.pt"],
        ["decode.py", *GEC_IAD, "--output", "data/gec-uk/test.src.gz"],
        *(
            ["-m", "refdec", typed, *argv]
            for name, argv, _ in CASES
            if name not in ("decode", "train")
            for typed in [next(t for t, (module, _) in COMMANDS.items() if module == name)]
        ),
        ["train.py", "--preset", "tiny", "--out-dir", "data/gec-en"],
    ],
    ids=lambda argv: " ".join(argv[:3]),
)
def test_the_commands_as_typed_exit_2_and_change_nothing(argv, unchanged):
    """The case's commands and every `python -m refdec X` command, run as a user types them."""
    r = run_py(*argv, timeout=120)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (r.returncode, err)
    assert "is inside" in err or "itself" in err, err


@pytest.mark.slow
def test_a_training_run_writes_its_token_cache_outside_data(tmp_path, unchanged):
    """Case: `train.py --preset tiny` wrote a 25.8 MB .train-ids-*.pt (a git-ignored cache of the training
    set's token ids) into data/mt-en-de/. A whole training set's ids (no --train-limit) now go to refdec's
    cache folder, and data/ and checkpoints/ stay as they were, ignored files counted (`unchanged`)."""
    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--max-steps",
        "1",
        "--eval-every",
        "1",
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path / "run"),
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert [p.name.split("-")[:3] for p in (tmp_path / "cache" / "refdec" / "train-ids").iterdir()] == [
        ["mt", "en", "de"]
    ]
    assert "cached in" in r.stderr.decode()
