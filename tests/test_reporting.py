"""What decode.py says about a run beside its figures: a busy machine, an input with nothing to
decode, and paths that read the same on every machine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import AVX512_FLAGS, REPO, ZEN3_FLAGS, fake_cpu, fake_models, run_py


class BusyMachine:
    """A /proc/stat reader and a clock driven by the test: other processes keep `others` cores busy,
    and time moves only when someone sleeps or the test says so."""

    def __init__(self, others: float):
        self.others, self.now = others, 0.0

    def sample(self):
        return self.now, self.others * self.now, 0.0  # (wall, CPU seconds of every process, our own)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_busy_cores_measure_a_check_made_right_after_the_start():
    """Case: the probe was made right before its first check, and a check less than 0.2 s after the
    start returned nothing, so the busy-machine warning could never fire. A check at once now waits
    for a window long enough to see the machine."""
    from refdec.machine import BusyCores, busy_warning

    machine = BusyMachine(others=1.5)
    busy = BusyCores(sample=machine.sample, sleep=machine.sleep)
    others = busy.others()  # no time has passed since the start
    assert others == pytest.approx(1.5)
    assert "1.5 of this machine's 2 cores" in busy_warning(others, 2, 2, "keep")
    assert busy_warning(0.1, 2, 2, "keep") is None and busy_warning(1.5, 1, 4, "keep") is None


@pytest.mark.parametrize(
    "others,cores,threads",
    [
        (0.0, 2, 2),
        (0.3, 2, 2),
        (0.49, 2, 2),
        (0.5, 2, 1),
        (0.8, 2, 1),
        (1.0, 2, 1),
        (1.9, 2, 1),
        (3.0, 2, 1),
        (0.3, 8, 8),
        (0.8, 8, 7),
        (1.2, 8, 7),
        (1.3, 8, 6),
        (4.0, 8, 4),
        (0.9, 1, 1),
    ],
)
def test_default_threads_leave_the_cores_other_processes_keep_busy(others, cores, threads):
    """Case: with another process spinning on one of 2 cores, torch's default of 2 threads decoded
    many times slower than 1 thread. A run given no count now takes the cores left idle: a share
    of a core under the warning's tolerance costs no thread, a larger one costs a whole thread."""
    from refdec.machine import busy_warning, default_threads

    assert default_threads(others, cores) == threads
    # the count is the most that busy_warning lets run without a warning (one thread if none fits)
    assert threads == 1 or busy_warning(others, threads, cores, "keep") is None
    assert threads == cores or busy_warning(others, threads + 1, cores, "keep") is not None


def test_a_run_given_no_thread_count_gets_the_idle_cores(monkeypatch):
    """fit_threads cuts torch's thread count to the idle cores and says so; it keeps the count where
    the machine does not say or is idle, and never raises a count set lower (OMP_NUM_THREADS)."""
    from refdec import machine

    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert machine.fit_threads(None) is None and machine.fit_threads(0.3) is None
        assert torch.get_num_threads() == 2
        note = machine.fit_threads(0.9)
        assert torch.get_num_threads() == 1
        assert note.startswith("using 1 thread(s), not 2: other processes keep about 0.9 of this machine's 2 cores")
        assert note.endswith("--threads N overrides")
        assert machine.fit_threads(0.0) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_busy_warning_names_the_threads_that_fit():
    from refdec.machine import busy_warning

    assert busy_warning(3.0, 8, 8, "keep").endswith("run alone, or with --threads 5")
    assert busy_warning(1.8, 1, 2, "kept").endswith("run alone")


def test_the_allocator_keeps_freed_memory_where_glibc_allows_it():
    """--allocator keep asks glibc's malloc to keep freed memory (mallopt); a report records what is in
    effect, "system" where the C library is not glibc; an unknown allocator is a usage error."""
    from refdec import machine
    from refdec.errors import UsageError

    with pytest.raises(UsageError, match="keep, system"):
        machine.set_allocator("jemalloc")
    assert machine.set_allocator("system") in machine.ALLOCATORS  # leaves what is in effect as it is
    expected = "system" if machine.glibc_mallopt() is None else "keep"
    assert machine.set_allocator("keep") == expected == machine.environment(1, "cpu", torch.float32)["allocator"]
    assert machine.set_allocator("system") == expected  # glibc's adaptive threshold cannot come back


@pytest.mark.parametrize(
    "capability, flags, fast",
    [
        ("AVX512", AVX512_FLAGS, True),
        ("AVX512", None, True),  # torch's capability alone says it
        ("AVX2", ZEN3_FLAGS, False),
        ("DEFAULT", None, False),
        ("DEFAULT", {"asimd"}, False),  # no AVX-512: slow
        ("AVX2", AVX512_FLAGS, True),  # torch held to AVX2 (ATEN_CPU_CAPABILITY); oneDNN still uses AVX-512
    ],
)
def test_int8_products_are_fast_where_the_cpu_has_avx512(capability, flags, fast, monkeypatch):
    """Guards against the int8 route being offered as the fast one on a CPU where torch._int_mm is many
    times slower than a float32 product: the rule reads torch's capability, and the CPU's flags where
    torch's own kernels are held below what the CPU has; only a run on the CPU is warned."""
    from refdec import machine

    fake_cpu(monkeypatch, capability, flags)
    assert machine.int8_products_fast() is fast
    warning = machine.int8_warning("cpu", "decode with --fast")
    if fast:
        assert warning is None
    else:
        assert f"CPU capability {capability}" in warning and "slower than float32" in warning
        assert warning.endswith("; decode with --fast") and "\n" not in warning
    assert machine.int8_warning("cuda", "decode with --fast") is None
    env = machine.environment(1, "cpu", torch.float32)
    assert env["cpu_capability"] == capability and env["cpu_int8_products"] == ("fast" if fast else "slow")
    assert env["cpu_flags"] == (None if flags is None else [f for f in machine.REPORTED_FLAGS if f in flags])


def test_the_machine_fields_name_the_cpu_torch_and_threads():
    """Guards against a timing report that cannot say which machine it came from: the CPU by name, torch's
    CPU capability and version, the thread count, in the JSON fields and the printed line."""
    from refdec import machine

    env = machine.environment(3, "cpu", torch.float32)
    assert env["cpu"] == machine.cpu_model() and env["cpu"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (env["torch"], env["threads"]) == (torch.__version__, 3)
    line = machine.machine_line(3)
    assert line.startswith(f"{env['cpu']}, torch {torch.__version__}, CPU capability {env['cpu_capability']}")
    assert line.endswith(", 3 thread(s)")


def test_cpuinfo_reads_the_first_processor(tmp_path, monkeypatch):
    from refdec import machine

    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nmodel name\t: other\n"
    )
    real_path = machine.Path
    monkeypatch.setattr(machine, "Path", lambda p: tmp_path / "cpuinfo" if p == "/proc/cpuinfo" else real_path(p))
    (tmp_path / "cpuinfo").write_text(text)
    assert machine.cpu_model() == "AMD EPYC 7B13" and machine.cpu_flags() == {"fpu", "avx2", "fma"}
    assert machine.reported_flags() == ["avx2", "fma"]
    (tmp_path / "cpuinfo").unlink()  # no /proc/cpuinfo: the platform's name, no flags
    assert machine.cpu_flags() is None and machine.cpu_model()


def fake_run(name: str = "greedy", outputs: list | None = None):
    from refdec.app.algorithms import ALGORITHMS
    from refdec.app.runner import Run

    run = Run(ALGORITHMS[name], {}, fake_models())
    run.outputs = outputs or []
    return run


def test_decoding_on_a_busy_machine_warns_before_it_starts(tmp_path, capsys, monkeypatch):
    """Case: with another process spinning on one core a 2-thread decode ran 3.6x slower and said
    nothing. decode_to_output warns before decoding from what the probe saw since the run started."""
    from refdec.app import runner
    from refdec.machine import BusyCores

    machine = BusyMachine(others=1.8)
    monkeypatch.setattr(runner.output, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    tokenizer = SimpleNamespace(decode=lambda ids: "", invalid_bytes=lambda ids: 0)
    done = runner.decode_to_output(
        [fake_run()],
        [None, None],
        tokenizer,
        output=str(tmp_path / "out.txt"),
        max_len=None,
        max_positions=64,
        device="cpu",
        warmup=0,
        progress=False,
        busy=BusyCores(sample=machine.sample, sleep=machine.sleep),
    )
    assert done == ([0, 1], True) and (tmp_path / "out.txt").read_text() == "\n\n"
    assert "warning: other processes keep about 1.8 of this machine's 2 cores busy" in capsys.readouterr().err


def summary_of(runs, ids, **kw):
    from refdec.app.report import summarise

    tokenizer = SimpleNamespace(decode=lambda ids: "x", invalid_bytes=lambda ids: 0)
    return summarise("mt-en-de", runs, ["a"] * len(ids), [], ids, tokenizer, "cpu", **kw)


def test_a_machine_busy_during_the_run_is_said_under_the_table():
    """The warning before decoding covers the loading; a machine that became busy later is said
    again under the table."""
    run = fake_run(outputs=[torch.tensor([5])])
    run.stats.sentences, run.stats.tokens, run.seconds = 1, 1, 0.5
    text = summary_of([run], [[5]], warning="other processes kept about 1.0 of this machine's 2 cores busy").text
    table, warning = text.split("\n")[2:4]
    assert table.split()[:2] == ["greedy", "1"] and warning.startswith("warning: other processes kept about 1.0")


def test_an_empty_input_says_nothing_was_decoded():
    """Case: an empty input file printed a table of `sent/s nan`."""
    from refdec.app.report import NOTHING_DECODED

    for ids in ([], [None, None]):  # an empty file; blank lines only
        text = summary_of([fake_run(outputs=[None] * len(ids))], ids).text
        assert text == NOTHING_DECODED and "nan" not in text


def test_paths_are_recorded_relative_to_the_repository_or_as_given():
    """Case: reports named the default checkpoint and test set by this machine's absolute path."""
    from refdec.app.inputs import shown_path

    assert shown_path(REPO / "checkpoints" / "mt-en-de" / "model.pt") == "checkpoints/mt-en-de/model.pt"
    assert shown_path("checkpoints/x/model.pt") == "checkpoints/x/model.pt"
    assert shown_path("../elsewhere/model.pt") == "../elsewhere/model.pt"
    assert shown_path("/srv/models/model.pt") == "/srv/models/model.pt"  # outside the repository: as given


def strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.slow
def test_a_fresh_report_carries_no_absolute_path(tmp_path):
    """Case: reports/*.json named the checkpoints and the test set by the absolute path of the machine
    they were made on. A report of the shipped model on the task's test set names them relative to the
    repository."""
    report = tmp_path / "r.json"
    r = run_py(
        "decode.py",
        "--algo",
        "greedy",
        "--task",
        "mt-en-de",
        "--limit",
        "2",
        "--threads",
        "1",
        "--quiet",
        "--output",
        str(tmp_path / "out.txt"),
        "--report",
        str(report),
    )
    assert r.returncode == 0, r.stderr.decode()
    rep = json.loads(report.read_text())
    assert rep["model"] == "checkpoints/mt-en-de/model.pt" and rep["input"] == "data/mt-en-de/test.src.gz"
    assert not [s for s in strings(rep) if Path(s).is_absolute() or str(REPO) in s]


@pytest.mark.slow
def test_an_empty_input_file_decodes_to_nothing_and_says_so(tmp_path):
    """Case: `decode.py --input empty.txt` printed a table with `sent/s nan`."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_py(
        "decode.py", "--algo", "greedy", "--task", "mt-en-de", "--input", str(empty), "--threads", "1", "--quiet"
    )
    assert r.returncode == 0 and r.stdout == b""
    assert "nothing was decoded" in r.stderr.decode() and "nan" not in r.stderr.decode()
