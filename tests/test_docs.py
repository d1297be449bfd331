"""The README and docs/ against the code they describe: the words decode.py prints, the commands
the repository has, the files the quick start writes. Reads text only; a fraction of a second."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO

PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "hf.md")]


def text(path) -> str:
    return path.read_text(encoding="utf-8")


def test_every_command_is_in_the_readme_layout():
    """Case: `python -m refdec.fuzz` was missing from the README's layout. Every command `refdec --help`
    lists is named there, beside both ways to run it."""
    from refdec.commands import COMMANDS

    layout = text(REPO / "README.md").split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert "refdec <command>" in layout and "python -m refdec <command>" in layout
    for name in COMMANDS:
        assert re.search(rf"(?<![\w-]){name}(?![\w-])", layout.split("refdec/commands/", 1)[1]), name


def test_no_page_or_help_text_names_a_command_module_that_is_gone():
    """Case: the commands were `python -m refdec.<name>` modules beside the library; they are
    `python -m refdec <name>` (or `refdec <name>`) now, and no page, help text or message names the
    old form, which ends in "No module named refdec.stepcost"."""
    pages = [
        REPO / "README.md",
        REPO / "checkpoints" / "README.md",
        REPO / "data" / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "refdec").rglob("*.py"),
        REPO / "decode.py",
        REPO / "train.py",
    ]
    old = [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in pages
        for m in re.finditer(r"-m\s+refdec\.(?!commands\b)\w+", text(p))
    ]
    assert not old, old


def test_the_docs_speak_the_speed_column_decode_py_prints():
    """Case: the docs read "speedup = row seconds / first row's" and "time vs greedy 1.64x" where
    decode.py prints "speed vs greedy: 1.64x slower"."""
    from refdec.app.report import relative_speed

    assert relative_speed(1 / 1.64) == "1.64x slower" and relative_speed(1.5) == "1.50x faster"
    for page in PAGES:
        body = text(page)
        for old in ("speedup = ", "time vs greedy", "speedup over large greedy", "one-minute demo"):
            assert old not in body, f"{page.name}: {old!r}"
        assert not re.search(r"\bcommit [0-9a-f]{7,40}\b", body), page.name  # development history


def test_the_quick_starts_outputs_are_ignored_by_git():
    """Case: `r.html` from the quick start showed up as an untracked file while `r.json` did not."""
    readme = text(REPO / "README.md")
    written = set(re.findall(r"^    .*?--(?:report|html) ([\w.]+)", readme.split("## Algorithm map")[0], re.M))
    assert {"r.json", "r.html"} <= written
    r = subprocess.run(["git", "check-ignore", *sorted(written)], cwd=REPO, capture_output=True, text=True)
    if r.returncode == 128:  # not a git checkout (an unpacked archive): read the file instead
        ignored = set(text(REPO / ".gitignore").split())
        assert written <= ignored
    else:
        assert set(r.stdout.split()) == written


def test_the_quick_start_names_the_model_it_decodes_with():
    """Case: the quick start never said which model it decodes with. It names the task's default
    checkpoint, the one decode.py loads for its command, and that model's shape."""
    from refdec.app.algorithms import ALGORITHMS

    quick = text(REPO / "README.md").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"^    python decode\.py --algo (\w+) --task ([\w-]+)", quick, re.M)
    algo, task = command.groups()
    name = ALGORITHMS[algo].checkpoint_dir(task)
    assert f"`checkpoints/{name}/model.pt`" in quick.split(command.group(0))[0]
    from refdec.checkpoint import load_checkpoint, model_shape

    cfg = model_shape(load_checkpoint(REPO / "checkpoints" / name / "model.pt"))
    assert f"{cfg.enc_layers} encoder layers and {cfg.dec_layers} decoder layers" in quick
