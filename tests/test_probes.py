"""refdec.routes.probes: the decisions a run makes by what the machine does, read back from a machine
report (`refdec machine --report FILE`, REFDEC_MACHINE_REPORT=FILE) so that a run starts with every one of
them fixed and probes nothing; a decision the report lacks probed as without it; a report from another
machine, or a file that is not a machine report, refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    ZEN3_FLAGS,
    assert_rows_equal,
    batch1_greedy,
    counting_probes,
    error_of,
    fake_cpu,
    random_checkpoint,
)

from refdec import machine
from refdec.checkpoint import load_model
from refdec.commands import machine as command
from refdec.config import EOS_ID
from refdec.decoding import decode_greedy, decode_iad
from refdec.routes import int8, on_route, probes

LENGTHS = (4, 6, 7, 9)  # the source lengths (eos included) the machine command probes here, of COUNTS each
COUNTS = (2, 3)
PROBES = ("race", "probe_plan", "check_fused", "exact_products", "check_grouping", "measure_slowdown")


@pytest.fixture
def fresh(monkeypatch):
    """This process's decisions kept apart from the rest of the session's: none made, none read yet."""
    monkeypatch.setattr(probes, "decided", probes.Decisions())
    monkeypatch.delenv(probes.REPORT_VARIABLE, raising=False)


@pytest.fixture(scope="module")
def made_report(tmp_path_factory):
    """A machine report on a random checkpoint's shapes at this thread count (`refdec machine --model`,
    over LENGTHS x COUNTS), made once for the module with decisions of its own, and the checkpoint."""
    folder = tmp_path_factory.mktemp("machine")
    ckpt = random_checkpoint(folder / "ckpt")
    path = folder / "machine.json"
    threads = str(torch.get_num_threads())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probes, "decided", probes.Decisions())
        mp.delenv(probes.REPORT_VARIABLE, raising=False)
        mp.setattr(command, "LENGTHS", LENGTHS)
        mp.setattr(command, "COUNTS", COUNTS)
        assert command.main(["--model", str(ckpt), "--threads", threads, "--report", str(path)]) == 0
    return path, ckpt


@pytest.fixture
def report(fresh, made_report, capsys):
    """made_report, for a test whose process has made and read no decision yet (`fresh`)."""
    capsys.readouterr()
    return made_report


def sources(lengths: list[int], vocab: int) -> torch.Tensor:
    """Sources of these lengths (eos included), right-padded, random tokens of the vocabulary."""
    g = torch.Generator().manual_seed(0)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        src[b, : n - 1], src[b, n - 1] = torch.randint(5, vocab, (n - 1,), generator=g), EOS_ID
    return src


def test_a_run_takes_every_decision_from_a_machine_report_and_probes_nothing(report, monkeypatch):
    """With REFDEC_MACHINE_REPORT naming a machine report of this machine, the fast int8 route is built,
    encodes sources of one length together and decodes (greedy, batched IAD) with every probe made to
    fail: the weights' range, each product's plan and the grouped attention are the report's. Its outputs
    are those of the same run with the probes made here (the same kernels), and what the run reports says
    where its decisions came from. The int8 warning's slowdown (a CPU without AVX-512) is read too."""
    path, ckpt = report
    model = load_model(ckpt)[0]
    src = sources([7, 7, 7, 9, 9, 4, 6], model.cfg.vocab_size)  # 3 of 7 tokens, 2 of 9: one call each, if it holds
    with torch.no_grad():
        probed = on_route(model, "fast", int8=True)
        want_greedy, want_iad = batch1_greedy(probed, src, 12), decode_iad(probed, src, max_len=12).tokens
    monkeypatch.setattr(probes, "decided", probes.Decisions())
    monkeypatch.setenv(probes.REPORT_VARIABLE, str(path))
    for name in PROBES:
        monkeypatch.setattr(probes, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    with torch.no_grad():
        m = on_route(model, "fast", int8=True)
        assert_rows_equal(batch1_greedy(m, src, 12), want_greedy, "greedy, decisions read")
        assert_rows_equal(decode_iad(m, src, max_len=12).tokens, want_iad, "batched iad, decisions read")
        decode_greedy(m, src, max_len=12)
    found = probes.found()
    assert found["read_from"] == str(path) and found["int8_plans"]
    assert all(plan["why"].startswith(f"as {path} records: ") for plan in found["int8_plans"].values())
    fake_cpu(monkeypatch, "AVX2", ZEN3_FLAGS)
    ratio = json.loads(path.read_text())["decisions"]["int8_slowdown"][0]["times_float32"]
    said = f"measured {ratio:.1f}x slower" if ratio >= 1 else f"measured {1 / ratio:.1f}x faster"
    assert said in machine.int8_warning("cpu", "x")


def test_a_decision_the_report_lacks_is_probed_as_without_it(report, monkeypatch):
    """Another weight shape, or a shape of the report at another thread count: probed (and kept), the
    report's own decisions still taken as they are."""
    path, _ = report
    monkeypatch.setattr(probes, "decided", probes.Decisions())
    monkeypatch.setenv(probes.REPORT_VARIABLE, str(path))
    probed = counting_probes(monkeypatch)
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1
    int8.plan(16, 48)  # the self-attention's queries, keys and values: in the report
    assert probed == [] and probes.decided.source == str(path)
    int8.plan(16, 40)
    torch.set_num_threads(other)
    try:
        int8.plan(16, 48)
    finally:
        torch.set_num_threads(threads)
    int8.plan(16, 40)
    assert probed == [(16, 40, threads), (16, 48, other)]


def test_the_report_records_what_a_process_reads_back(monkeypatch):
    """probes.recorded holds each decision with what it holds for (shape, count, heads, head size, dtype,
    thread count) and the machine; read back, every table is as it was."""
    made = probes.Decisions(
        plans={(16, 48, 1): probes.Plan(None, True, (("blocks", 384, 1.0, "whole", 2.0),), "slower here")},
        grouping={(9, 2, 2, 8, torch.float32, 1): True, (9, 3, 2, 8, torch.float32, 1): False},
        slowdowns={1: 0.5},
        checks={"weight_levels": 127},
    )
    monkeypatch.setattr(probes, "decided", made)
    record = probes.recorded()
    monkeypatch.setattr(probes, "decided", probes.Decisions(environment_read=True))
    assert probes.take(json.loads(json.dumps(record)), "m.json") == 5
    back = probes.decided
    assert record["machine"] == probes.this_machine()
    assert record["grouped_attention"] == [
        {"heads": 2, "head_size": 8, "dtype": "float32", "threads": 1, "held": {"2": [9]}, "not_held": {"3": [9]}}
    ]
    assert back.grouping == made.grouping and back.slowdowns == made.slowdowns and back.checks == made.checks
    assert {k: (p.fused_from, p.blocks) for k, p in back.plans.items()} == {(16, 48, 1): (None, True)}


def test_a_report_from_another_machine_or_not_a_machine_report_is_refused_in_one_line(
    report, tmp_path, capsys, monkeypatch
):
    """Guards against a run taking another CPU's kernels, or reading a file that holds no decisions: a
    command whose run needs a decision says so in one line (exit 2) and names the variable, the file and
    what to run instead."""
    from refdec.commands.int8bench import main

    path, ckpt = report
    here = json.loads(path.read_text())
    other = tmp_path / "other.json"
    decisions = here["decisions"]
    other.write_text(
        json.dumps({**here, "decisions": {**decisions, "machine": {**decisions["machine"], "cpu": "Another CPU"}}})
    )
    decode_report = tmp_path / "decode.json"
    decode_report.write_text(json.dumps({"runs": [], "environment": here["environment"]}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    argv = ["--task", "mt-en-de", "--model", str(ckpt), "--rows", "1", "--rounds", "1", "--reps", "1"]
    for file, says in (
        (other, "its decisions were made on Another CPU, CPU capability"),
        (decode_report, "not a machine report"),
        (garbage, "not a machine report"),
        (tmp_path / "missing.json", "cannot be read"),
    ):
        monkeypatch.setattr(probes, "decided", probes.Decisions())
        monkeypatch.setenv(probes.REPORT_VARIABLE, str(file))
        err = error_of(main, argv, capsys, monkeypatch)
        assert err.startswith(f"error: {probes.REPORT_VARIABLE}={file}: {says}"), err
        assert "python -m refdec machine" in err or "cannot be read" in err


@pytest.mark.slow
def test_the_machine_command_probes_everything_now_whatever_the_variable_says(report, monkeypatch, capsys):
    """`refdec machine` reads no machine report: with REFDEC_MACHINE_REPORT set, its plans are timed again
    (its printout shows the timings) and its report records no source."""
    path, ckpt = report
    monkeypatch.setenv(probes.REPORT_VARIABLE, str(path))
    again = path.parent / "again.json"
    threads = str(torch.get_num_threads())
    assert command.main(["--model", str(ckpt), "--threads", threads, "--report", str(again)]) == 0
    assert " vs " in capsys.readouterr().out  # the probe's timings, printed
    got = json.loads(again.read_text())
    assert got["environment"]["probes"]["read_from"] is None
    assert all(plan["timings_us"] for plan in got["environment"]["probes"]["int8_plans"].values())
