"""The exercise of docs/algorithms.md ("An exercise: break the verification rule") as the page gives it:
each one-line change made to a copy of refdec/ (the repository's own files are never changed), each command
the page gives run with that copy first on PYTHONPATH, and the output the page quotes found in what pytest
printed: the first divergence line (the AssertionError) and the final failed/passed tally, exactly.

The figures come from the shipped copying model (tests/data/copy_model.pt, written by
tests/data/make_copy_model.py): its weights do not depend on the CPU, so every machine prints them. The
fast test checks that the page quotes only what is checked here; the slow one runs the five commands
(about half a minute on one core).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

PAGE = REPO / "docs" / "algorithms.md"
SECTION = "## An exercise: break the verification rule"
BOTH_FILES = 'python -m pytest -q --tb=no -m "not slow" tests/test_iad.py tests/test_mutations.py'


@dataclass(frozen=True)
class Change:
    path: str  # the file of refdec/ changed
    line: str  # the piece of one line the page changes, as it is ...
    changed: str  # ... and as changed
    runs: tuple[tuple[str, tuple[str, ...], str | None], ...]  # each command, lines it prints, its final tally


CHANGES = [
    Change(  # 1. the off-by-one
        "refdec/decoding/verify.py",
        "passed = [d == p for d, p in zip(draft, argmax)]",
        "passed = [d == p for d, p in zip(draft, argmax[1:])]",
        (
            (
                "python -m pytest -x -q --tb=short tests/test_iad.py -k equals_greedy",
                (
                    "AssertionError: iad {'match': 'unique', 'max_draft': 0, 'max_suffix': 0} against greedy, row 0: "
                    "first divergence at position 11: expected [12], got [] (expected 12 tokens, got 11); "
                    "top-1/top-2 logit margin 0.22",
                ),
                "1 failed, 4 passed, 33 deselected",
            ),
            (BOTH_FILES, (), "51 failed, 200 passed"),
        ),
    ),
    Change(  # 2. accept everything
        "refdec/decoding/verify.py",
        "n = next((i for i, good in enumerate(passed) if not good), len(passed))",
        "n = len(passed)",
        (
            (
                "python -m pytest -x -q --tb=short tests/test_iad.py -k equals_greedy",
                (
                    "AssertionError: iad {'match': 'unique', 'max_draft': 0, 'max_suffix': 0} against greedy, row 0: "
                    "first divergence at position 1: expected [6, 11, 13], got [5, 11, 13] "
                    "(expected 8 tokens, got 9); top-1/top-2 logit margin 7.17",
                ),
                None,  # it stops at the first test: the page quotes no tally
            ),
            (BOTH_FILES, (), "222 failed, 29 passed"),
        ),
    ),
    Change(  # 3. proposal heads on the wrong state
        "refdec/decoding/blockwise.py",
        "states = torch.stack([v.hidden[v.accepted] for v in verified])",
        "states = torch.stack([v.hidden[0] for v in verified])",
        (
            (
                "python -m pytest -q --tb=short tests/test_blockwise.py tests/test_mutations.py -k blockwise",
                ("assert (6 == 5)",),
                "2 failed, 90 passed, 12 deselected",
            ),
        ),
    ),
]

TALLY = re.compile(r"\d+ (?:failed|passed|deselected)(?:, \d+ (?:failed|passed|deselected))*")


def section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else len(text)]


def test_the_page_quotes_only_what_is_checked():
    """Each change, command, printed line and tally of CHANGES is on the page, and every AssertionError
    line, tally and `assert` the section quotes is one of them; each changed line is in its file once."""
    text = section()
    spans = re.findall(r"`([^`\n]+)`", text)
    for c in CHANGES:
        assert (REPO / c.path).read_text(encoding="utf-8").count(c.line) == 1, (c.path, c.line)
        assert c.changed in spans, c.changed
        for command, printed, tally in c.runs:
            assert command in text, command
            assert all(p in text for p in printed), printed
            assert tally is None or f"`{tally}`" in text, tally
    checked_lines = {p for c in CHANGES for _, printed, _ in c.runs for p in printed}
    checked_tallies = {t for c in CHANGES for _, _, t in c.runs if t}
    quoted_lines = {line.strip() for line in text.splitlines() if line.strip().startswith("AssertionError")}
    quoted_lines |= {s for s in spans if s.startswith("assert ")}
    assert quoted_lines <= checked_lines, quoted_lines - checked_lines
    quoted_tallies = {s for s in spans if TALLY.fullmatch(s)}
    assert quoted_tallies and quoted_tallies <= checked_tallies, quoted_tallies - checked_tallies
    assert not re.search(r"margin \d", re.sub(r"AssertionError.*", "", text)), "a margin quoted outside an output"


def run_in(root: Path, command: str) -> str:
    args = shlex.split(command)
    assert args[0] == "python"
    r = subprocess.run(
        [sys.executable, *args[1:]],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
    )
    return r.stdout + r.stderr


def final_tally(output: str) -> str:
    """pytest's last line, `51 failed, 200 passed in 3.48s`, without its time."""
    last = output.strip().splitlines()[-1].strip("= ")
    return re.sub(r" in [\d.]+s.*$", "", last)


@pytest.mark.slow
@pytest.mark.parametrize("change", CHANGES, ids=["off-by-one", "accept-everything", "heads-first-state"])
def test_each_change_prints_what_the_page_quotes(change, tmp_path):
    root = tmp_path / "repo"
    for folder in ("refdec", "tests"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    shutil.copy(REPO / "pytest.ini", root / "pytest.ini")
    source = root / change.path
    code = source.read_text(encoding="utf-8")
    assert code.count(change.line) == 1, change.line
    source.write_text(code.replace(change.line, change.changed), encoding="utf-8")
    for command, printed, tally in change.runs:
        output = run_in(root, command)
        for line in printed:
            assert line in output, f"{command!r} did not print {line!r}:\n{output[-3000:]}"
        assert tally is None or final_tally(output) == tally, f"{command!r}:\n{output[-3000:]}"
