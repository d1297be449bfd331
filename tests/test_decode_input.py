"""What decode.py reads and how: bytes that are not UTF-8 (--bad-lines), tabs and control characters, text
piped to a run without --input, a --batch-tokens budget larger than memory holds, and the int8 warning's
measured slowdown. Each test names the case it guards."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import AVX512_FLAGS, REPO, TEXTS, ZEN3_FLAGS, fake_cpu, one_line_error, random_checkpoint

from refdec.errors import UsageError

DECODE = [sys.executable, "-m", "refdec", "decode", "--task", "mt-en-de", "--threads", "1", "--quiet"]
PIPED = (
    "error: text was piped to stdin, but without --input the task's test set is decoded; give --input - to decode it"
)


def decode_in_process(ckpt, path, *args: str) -> list[str]:
    """decode.main on `path` with the random checkpoint, the output lines (read back from --output)."""
    from refdec.commands import decode

    out = path.parent / "out.txt"
    argv = ["--task", "mt-en-de", "--model", str(ckpt), "--input", str(path), "--max-len", "6", "--warmup", "0"]
    assert decode.main([*argv, "--quiet", "--output", str(out), *args]) == 0
    return out.read_text(encoding="utf-8").split("\n")[:-1]


# -- --bad-lines ------------------------------------------------------------------------------------------


def test_bad_bytes_are_refused_naming_the_flag_or_replaced_with_one_warning(tmp_path, capsys):
    """Case: one invalid UTF-8 byte anywhere refused the whole file, and nothing said how to decode the rest.
    Every other command's message is unchanged; decode's names `--bad-lines replace`, which decodes each
    invalid sequence as U+FFFD with one warning naming every such line, and keeps every line."""
    from refdec.data import read_lines

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\ncaf\xe9\r\nfine\n\xff\xfe tail\nlast")
    with pytest.raises(UsageError, match=r"line 2 is not valid UTF-8 \(byte 0xe9 at column 4\)$"):
        read_lines(bad)
    with pytest.raises(UsageError, match=r"line 2 .*; `--bad-lines replace` decodes the rest with U\+FFFD"):
        read_lines(bad, bad_lines="fail")
    capsys.readouterr()
    assert read_lines(bad, bad_lines="replace") == ["ok", "caf\ufffd", "fine", "\ufffd\ufffd tail", "last"]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: {bad}: 2 line(s) hold bytes that are not valid UTF-8, decoded with U+FFFD in their place: "
        "line(s) 2, 4"
    ]
    many = tmp_path / "many.txt"
    many.write_bytes(b"\xff\n" * 25)
    assert read_lines(many, bad_lines="replace") == ["\ufffd"] * 25
    assert capsys.readouterr().err.rstrip().endswith(": line(s) " + ", ".join(map(str, range(1, 21))) + ", ...")


def test_decode_replaces_bad_bytes_and_keeps_every_line(tmp_path, capsys):
    """decode.py --bad-lines replace: one output line per input line, a warning naming the line; without
    the flag one line of error naming it."""
    from refdec.commands import decode

    ckpt = random_checkpoint(tmp_path / "ckpt")
    src = tmp_path / "in.txt"
    src.write_bytes(TEXTS[0].encode() + b"\n\xe9t\xe9\n" + TEXTS[1].encode() + b"\n")
    assert len(decode_in_process(ckpt, src, "--bad-lines", "replace")) == 3
    assert "1 line(s) hold bytes that are not valid UTF-8, decoded with U+FFFD" in capsys.readouterr().err
    argv = ["--task", "mt-en-de", "--model", str(ckpt), "--input", str(src), "--output", str(tmp_path / "o.txt")]
    assert decode.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2 is not valid UTF-8" in err and "--bad-lines replace" in err


def test_bad_lines_sits_after_input_in_the_help():
    from refdec.commands.decode import build_parser

    help_text = build_parser().format_help()
    assert help_text.index("--input") < help_text.index("--bad-lines {fail,replace}") < help_text.index("--ref")


# -- tabs and control characters ----------------------------------------------------------------------------


def test_tabs_and_control_characters_are_spaces_before_tokenising(tmp_path, capsys):
    """Case: "This sentence\\thas" gave another output than "This sentence has": the tab became a byte token
    the models never saw. Every tab and control character (Unicode Cc) is a space before tokenising, one
    note names the lines (the first 20), a line of control characters alone is empty."""
    from refdec.app.inputs import source_ids
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    lines = ["This sentence has", "This sentence\thas", "This\x0bsentence\x85has", "\x07\x1b", "plain"]
    ids = source_ids(tok, lines, 128)
    assert ids[1] == ids[0] == tok.encode("This sentence has") and ids[2] == ids[0] and ids[3] is None
    assert capsys.readouterr().err.splitlines() == [
        "note: 3 input line(s) hold tabs or control characters, replaced by spaces before tokenising (the shipped "
        "models were trained on text without them): line(s) 2, 3, 4"
    ]
    source_ids(tok, ["a\tb"] * 21, 128)
    assert capsys.readouterr().err.rstrip().endswith(", 20, ...")
    source_ids(tok, ["Grüße, 🍕\u00a0\u200b ok"], 128)  # not Cc: read as they are, no note
    assert capsys.readouterr().err == ""


def test_a_tab_decodes_as_a_space(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt")
    src = tmp_path / "in.txt"
    src.write_text("This sentence\thas\nThis sentence has\n", encoding="utf-8")
    out = decode_in_process(ckpt, src)
    assert len(out) == 2 and out[0] == out[1]


# -- text piped without --input ----------------------------------------------------------------------------


def run_decode(*args: str, **stdin) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DECODE, *args],
        cwd=REPO,
        capture_output=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **stdin,
    )


@pytest.mark.slow
def test_text_piped_without_input_is_refused_and_an_idle_stdin_is_not(tmp_path):
    """Case: `echo hi | refdec decode --task mt-en-de` decoded the shipped test set and left the text unread.
    Text piped (or redirected from a file) without --input is one line naming --input -, exit 2; /dev/null,
    an empty pipe, an empty file and a pipe that is open but never written (as CI leaves stdin) go on."""
    assert one_line_error(run_decode("--limit", "1", input=b"hi\n")) == PIPED
    (tmp_path / "text.txt").write_text("hi\n")
    (tmp_path / "empty.txt").write_text("")
    with open(tmp_path / "text.txt", "rb") as f:
        assert one_line_error(run_decode("--limit", "1", stdin=f)) == PIPED
    # each idle stdin reaches the next check (an --output in a missing folder), never the piped refusal
    later = ["--output", str(tmp_path / "missing" / "out.txt")]
    read_end, write_end = os.pipe()
    try:
        never_written = run_decode(*later, stdin=read_end)
    finally:
        os.close(read_end), os.close(write_end)
    with open(tmp_path / "empty.txt", "rb") as f:
        empty_file = run_decode(*later, stdin=f)
    for r in (run_decode(*later, stdin=subprocess.DEVNULL), run_decode(*later, input=b""), never_written, empty_file):
        assert "does not exist" in one_line_error(r)
    # and one whole run with stdin at /dev/null
    r = run_decode("--limit", "3", "--max-len", "4", "--warmup", "0", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) >= 3, r.stderr.decode()


def test_the_piped_check_reads_only_what_is_there(monkeypatch):
    """check_no_piped_text in-process: --input given, or a stdin that is not a pipe or file, is never read."""
    from refdec.app import inputs

    monkeypatch.setattr(inputs.os, "read", lambda *a: pytest.fail("read"))
    inputs.check_no_piped_text("-")
    inputs.check_no_piped_text("in.txt")
    monkeypatch.setattr(inputs.os, "fstat", lambda fd: SimpleNamespace(st_mode=0o020666))  # a character device
    inputs.check_no_piped_text(None)


# -- --batch-tokens against memory -------------------------------------------------------------------------


def budget_run(batch_tokens: int, batch_size: int = 0, beams: int = 1):
    from refdec.app import runner
    from refdec.app.algorithms import ALGORITHMS
    from refdec.app.loading import Models
    from refdec.config import ModelConfig

    cfg = ModelConfig(vocab_size=8000, d_model=192, n_heads=4, d_ff=768, enc_layers=6, dec_layers=6)
    models = Models(SimpleNamespace(cfg=cfg), REPO / "fake.pt")
    algo, options = (ALGORITHMS["beam"], {"beam_size": beams}) if beams > 1 else (ALGORITHMS["greedy"], {})
    return runner.Run(algo, options, models, batch_size=batch_size, batch_tokens=batch_tokens)


def test_a_token_budget_larger_than_memory_is_cut_to_what_fits(monkeypatch, capsys):
    """Case: --batch-tokens 100000000 ran without a word, much slower than a budget that fits. The most
    memory a batch within the budget can need (any source length the model takes) is checked against 80% of
    what is free: the budget is cut to the largest that fits, with one warning naming both and why; a budget
    that fits, or a machine whose free memory is unknown, is left as it is."""
    from refdec.app import runner
    from refdec.app.runner.memory import budget_bytes

    free = 2**31
    monkeypatch.setattr(runner.memory, "available_memory", lambda: free)
    ids = [[7] * 20 for _ in range(50)]
    run = budget_run(100_000_000)
    runner.check_fits(run, ids, None, 256, torch.float32)
    fit = run.batch_tokens
    assert 1 < fit < 100_000_000
    assert budget_bytes(run, fit, None, 256, 4)[0] <= 0.8 * free < budget_bytes(run, fit + 1, None, 256, 4)[0]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: greedy: a token budget of 100000000 lets a batch need")
    assert f"decoding with a budget of {fit} tokens, the most that fits" in err[0] and "80% of what is free" in err[0]
    runner.check_fits(run, ids, None, 256, torch.float32)  # the cut budget fits: no second word
    assert capsys.readouterr().err == "" and run.batch_tokens == fit
    capped = budget_run(100_000_000, batch_size=8)  # --batch-size caps the rows: the budget never mattered
    runner.check_fits(capped, ids, None, 256, torch.float32)
    assert capped.batch_tokens == 100_000_000 and capsys.readouterr().err == ""
    monkeypatch.setattr(runner.memory, "available_memory", lambda: None)
    unknown = budget_run(100_000_000)
    runner.check_fits(unknown, ids, None, 256, torch.float32)
    assert unknown.batch_tokens == 100_000_000 and capsys.readouterr().err == ""


def test_the_batch_size_and_beam_refusals_stand(monkeypatch):
    from refdec.app import runner

    monkeypatch.setattr(runner.memory, "available_memory", lambda: 2**26)
    ids = [[7] * 50 for _ in range(4000)]
    with pytest.raises(UsageError, match="sentences per batch"):
        runner.check_fits(budget_run(0, batch_size=4000), ids, None, 128, torch.float32)
    with pytest.raises(UsageError, match="beams"):
        runner.check_fits(budget_run(0, batch_size=1, beams=64), ids[:1], None, 128, torch.float32)


# -- the int8 warning --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu, warned", [(("AVX2", ZEN3_FLAGS), True), (("AVX512", AVX512_FLAGS), False)])
def test_the_int8_warning_gives_the_slowdown_measured_here(cpu, warned, monkeypatch):
    """Case: the warning said "several times slower" whatever this machine did, and not that an int8 run
    reproduces int8 greedy rather than float32 greedy. It now gives the slowdown measured here (kept per
    thread count), and says which greedy the int8 route equals; a CPU with AVX-512 is not warned."""
    from refdec import machine
    from refdec.routes import probes

    fake_cpu(monkeypatch, *cpu)
    monkeypatch.setattr(probes.decided, "slowdowns", {torch.get_num_threads(): 7.94})
    warning = machine.int8_warning("cpu", "decode with --fast")
    if not warned:
        assert warning is None
        return
    assert "int8 products measured 7.9x slower than float32 here (one 17 x 256 by 256 x 1024 product)" in warning
    assert "equals int8 greedy (the int8 route's own greedy), not float32 greedy" in warning
    assert f"CPU capability {cpu[0]}" in warning and warning.endswith("; decode with --fast") and "\n" not in warning
    monkeypatch.setattr(probes.decided, "slowdowns", {torch.get_num_threads(): 0.25})  # flags and timing disagree
    assert "yet int8 products measured 4.0x faster than float32 here" in machine.int8_warning("cpu", "x")


def test_the_int8_slowdown_is_measured_once_and_kept(monkeypatch):
    from refdec.routes import probes

    monkeypatch.setattr(probes, "decided", probes.Decisions(environment_read=True))
    first = probes.int8_slowdown()
    assert first > 0 and probes.decided.slowdowns == {torch.get_num_threads(): first}
    monkeypatch.setattr(probes, "race", lambda *a, **k: pytest.fail("measured twice"))
    assert probes.int8_slowdown() == first
