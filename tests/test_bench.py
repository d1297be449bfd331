"""python -m refdec bench and the --device of every measuring command: the files the bench reads (the
list a GPU machine's copy is made from), its whole run on the CPU from such a copy, and the one-line
errors for a device this machine does not have. No test needs a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from refdec import timing
from refdec.commands import bench
from refdec.training import cpp_compiler


def listed(capsys, *args: str) -> tuple[list[str], str]:
    assert bench.main(["--files", *args]) == 0
    out = capsys.readouterr()
    return out.out.splitlines(), out.err


def test_files_lists_repository_files_within_the_copys_limit(capsys):
    """Case: the GPU machine takes a copy of at most 64 MB; the repository is 212 MB. The list holds the
    code, the test sets and the checkpoints the sections read, each inside the repository."""
    paths, err = listed(capsys)
    total = 0
    for p in paths:
        assert not p.startswith("/") and ".." not in p.split("/"), p
        full = (REPO / p).resolve()
        assert full.is_file() and full.is_relative_to(REPO), p
        total += full.stat().st_size
    assert total <= 62 * 2**20 and f"{len(paths)} files" in err and "MiB" in err
    assert len(set(paths)) == len(paths)
    for needed in (
        "refdec/commands/bench.py",
        "refdec/routes/graphed.py",
        "refdec/app/hfaudit.py",
        "data/build.py",
        "checkpoints/mt-en-de/model.pt",
        "checkpoints/mt-en-de-drafter/tokenizer.json",
        "checkpoints/gec-uk-6x6/model.pt",
        "data/gec-uk/test.tgt2.gz",
        "data/mt-en-de/test.src.gz",
    ):
        assert needed in paths, needed
    assert not any(
        p.startswith(("checkpoints/gec-en", "data/mono-en", "data/distilled", "tests/"))
        or "train." in p
        and not p.endswith(".py")
        for p in paths
    )  # no training data
    some, _ = listed(capsys, "--sections", "stepcost")
    assert set(some) < set(paths) and "checkpoints/gec-uk-6x6/model.pt" not in some


def test_files_over_the_limit_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(bench, "MAX_BYTES", 1000)
    assert bench.main(["--files"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the files come to") and "MiB" in err[-1]


def test_missing_files_say_what_to_copy_or_to_use_a_clone(capsys, monkeypatch, tmp_path):
    """Case: installed with `pip install .` (refdec/ alone), the bench said to "copy every file
    --files lists", where the other commands say to use a clone installed with -e. Now a copy lacking
    files is told to copy them and an install without the repository to use a clone, in one line."""
    from refdec import repo

    monkeypatch.setattr(repo, "REPO", tmp_path)
    for argv in (["--files"], ["--device", "cpu"]):
        assert bench.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in refdec's repository" in err[0] and "pip install -e ." in err[0], err
    (tmp_path / "data").mkdir()
    (tmp_path / "data/build.py").write_text("")
    assert bench.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not in this copy of the repository" in err[0], err
    assert err[0].endswith("copy every file `python -m refdec bench --files` lists")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sections", "stepcost,nope"], "--sections: nope"),
        (["--device", "cpu", "--limit", "0"], "--limit"),
        (["--device", "gpu0"], "--device gpu0: refdec runs on cpu or cuda"),
    ],
)
def test_bench_refuses_bad_options_in_one_line(args, needle, capsys):
    assert bench.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def commands():
    from refdec.commands import ceiling, distill, fuzz, stepcost
    from refdec.commands import hfcli as hf_cli

    return {
        "stepcost": (stepcost.main, []),
        "ceiling": (ceiling.main, []),
        "fuzz": (fuzz.main, []),
        "distill": (distill.main, ["--task", "mt-en-de", "--out", "unused"]),
        "hf audit": (hf_cli.main, ["audit", "--task", "mt-en-de", "--model", "unused"]),
        "bench": (bench.main, []),
    }


@pytest.mark.parametrize("name", ["stepcost", "ceiling", "fuzz", "distill", "hf audit", "bench"])
def test_every_measuring_command_refuses_a_device_it_cannot_use_in_one_line(name, capsys, monkeypatch):
    """The same exit-2 line from each command, before any model loads: a name torch does not know,
    and cuda on a machine without a GPU (made so here whatever the machine has)."""
    main, argv = commands()[name]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, line in (
        ("tpu-ish", "error: --device tpu-ish: refdec runs on cpu or cuda (cuda:N for one GPU of several)"),
        ("cuda", "error: --device cuda: this machine has no CUDA device; use --device cpu"),
    ):
        assert main([*argv, "--device", device]) == 2, (name, device)
        assert capsys.readouterr().err.strip().splitlines() == [line], (name, device)


def test_without_transformers_its_section_is_one_line_and_a_report(tmp_path, capsys, monkeypatch):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "transformers" else real(name))
    assert bench.main(["--device", "cpu", "--sections", "transformers", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "transformers is not installed: its greedy, assisted generation and prompt lookup are left out" in out
    assert json.loads((tmp_path / "cpu-transformers.json").read_text())["skipped"] == "transformers is not installed"


def test_a_failing_section_is_named_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    def fake(section, *args):
        if section == "ceiling":
            raise bench.SectionError("python -m refdec ceiling exited with 2")
        return {"reports": {}}

    monkeypatch.setattr(bench, "command_sections", fake)
    assert bench.main(["--device", "cpu", "--sections", "ceiling,stepcost", "--out", str(tmp_path / "new")]) == 1
    out = capsys.readouterr()
    assert "error: ceiling: python -m refdec ceiling exited with 2" in out.err
    assert "1 of 2 sections in" in out.out and "failed: ceiling" in out.out
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["cpu-stepcost.json"]


def test_inner_settings_are_small_on_the_cpu_or_with_a_small_limit():
    from argparse import Namespace

    gpu = bench.settings(Namespace(limit=None, warm_all=False), torch.device("cuda"))
    assert gpu["sizes"] == [1, 8, 32, 128] and gpu["k"] == "4,8,16,25" and gpu["accept"] == "1,0.8"
    assert gpu["sentences"] == {"batch1": 100, "batched": 256, "ceiling": 50, "transformers": 40}
    for device, limit in (("cpu", 3), ("cuda", 5)):
        small = bench.settings(Namespace(limit=limit, warm_all=False), torch.device(device))
        assert small["sizes"] == [1, 8] and small["rounds"] == 1 and small["warmup"] == 1
        assert set(small["sentences"].values()) == {limit}
    assert bench.settings(Namespace(limit=None, warm_all=False), torch.device("cpu"))["sizes"] == [1, 8, 32, 128]


def test_clock_waits_for_the_gpu_and_not_for_the_cpu(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    timing.clock(torch.device("cpu"))
    assert waited == []
    timing.clock(torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0)]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["fast", "graphed"])
def test_ceiling_runs_its_models_on_a_route(route, trained_tiny, tmp_path):
    from refdec.commands.ceiling import main

    rep = tmp_path / "ceiling.json"
    assert (
        main(
            [
                "--model",
                str(trained_tiny / "model.pt"),
                "--drafter",
                "none",
                "--limit",
                "2",
                "--warmup",
                "0",
                "--k",
                "3",
                "--threads",
                "1",
                f"--{route}",
                "--device",
                "cpu",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())
    assert (
        r["route"] == route
        and r["device"] == "cpu"
        and [row["run"] for row in r["rows"]] == ["greedy", "k=3 accept=1 free drafts"]
    )


@pytest.mark.slow
def test_bench_runs_on_the_cpu_from_a_copy_of_its_files(tmp_path):
    """What a GPU machine does, on the CPU: copy the files --files lists, run the command there with
    --limit 3, and find every section's tables on stdout and its report (no absolute path in it)."""
    listing = subprocess.run(
        [sys.executable, "-m", "refdec", "bench", "--files"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0, listing.stderr
    copy = tmp_path / "copy"
    for p in listing.stdout.splitlines():
        (copy / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / p, copy / p)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-m", "refdec", "bench", "--device", "cpu", "--limit", "3", "--threads", "1"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for section in bench.SECTIONS:
        assert f"## {section} (cpu" in out, section
    for line in (
        "reference route\n",
        "fast route\n",
        "graphed route\n",
        "speed vs greedy",
        "speed vs beam",
        "graphed route's greedy against the reference route's:",
        "sent/s",
        "# stepcost-rows32",
        "# ceiling-graphed",
        "6 of 6 sections",
    ):
        assert line in out, line
    assert "iad [graphed]" in out and "batch 1" in out
    reports = copy / "reports"
    for path in reports.glob("*.json"):
        text = path.read_text(encoding="utf-8")
        assert str(copy) not in text and str(REPO) not in text, path.name
    batch1 = json.loads((reports / "cpu-gec-uk.json").read_text())
    assert batch1["sentences"] == 3 and set(batch1["routes"]) == {"reference", "fast", "graphed"}
    assert batch1["environment"]["cpu"] and batch1["environment"]["cpu_capability"]  # the machine it ran on
    iad = next(row for row in batch1["routes"]["graphed"] if row["run"] == "iad")
    assert iad["identical_to_greedy"] == 1.0 and iad["speed_vs_beam"] > 0
    assert set(batch1["greedy_against_reference"]) == {"fast", "graphed"}
    batched = json.loads((reports / "cpu-batched.json").read_text())
    assert batched["batch_sizes"] == [1, 8] and len(batched["throughput"]) == 6
    for name in ("stepcost-rows1", "stepcost-rows32", "ceiling-reference", "ceiling-fast", "ceiling-graphed"):
        assert (reports / f"cpu-{name}.json").is_file(), name
    calls = json.loads((reports / "cpu-stepcost-rows32.json").read_text())["calls"]
    assert [c["q"] for c in calls] == [1, 2, 4, 8, 16, 32, 64] and all("graphed_ms" in c for c in calls)
    hf = json.loads((reports / "cpu-transformers.json").read_text())
    assert hf.get("skipped") or set(hf["reports"]) == {"transformers-mt-en-de", "transformers-gec-uk"}
    if not hf.get("skipped"):
        audit = json.loads((reports / "cpu-transformers-gec-uk.json").read_text())
        methods = {m["method"]: m for m in audit["methods"]}
        assert {"refdec-iad", "refdec-iad [fast]", "refdec-greedy [graphed]", "hf-greedy", "hf-prompt-lookup"} <= set(
            methods
        )
        assert methods["refdec-iad [graphed]"]["identical"] == 1.0


def test_stepcost_times_the_int8_route_and_splits_its_call(tmp_path, capsys):
    """stepcost --int8 times the fast int8 route beside the others and splits each of its calls into
    the integer products, the quantization around them, attention and the rest, which add up to the
    call, in the printout and the report."""
    from conftest import random_checkpoint

    from refdec.commands import stepcost

    path = random_checkpoint(tmp_path / "m")
    report = tmp_path / "cost.json"
    assert (
        stepcost.main(
            [
                "--task",
                "mt-en-de",
                "--model",
                str(path),
                "--rows",
                "3",
                "--q",
                "1,4",
                "--src",
                "5",
                "--prefix",
                "4",
                "--rounds",
                "1",
                "--fast",
                "--int8",
                "--threads",
                "1",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fast-int8 ms/call" in out and "fast int8 route, one call's parts timed alone" in out
    parts = json.loads(report.read_text())["int8_parts"]
    for q in ("1", "4"):
        total = sum(parts[f"{p}_ms"][q] for p in ("products", "quantization", "attention", "rest"))
        assert abs(total - parts["call_ms"][q]) < 1e-9 and parts["products_ms"][q] > 0


def test_stepcost_parts_split_the_fast_call_against_the_machines_rates(tmp_path, capsys):
    """stepcost --fast --parts splits each fast-route call into its products by shape (each with its
    kernel and roofline), attention, norms and the rest, which add up to the call; --parts without
    --fast is refused in one line."""
    from conftest import random_checkpoint

    from refdec.commands import stepcost

    path = random_checkpoint(tmp_path / "m")
    report = tmp_path / "cost.json"
    common = ["--task", "mt-en-de", "--model", str(path), "--rows", "2", "--q", "1,3", "--src", "5"]
    common += ["--prefix", "4", "--rounds", "1", "--threads", "1"]
    assert stepcost.main([*common, "--fast", "--parts", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "the machine:" in out and "GFLOP/s" in out and "torch operations" in out
    parts = json.loads(report.read_text())["fast_parts"]
    assert parts["rates"]["flops"] > 0 and parts["rates"]["bytes"] > 0
    for q in ("1", "3"):
        rows = parts["by_q"][q]
        whole = rows[-1]
        assert whole["part"] == "the whole call" and whole["torch_operations"] > 0
        assert abs(sum(r["seconds"] for r in rows[:-1]) - whole["seconds"]) < 1e-9
        products = [r for r in rows if "bound_seconds" in r]
        assert len(products) == 5 and all(r["bound_seconds"] > 0 and r["kernel"] for r in products)
    assert stepcost.main([*common, "--parts"]) == 2
    assert "--parts" in capsys.readouterr().err


def test_stepcost_times_a_family_the_fast_route_does_not_write(tmp_path, capsys):
    """Was: stepcost timed `on_route(model, "fast").reference`, which a family the fast route does not
    write (here RMS norm and a gated feed-forward, as T5 v1.1's) got as a KernelRoute without
    `reference`: an AttributeError. Its layers are timed on the few-row and the plain product, and
    --fast, which has no route to time there, is refused in one line."""
    import dataclasses

    from conftest import TEXTS, tiny_model

    from refdec.checkpoint import make_checkpoint, save_atomic
    from refdec.commands import stepcost
    from refdec.model import Transformer
    from refdec.routes import applies_to
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.train(TEXTS * 5, vocab_size=300, min_frequency=1)
    cfg = dataclasses.replace(tiny_model(0, tok.vocab_size, d_model=16, n_heads=2).cfg, norm="rms", gated_ff=True)
    assert not applies_to(cfg)
    (tmp_path / "m").mkdir()
    save_atomic(make_checkpoint(Transformer(cfg).eval(), "mt-en-de", tok, step=1), tmp_path / "m" / "model.pt")
    tok.save(tmp_path / "m" / "tokenizer.json")
    common = [
        "--task",
        "mt-en-de",
        "--model",
        str(tmp_path / "m" / "model.pt"),
        "--rows",
        "2",
        "--q",
        "1,4",
        "--src",
        "5",
        "--prefix",
        "4",
        "--rounds",
        "1",
        "--threads",
        "1",
    ]
    report = tmp_path / "cost.json"
    assert stepcost.main([*common, "--report", str(report)]) == 0
    calls = json.loads(report.read_text())["calls"]
    assert [c["q"] for c in calls] == [1, 4] and all(c["ms"] > 0 and c["plain_ms"] > 0 for c in calls)
    capsys.readouterr()
    assert stepcost.main([*common, "--fast"]) == 2
    err = capsys.readouterr().err
    assert "--fast: the fast route does not write this model's layers" in err and "Traceback" not in err


def test_route_tables_say_faster_for_a_run_that_took_less_time():
    """A run that took a third of greedy's time is "3.00x faster" than greedy in the per-route
    table, as in its JSON (speed_vs_greedy 3.0): the words once read the ratio upside down."""
    from types import SimpleNamespace

    from refdec.commands.bench import ROUTES, route_tables

    out = [torch.tensor([5, 6])]
    runs, rows = [], []
    for route in ROUTES:
        for algo, seconds in (("greedy", 3.0), ("iad", 1.0), ("beam", 6.0)):
            runs.append(
                SimpleNamespace(
                    name=f"{algo} [{route}]",
                    algo=SimpleNamespace(name=algo),
                    batch_size=1,
                    outputs=out,
                    models=SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(eos_id=2))),
                )
            )
            rows.append(
                {"seconds": seconds, "ms_per_token": seconds, "tokens_per_call": 1.0, "sent_per_s": 1 / seconds}
            )
    text, figures = route_tables("gec-uk", runs, rows, [[1]], torch.device("cpu"))
    lines = {
        line.split()[0]: line for line in text.splitlines()[:6] if line.split() and line.split()[0] in ("iad", "beam")
    }
    assert "3.00x faster" in lines["iad"] and "6.00x faster" in lines["iad"]
    assert "2.00x slower" in lines["beam"]
    assert figures["routes"]["reference"][1]["speed_vs_greedy"] == 3.0


def test_warm_all_decodes_every_batch_once_before_the_timed_runs(monkeypatch):
    """Guards decode_lines' warm_all (bench --warm-all): every batch of every chunk is decoded once,
    whole and untimed, before the timed loop decodes each again; without it, the first rows of the
    first `warmup` chunks only."""
    from types import SimpleNamespace

    from refdec.app.runner import loop

    calls = []

    def fake(run, b, ids, budget, device, warm_up=False):
        calls.append((tuple(b), warm_up))
        return None  # as a failed batch: nothing to add up

    monkeypatch.setattr(loop, "tried_batch", fake)
    ids = [[5] * (1 + i % 7) for i in range(40)]
    run = SimpleNamespace(
        batch_size=8,
        algo=SimpleNamespace(name="greedy"),
        seconds=0.0,
        fits=lambda rows, longest: rows <= 8,
        cuts_to_budget=True,
    )
    for warm_all in (False, True):
        calls.clear()
        loop.decode_lines(
            [run], ids, max_len=20, max_positions=64, device="cpu", warmup=1, warm_all=warm_all, progress=False
        )
        warm = sorted(i for b, w in calls if w for i in b)
        timed = sorted(i for b, w in calls if not w for i in b)
        assert timed == list(range(40))
        if warm_all:
            assert warm == list(range(40))
        else:
            assert 0 < len(warm) <= loop.WARMUP_ROWS


@pytest.mark.slow
@pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile's CPU kernels need a C++ compiler")
def test_stepcost_times_the_fused_graphed_route_and_checks_its_logits(tmp_path, capsys):
    """stepcost --fused times the graphed route with its steps compiled (refdec.routes.graphed.fused)
    beside the graphed route, and its step alone; every route beside the reference has its largest logit
    difference from the reference route printed and reported, within float32 rounding here."""
    from conftest import random_checkpoint

    from refdec.commands import stepcost

    path = random_checkpoint(tmp_path / "m")
    report = tmp_path / "cost.json"
    common = ["--task", "mt-en-de", "--model", str(path), "--rows", "2", "--q", "1,4", "--src", "5", "--prefix", "4"]
    assert (
        stepcost.main([*common, "--rounds", "1", "--graphed", "--fused", "--threads", "1", "--report", str(report)])
        == 0
    )
    out = capsys.readouterr().out
    assert "graphed-fused ms/call" in out and "graphed-fused route, the q = 1 call's step alone" in out
    gaps = json.loads(report.read_text())["logit_gaps"]
    assert set(gaps) == {"graphed", "graphed-fused"} and all(0 <= g < 1e-3 for r in gaps.values() for g in r.values())
    line = "graphed-fused route, largest |logit difference| from the reference route's: q = 1"
    assert f"{line} {gaps['graphed-fused']['1']:.2e}" in out


def test_stepcost_fused_without_a_compiler_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from conftest import random_checkpoint

    from refdec.commands import stepcost

    monkeypatch.setattr(stepcost, "cpp_compiler", lambda: None)
    path = random_checkpoint(tmp_path / "m")
    assert (
        stepcost.main(
            ["--task", "mt-en-de", "--model", str(path), "--q", "1", "--graphed", "--fused", "--threads", "1"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--fused on the CPU needs a C++ compiler" in err and "Traceback" not in err
