"""refdec.commands.ctranslate2: a refdec checkpoint converted by CTranslate2's own converter decodes as refdec
does, and the comparison command runs end to end.

A tiny random checkpoint with a trained byte-level tokenizer (nothing downloaded). The conversion
test guards against the two settings of CTranslate2's stock Pegasus loader that break refdec's
models: a post-norm model (normalize_before missing from transformers 5's config) and the decoder
started at pad instead of bos; either one changes the greedy outputs.
"""

from __future__ import annotations

import builtins
import json

import pytest
import torch
from conftest import TEXTS, random_checkpoint, run_py

from refdec.checkpoint import load_model
from refdec.data import source_tensor
from refdec.decoding import decode_greedy
from refdec.machine import int8_products_fast, usable_cores

pytestmark = pytest.mark.slow  # transformers, CTranslate2 and a command in a subprocess


@pytest.mark.parametrize("eos_bias", [0.0, 14.0])
def test_converted_model_greedy_equals_refdec_greedy_in_float32(tmp_path, eos_bias):
    ctranslate2 = pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from refdec.commands import ctranslate2 as ct2

    ckpt = random_checkpoint(tmp_path / "ckpt", eos_bias=eos_bias)
    model, tok, _ = load_model(ckpt)
    folder, conversion = ct2.convert(ckpt, model, tok, tmp_path / "cache")
    assert conversion["cached"] is False and conversion["max_logit_difference"] < 1e-12
    assert ct2.convert(ckpt, model, tok, tmp_path / "cache") == (folder, {"cached": True})
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32", intra_threads=1)
    algo = ct2.ct2_algorithm(translator, ct2.vocabulary(folder, model.cfg.vocab_size), "ct2-float32")
    ids = [tok.encode(t) for t in TEXTS]
    for batch in ([ids[0]], ids[:3], ids):  # batch 1 and padded batches
        src = source_tensor(batch, model.cfg.eos_id, model.cfg.pad_id)
        for max_len in (3, 24):
            ours = decode_greedy(model, src, max_len=max_len)
            theirs = algo.decoder(model, src, max_len=max_len)
            assert [o.tolist() for o in theirs.tokens] == [o.tolist() for o in ours.tokens]
            assert (theirs.stats.tokens, theirs.stats.hit_max_len) == (ours.stats.tokens, ours.stats.hit_max_len)
    assert 0 < ours.stats.hit_max_len < len(ids) if eos_bias else ours.stats.hit_max_len == len(ids)


def test_command_writes_report(tmp_path):
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    ckpt = random_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:5]) + "\n", encoding="utf-8")
    report = tmp_path / "r.json"
    r = run_py(
        "-m",
        "refdec",
        "ctranslate2",
        "--task",
        "mt-en-de",
        "--model",
        str(ckpt),
        "--input",
        str(tmp_path / "in.txt"),
        "--batch-sizes",
        "2",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--iad",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--report",
        str(report),
    )
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "ct2-greedy-float32 b2" in out and "identical to refdec-greedy b1" in out
    rep = json.loads(report.read_text())
    assert rep["model"] == str(ckpt) and rep["batch_sizes"] == [1, 2] and rep["threads"] == [1]
    assert rep["conversion"]["cached"] is False and rep["interrupted"] is False
    assert rep["environment"]["allocator"] in ("keep", "system")  # keep (the default) where glibc allows it
    assert rep["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rep["environment"]["threads"] == [1] and "CPU capability" in out
    rows = rep["results"][0]["rows"]
    names = [row["algo"] for row in rows]
    assert names == [
        f"{m} b{b}" for b in (1, 2) for m in ("refdec-greedy", "refdec-iad", "ct2-greedy-float32", "ct2-greedy-int8")
    ]
    for row in rows:
        assert {"ms_per_token", "sent_per_s", "identical", "differing", "tokens", "threads"} <= set(row)
        assert row["n"] == 5 and row["tokens"] > 0
    by_name = {row["algo"]: row for row in rows}
    for name in ("refdec-iad b1", "refdec-iad b2", "ct2-greedy-float32 b1"):
        assert by_name[name]["identical"] == 1.0 and by_name[name]["differing"] == []
    for size in (1, 2):  # CTranslate2's float32 scores are refdec's log-probabilities of the same tokens
        gap = by_name[f"ct2-greedy-float32 b{size}"]["logprob_gap"]
        assert gap["lines"] == 5 and gap["max"] < 1e-5, gap
    assert "logprob_gap" not in by_name["refdec-greedy b1"] and "largest difference" in out
    # again from the cache, with the fast route's runs and the int8 route's on it, one decoder step's
    # cost per route, a token budget, IAD at two draft limits, and CTranslate2 on one thread while
    # refdec has two (making a translator sets the calling thread's OpenMP count, which torch reads)
    threads = min(2, usable_cores())
    r = run_py(
        "-m",
        "refdec",
        "ctranslate2",
        "--task",
        "mt-en-de",
        "--model",
        str(ckpt),
        "--input",
        str(tmp_path / "in.txt"),
        "--threads",
        str(threads),
        "--warmup",
        "1",
        "--iad",
        "--fast",
        "--int8",
        "--step-cost",
        "--batch-tokens",
        "40",
        "--max-draft",
        "0,3",
        "--allocator",
        "system",
        "--ct2-threads",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--report",
        str(report),
    )
    assert r.returncode == 0, r.stderr.decode()
    rep = json.loads(report.read_text())
    assert rep["conversion"]["cached"] is True and rep["fast"] is True and rep["int8"] is True
    assert rep["environment"]["allocator"] == "system" and rep["ct2_threads"] == 1
    assert ("int8 products are slow on this CPU" in r.stderr.decode()) == (not int8_products_fast())  # --int8
    assert f"{threads} thread(s) (CTranslate2 1)" in r.stdout.decode()
    for row in rep["results"][0]["rows"]:
        assert row["threads"] == (1 if row["algo"].startswith("ct2") else threads), row["algo"]
    rows = {row["algo"]: row for row in rep["results"][0]["rows"]}
    assert {"refdec-greedy-fast b1", "refdec-iad-fast b1", "refdec-iad-draft3-fast b1", "ct2-greedy-int8 t40"} <= set(
        rows
    )
    assert rows["refdec-greedy-fast b1"]["tokens"] == rows["refdec-greedy b1"]["tokens"]
    for name in ("refdec-iad-fast-int8 b1", "refdec-iad-draft3-fast-int8 t40", "refdec-greedy-fast-int8 t40"):
        assert rows[name]["int8_greedy"] == "refdec-greedy-fast-int8 b1"
        assert rows[name]["identical_int8_greedy"] == 1.0 and rows[name]["differing_int8_greedy"] == []
    assert "int8_greedy" not in rows["refdec-greedy-fast-int8 b1"] and "identical" in rows["refdec-greedy-fast-int8 b1"]
    for name in ("refdec-iad-draft3 t40", "refdec-iad-fast t40", "ct2-greedy-float32 t40"):
        assert rows[name]["batch_tokens"] == 40 and rows[name]["batch_size"] is None
        assert rows[name]["identical"] == 1.0 and rows[name]["n"] == 5
    assert rep["batch_tokens"] == [40] and rep["max_draft"] == [0, 3]
    steps = rep["results"][0]["step_ms"]
    assert set(steps) == {
        "refdec",
        "refdec-fast",
        "refdec-fast-int8",
        "refdec-fast-products",
        "ct2-float32",
        "ct2-int8",
    }
    assert steps["refdec-fast-products"] < steps["refdec-fast"]  # a part of the step
    assert all(ms > 0 for name, ms in steps.items() if name.startswith("refdec"))
    assert "one decoder step" in r.stdout.decode()


def test_missing_ctranslate2_is_one_line_error(tmp_path, monkeypatch, capsys):
    from refdec.commands import ctranslate2 as ct2

    real_import = builtins.__import__

    def no_ctranslate2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError("No module named 'ctranslate2'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ctranslate2)
    code = ct2.main(["--task", "mt-en-de", "--model", str(tmp_path / "model.pt"), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: this needs the ctranslate2 package (pip install ctranslate2==")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-draft", "4"], "error: --max-draft has no effect without --iad"),
        (["--threads", "1,100000"], "error: --threads 100000: must be between 1 and the"),
        (["--limit", "0"], "error: --limit must be at least 1"),
        (["--ct2-threads", "0"], "error: --ct2-threads 0: must be between 1 and the"),
        (["--ct2-threads", "100000"], "error: --ct2-threads 100000: must be between 1 and the"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, flags, message):
    from refdec.commands import ctranslate2 as ct2

    code = ct2.main(["--task", "mt-en-de", "--model", str(tmp_path / "model.pt"), "--cache-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(message)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--iad", "--max-draft", "4,-1"], "give numbers of at least 0"),
        (["--batch-tokens", "0"], "give numbers of at least 1"),
    ],
)
def test_bad_lists_are_refused_by_the_parser(tmp_path, capsys, flags, message):
    from refdec.commands import ctranslate2 as ct2

    with pytest.raises(SystemExit) as stop:
        ct2.main(["--task", "mt-en-de", "--model", str(tmp_path / "model.pt"), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
