"""Progress of the long-running commands: a line on stderr every few seconds, none for short work.
Case: `python -m refdec stepcost --rows 64` printed nothing for 300 s; refdec.commands.fuzz nothing until its
report, refdec.commands.ceiling a line only every 50 sentences, refdec.commands.distill only at its saves."""

from __future__ import annotations

import re

import pytest

from refdec import progress as progress_mod
from refdec.progress import ProgressLine, duration


@pytest.fixture
def every_update(monkeypatch):
    """Progress lines at every update instead of every few seconds (a test runs for less than that)."""
    monkeypatch.setattr(ProgressLine.__init__, "__defaults__", (0.0,))


def test_a_line_only_when_one_is_due_with_the_pace_so_far(monkeypatch):
    """Guards the pacing: nothing in the first seconds nor at the end, at most one line per interval,
    and an ETA from the pace of this run (units an earlier run did are left out of it)."""
    clock = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    lines = []
    p = ProgressLine(10, "rounds", every=5.0, log=lines.append)
    clock[0] = 102.0
    p.update(1)  # too soon
    clock[0] = 110.0
    p.update(2)  # 10 s for 2 rounds: 40 s for the 8 left
    clock[0] = 112.0
    p.update(3)  # 2 s after the last line
    clock[0] = 130.0
    p.update(10)  # done: the command's own output follows
    assert lines == ["  2/10 rounds, 10 s, ETA 40 s"]
    resumed = ProgressLine(100, "sentences", already=50, log=lines.append)
    clock[0] = 190.0
    resumed.update(60)  # 10 sentences of this run in 60 s: 40 left take 240 s
    assert lines[-1] == "  60/100 sentences, 60 s, ETA 4.0 min"
    resumed.update(61, now=True)
    assert lines[-1].startswith("  61/100 sentences")
    assert [duration(s) for s in (42, 750, 9000)] == ["42 s", "12.5 min", "2.5 h"]


def test_fuzz_reports_progress_on_stderr(every_update, capsys):
    from refdec.commands.fuzz import main

    assert main(["--models", "3", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert re.findall(r"^  (\d)/3 models, ", err, re.M) == ["1", "2"]
    assert "/3 models" not in out and "0 mismatches" in out


@pytest.mark.slow
def test_stepcost_ceiling_and_distill_report_progress_on_stderr(every_update, trained_tiny, tmp_path, capsys):
    from refdec.commands.ceiling import main as ceiling
    from refdec.commands.distill import distill
    from refdec.commands.stepcost import main as stepcost

    model = str(trained_tiny / "model.pt")
    assert (
        stepcost(["--model", model, "--q", "1,2", "--rounds", "2", "--threads", "1", "--src", "4", "--prefix", "4"])
        == 0
    )
    out, err = capsys.readouterr()
    assert "a warm-up round, then 2 rounds" in err
    assert re.findall(r"^  (\d)/3 rounds, ", err, re.M) == ["1", "2"] and "rounds, " not in out
    assert (
        ceiling(["--model", model, "--drafter", "none", "--limit", "3", "--warmup", "0", "--k", "2", "--threads", "1"])
        == 0
    )
    out, err = capsys.readouterr()
    assert re.findall(r"^  (\d)/3 sentences, ", err, re.M) == ["1", "2"] and "sentences, " not in out
    lines = []
    distill(
        "mt-en-de",
        trained_tiny / "model.pt",
        tmp_path / "d",
        algo="greedy",
        batch_size=4,
        limit=12,
        save_every=100,
        log=lines.append,
    )  # one save, at the end: the lines between come from the pace
    assert [line.split(",")[0] for line in lines] == ["  4/12 sentences", "  8/12 sentences", "  12/12 sentences"]
