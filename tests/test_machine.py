"""`refdec machine`: what this machine's probes choose for the routes, printed and written as JSON for an
auditor, with each probe's outcome forced both ways so that every line is tested on every machine; and
every timing report's record of the probes its run made. (Reading a machine report back:
tests/test_probes.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from refdec.commands import machine as command
from refdec.config import ModelConfig
from refdec.routes import fast, int8, probes


@pytest.fixture
def tiny_shapes(monkeypatch):
    """The command on a tiny model's shapes and a few source lengths: a second, not the shipped model's six;
    the decisions it makes kept apart from the rest of the test session's."""
    monkeypatch.setattr(probes, "decided", probes.Decisions())
    monkeypatch.setattr(
        command, "SHIPPED", ModelConfig(vocab_size=64, d_model=16, n_heads=2, d_ff=32, enc_layers=1, dec_layers=1)
    )
    monkeypatch.setattr(command, "LENGTHS", (1, 9, 15, 16))
    monkeypatch.setattr(command, "COUNTS", (2, 3))


@pytest.mark.parametrize("fused_here,grouping_here", [(True, True), (False, False)])
def test_machine_prints_each_probes_outcome_and_writes_it(
    fused_here, grouping_here, tiny_shapes, tmp_path, capsys, monkeypatch
):
    """Each plan's fused product (from how many rows, or no) and row blocks with the timings it was chosen
    by, int8 against float32 at 1 and 32 rows, the grouped attention's outcome (and the lengths where
    sources attend one by one), the few-row product's cost; the report holds them, the machine, and the
    decisions a later run reads back (the int8 slowdown and the weights' range: the plans and the grouping
    are forced here)."""
    timings = (("fused", 1, 5.0, "plain", 10.0),)
    monkeypatch.setattr(int8, "plan", lambda k, n: probes.Plan(1 if fused_here else None, False, timings, "forced"))
    monkeypatch.setattr(probes, "grouping_holds", lambda n, r, *rest: grouping_here or n != 9)
    report = tmp_path / "machine.json"
    assert command.main(["--threads", "1", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "torch " + torch.__version__ in out and "CPU capability" in out
    assert ("from 1 row(s)" in out) is fused_here and "fused 5 vs plain 10 at 1" in out
    assert "int8 faster" in out and "few-row product" in out and "float32's time" in out
    if grouping_here:
        assert "8 of 8 (length, count) shapes hold" in out
    else:
        assert "it does not hold at lengths 9: sources of those lengths attend one by one" in out
    got = json.loads(report.read_text())
    found = got["by_threads"]["1"]
    assert [v["rows"] for v in found["int8_vs_float32"]] == [1, 32]
    assert found["grouped_attention"] == {"tried": 8, "failed_lengths": [] if grouping_here else [9]}
    assert got["environment"]["cpu"] and got["environment"]["threads"] == [1] and "probes" in got["environment"]
    decisions = got["decisions"]
    assert got["command"] == "refdec machine" and decisions["machine"] == probes.this_machine()
    assert decisions["checks"]["weight_levels"] in (127, 63)
    assert [s["threads"] for s in decisions["int8_slowdown"]] == [1]


def test_machine_refuses_a_bad_thread_list_in_one_line(capsys):
    assert command.main(["--threads", "one"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --threads takes whole numbers") and err.count("\n") == 1


def test_every_timing_report_records_the_probes_its_run_made():
    """environment()['probes'] lists the int8 plans and grouped-attention shapes this process has probed,
    and that none was read from a machine report."""
    from refdec.machine import environment

    int8.plan(16, 24)
    probes.grouping_holds(5, 2, 2, 8, torch.float32, fast.attend_together)
    found = environment(1, "cpu", torch.float32)["probes"]
    threads = f"{torch.get_num_threads()} thread(s)"
    assert f"16 x 24, {threads}" in found["int8_plans"] and found["grouped_attention"][threads]["tried"] >= 1
    assert found["read_from"] is None
