"""The fast route's float products (refdec.routes.products): each kernel computes the product, the kernel a
run takes is fixed per machine (a rule on the CPU, or a machine report read back; never a fresh timing),
and every lossless decoder on the fast route equals its greedy whichever kernel computes the products."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import check_lossless_decoders, copy_model, random_src

from refdec.decoding import decode_greedy, decode_iad
from refdec.routes import on_route, probes, products

REPO = Path(__file__).resolve().parent.parent
FLOAT64_KERNELS = [k for k in products.available(torch.float64)]  # torch, and openblas where numpy has it


@pytest.fixture
def forced(monkeypatch):
    """force(kernel): every float plan decided from now on names `kernel` for every row class; the
    decisions are dropped again afterwards."""

    def force(kernel: str) -> None:
        monkeypatch.setattr(probes, "cpu_rule", lambda dtype, available: probes.FloatPlan((kernel,) * 4, "the test's"))
        probes.forget(read_report=False)

    yield force
    probes.forget()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_every_kernel_computes_the_product(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = products.FloatWeight(torch.randn(48, 80, generator=g, dtype=dtype), (48, 192, 80))
    x, b, add = (torch.randn(*s, generator=g, dtype=dtype) for s in ((rows, 48), (80,), (rows, 80)))
    exact = x.double() @ w.in_out.double() + b.double()
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    with torch.inference_mode():
        for kernel in products.available(dtype):
            plain = products.product(x, w, b, kernel=kernel)
            assert plain.dtype == dtype and plain.shape == (rows, 80)
            assert (plain.double() - exact).abs().max() < tol, kernel
            assert (products.product(x, w, b, add=add, kernel=kernel).double() - exact - add).abs().max() < tol
            assert (products.product(x, w, b, relu=True, kernel=kernel).double() - exact.relu()).abs().max() < tol
            assert (products.product(x, w, kernel=kernel).double() - (exact - b)).abs().max() < tol
            assert torch.equal(add, add.clone())  # the residual is read, not written
    assert "torch" in products.available(dtype)


@pytest.mark.skipif("openblas" not in products.available(torch.float32), reason="numpy has no OpenBLAS here")
@pytest.mark.parametrize("rows", [1, 3])  # its matrix-vector product, its matrix product
def test_openblas_computes_on_torchs_threads_and_leaves_numpys_count_as_it_was(monkeypatch, rows):
    lib = products.openblas()
    before, threads = lib.getter(), torch.get_num_threads()
    seen = []
    for calls in (lib.gemv, lib.gemm):
        real = calls[torch.float32]
        monkeypatch.setitem(calls, torch.float32, lambda *a, real=real: (seen.append(lib.getter()), real(*a))[1])
    x, w = torch.ones(rows, 4), torch.ones(4, 3)
    try:
        for count in (1, 2, before + 1):
            lib.setter(count)
            y = products.openblas_product(x, w, torch.ones(3), None, threads)
            assert lib.getter() == count and seen[-1] == threads and torch.equal(y, torch.full((rows, 3), 5.0))
    finally:
        lib.setter(before)


@pytest.mark.skipif("openblas" not in products.available(torch.float32), reason="numpy has no OpenBLAS here")
def test_openblas_adds_the_bias_and_the_residual_in_its_call_and_writes_neither():
    """The product adds itself to a new tensor holding bias + residual (the call's beta term): one row or
    several, neither operand is written, and a strided input row is read as it is."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 5, generator=g, dtype=torch.float64)
    for rows in (1, 4):
        x = torch.randn(rows, 16, generator=g, dtype=torch.float64)[:, ::2]  # rows of stride 2
        b, add = (
            torch.randn(5, generator=g, dtype=torch.float64),
            torch.randn(rows, 5, generator=g, dtype=torch.float64),
        )
        kept = b.clone(), add.clone()
        for bias, residual in ((b, add), (b, None), (None, add), (None, None)):
            y = products.openblas_product(x, w, bias, residual, 1)
            want = x @ w + (0 if bias is None else bias) + (0 if residual is None else residual)
            assert y.is_contiguous() and (y - want).abs().max() < 1e-12
        assert torch.equal(b, kept[0]) and torch.equal(add, kept[1])


def test_an_openblas_whose_calls_compute_wrongly_is_not_taken(monkeypatch):
    """A library whose bound calls do not compute the check's exact product (an integer width that is not
    the library's) leaves the kernel unavailable rather than computing wrong products."""
    monkeypatch.setattr(products, "blas_product", lambda lib, x, w, y, beta: y.add_(1))
    assert products.OpenBLAS().setter is None


def test_the_cpu_rule_is_fixed_by_the_cpu(monkeypatch):
    """The plan a run takes without a machine report depends on the CPU's vendor and instructions alone."""
    every = ("torch", "onednn", "openblas")
    cases = {
        ("AuthenticAMD", frozenset({"avx2", "avx512f"})): ("openblas", "onednn", "onednn", "onednn"),
        ("AuthenticAMD", frozenset({"avx2"})): ("openblas",) * 4,
        ("GenuineIntel", frozenset({"avx2", "avx512f", "amx_tile"})): ("torch",) * 4,
        ("", frozenset()): ("torch",) * 4,
    }
    for cpu, kernels in cases.items():
        monkeypatch.setattr(probes, "cpu_vendor", lambda cpu=cpu: cpu)
        assert probes.cpu_rule(torch.float32, every).kernels == kernels
        assert probes.cpu_rule(torch.float32, every) == probes.cpu_rule(torch.float32, every)
    monkeypatch.setattr(probes, "cpu_vendor", lambda: ("AuthenticAMD", frozenset({"avx512f"})))
    assert probes.cpu_rule(torch.float32, ("torch",)).kernels == ("torch",) * 4  # no numpy OpenBLAS, no oneDNN
    assert probes.cpu_rule(torch.float64, ("torch", "openblas")).kernels == ("openblas",) * 4  # no float64 oneDNN


def test_a_run_never_times_a_float_product(monkeypatch):
    """Deciding the float products' kernels in a run times nothing: the timed probe is refdec machine's."""
    monkeypatch.setattr(probes, "interleaved", lambda *a, **k: pytest.fail("a run timed a kernel"))
    probes.forget(read_report=False)
    try:
        route = on_route(copy_model().float(), "fast")
        with torch.inference_mode():
            decode_greedy(route, random_src(0, 3, 16, max_len=9), max_len=12)
        assert probes.decided.float_plans
        assert all(not plan.timings for plan in probes.decided.float_plans.values())
    finally:
        probes.forget()


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_row_classes(rows):
    assert probes.ROW_CLASSES[probes.row_class(rows)] == {1: "1", 4: "2-7", 16: "8-31", 64: "32+"}[rows]


def test_a_machine_report_fixes_the_kernels(tmp_path):
    """A plan a machine report records is taken as it is, and a kernel it names that is not there is torch's."""
    key = {"d_model": 48, "d_ff": 192, "vocab": 80, "threads": torch.get_num_threads(), "dtype": "float32"}
    plan = {"kernels": {"1": "openblas", "2-7": "torch", "8-31": "onednn", "32+": "torch"}, "why": "chosen"}
    report = {
        "command": probes.MACHINE_REPORT,
        "decisions": {"machine": probes.this_machine(), "float_products": [{**key, **plan}]},
    }
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(report))
    probes.forget(read_report=False)
    try:
        assert probes.read_machine_report(str(path)) == 1
        w = products.FloatWeight(torch.randn(48, 80), (48, 192, 80))
        available = products.available(torch.float32)
        for rows, kernel in ((1, "openblas"), (5, "torch"), (20, "onednn"), (50, "torch")):
            assert w.kernel(rows, torch.zeros(rows, 48)) == (kernel if kernel in available else "torch")
        assert probes.recorded()["float_products"][0]["kernels"] == plan["kernels"]
        assert probes.found()["float_products"][
            f"d_model 48, d_ff 192, vocabulary 80, float32, {key['threads']} thread(s)"
        ]["why"].endswith("chosen")
        bad = json.loads(path.read_text())
        bad["decisions"]["float_products"][0]["kernels"]["1"] = "cublas"
        path.write_text(json.dumps(bad))
        with pytest.raises(Exception, match="cannot be read"):
            probes.read_machine_report(str(path))
    finally:
        probes.forget()


@pytest.mark.parametrize("kernel", FLOAT64_KERNELS)
def test_lossless_decoders_equal_greedy_on_each_kernel(kernel, forced, monkeypatch):
    """Every lossless decoder on the fast route equals its greedy (float64, torch.equal) with the products
    on each kernel that computes float64 here (check_lossless_decoders), at batch 1 and 5."""
    forced(kernel)
    for batch in (1, 5):
        check_lossless_decoders(lambda m: on_route(m, "fast"), batch, monkeypatch)


@pytest.mark.parametrize("kernel", products.available(torch.float32))
def test_float32_iad_equals_greedy_on_each_kernel(kernel, forced):
    """In float32 on the copying model (wide logit margins), IAD on the fast route writes its greedy's tokens
    with the products on each kernel, and the route's logits stay within float32 rounding of the reference's."""
    forced(kernel)
    model = copy_model().float()
    route = on_route(model, "fast")
    src = random_src(7, 6, 16, min_len=2, max_len=14)
    with torch.inference_mode():
        greedy = decode_greedy(route, src, max_len=30).tokens
        assert [t.tolist() for t in decode_iad(route, src, max_len=30).tokens] == [t.tolist() for t in greedy]
        tgt = torch.cat([torch.ones(6, 1, dtype=torch.long), src[:, :10].clamp_min(5)], 1)
        assert (route(src, tgt) - model(src, tgt)).abs().max() < 1e-3


def test_two_runs_take_the_same_kernels(tmp_path):
    """decode.py --fast run twice with a machine report forcing one kernel, then twice with another: each
    run's report says it took the kernels forced, and the two runs of one command write the same file."""
    available = products.available(torch.float32)
    choices = [k for k in ("openblas", "onednn") if k in available][:1] + ["torch"]
    outputs = {}
    for kernel in choices:
        plan = {
            "d_model": 192,
            "d_ff": 768,
            "vocab": 8000,
            "threads": 1,
            "dtype": "float32",
            "kernels": dict.fromkeys(probes.ROW_CLASSES, kernel),
            "why": "forced",
        }
        report = tmp_path / f"machine-{kernel}.json"
        decisions = {"machine": probes.this_machine(), "float_products": [plan]}
        report.write_text(json.dumps({"command": probes.MACHINE_REPORT, "decisions": decisions}))
        for run in (1, 2):
            out, rep = tmp_path / f"{kernel}-{run}.txt", tmp_path / f"{kernel}-{run}.json"
            cmd = [sys.executable, "decode.py", "--algo", "iad", "--task", "gec-uk", "--model",
                   "checkpoints/gec-uk-6x6/model.pt", "--limit", "12", "--batch-size", "4", "--fast",
                   "--threads", "1", "--quiet", "--output", str(out), "--report", str(rep)]  # fmt: skip
            env = {**os.environ, probes.REPORT_VARIABLE: str(report)}
            subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
            taken = json.loads(rep.read_text())["environment"]["probes"]
            assert taken["read_from"] == str(report)
            (entry,) = [v for k, v in taken["float_products"].items() if k.startswith("d_model 192,")]
            assert set(entry["kernels"].values()) == {kernel} and entry["why"].startswith("as ")
            outputs[kernel, run] = out.read_bytes()
        assert outputs[kernel, 1] == outputs[kernel, 2]
