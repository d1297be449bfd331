"""decode.py's contract: N lines in, N lines out, one-line errors, a complete JSON report."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import REPO, fake_models, one_line_error, run_py

DECODE = ["decode.py", "--task", "mt-en-de", "--threads", "1", "--quiet"]


def decode(ckpt, *args, stdin=None):
    return run_py(*DECODE, "--model", str(ckpt / "model.pt"), *args, stdin=stdin)


@pytest.mark.slow
def test_every_input_line_gets_an_output_line(trained_tiny, tmp_path):
    """Guards against lost or shifted lines: empty lines, whitespace-only lines, an overlong line
    (warning, still decoded) and ordinary lines give exactly one output line each, in order."""
    lines = ["The file is open.", "", "   ", "word " * 400, "Click OK.", ""]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = decode(trained_tiny, "--algo", "greedy", "--input", str(inp), "--max-len", "5")
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[1] == "" and out[2] == "" and out[5] == ""
    assert "warning: input line 4" in r.stderr.decode()


@pytest.mark.slow
def test_stdin_and_output_file(trained_tiny, tmp_path):
    """Guards against --input - and --output being parsed but not honoured."""
    out = tmp_path / "out.txt"
    r = decode(
        trained_tiny, "--algo", "greedy", "--input", "-", "--output", str(out), "--max-len", "4", stdin=b"One.\nTwo.\n"
    )
    assert r.returncode == 0, r.stderr.decode()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    assert b"greedy" in r.stdout  # the table goes to stdout when outputs go to a file


@pytest.mark.slow
def test_report_and_compare(trained_tiny, tmp_path):
    """Guards against the report missing the keys the benchmarks read, and against --compare
    greedy not reproducing beam(1)."""
    rep = tmp_path / "r.json"
    r = decode(
        trained_tiny,
        "--algo",
        "beam",
        "--beam-size",
        "1",
        "--limit",
        "6",
        "--compare",
        "greedy",
        "--report",
        str(rep),
        "--max-len",
        "12",
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    for key in (
        "algo",
        "task",
        "n",
        "seconds",
        "tokens",
        "verifier_calls",
        "drafter_calls",
        "tokens_per_call",
        "bleu",
        "chrf",
    ):
        assert key in report, key
    assert report["n"] == 6 and report["algo"] == "beam"
    assert set(report["compare"]) >= {"algo", "seconds", "speed_vs_first", "identical", "bleu"}
    assert report["compare"]["identical"] == 1.0
    assert report["environment"]["threads"] == 1 and report["environment"]["threads_auto"] is False
    assert report["environment"]["allocator"] in ("keep", "system")  # keep (the default) where glibc allows it
    assert len(r.stdout.decode().splitlines()) == 6


@pytest.mark.slow
def test_token_budget_batches_write_the_batch_one_output(trained_tiny, tmp_path):
    """Guards --batch-tokens end to end: a budget for every run (--batch-size as its cap) and a compared
    run's own budget write what greedy at batch 1 writes, and the report says which run had which."""
    rep, out = tmp_path / "r.json", tmp_path / "out.txt"
    r = decode(
        trained_tiny,
        "--algo",
        "greedy",
        "--limit",
        "12",
        "--max-len",
        "12",
        "--batch-tokens",
        "60",
        "--batch-size",
        "5",
        "--compare",
        "greedy:batch-size=1,greedy:batch-tokens=200",
        "--report",
        str(rep),
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    runs = {row["algo"]: row for row in report["runs"]}
    assert (runs["greedy"]["batch_size"], runs["greedy"]["batch_tokens"]) == (5, 60)
    assert runs["greedy:batch-size=1"]["batch_size"] == 1 and "batch_tokens" not in runs["greedy:batch-size=1"]
    assert (
        runs["greedy:batch-tokens=200"]["batch_size"] is None and runs["greedy:batch-tokens=200"]["batch_tokens"] == 200
    )
    assert report["batch_tokens"] == 60 and all(row["n"] == 12 for row in report["runs"])
    assert [row["identical"] for row in report["runs"][1:]] == [1.0, 1.0]  # each against the first run's output
    assert len(out.read_text(encoding="utf-8").splitlines()) == 12


def test_gec_report_has_f05():
    """Guards against GEC tasks missing the edit-level F0.5."""
    from refdec.app.report import scores

    s = scores("gec", ["a b c"], ["a x c"], [["a x c"]])
    assert s["gec_f05"] == 1.0 and "bleu" in s


@pytest.mark.slow
def test_trace_prints_per_sentence(trained_tiny):
    """Guards against --trace being accepted but printing nothing."""
    r = decode(trained_tiny, "--algo", "greedy", "--limit", "2", "--trace", "--max-len", "6")
    assert r.returncode == 0
    assert "[1]" in r.stderr.decode() and "[2]" in r.stderr.decode()


@pytest.mark.slow
def test_iad_beside_greedy_and_another_checkpoint(trained_tiny, tmp_path):
    """Guards the comparison machinery the IAD benchmark reads: several --compare runs, one on another
    checkpoint, the speedup matrix, the lossless check against greedy of the same model (with its
    divergence list); no edit-ratio buckets on translation, where the output is not an edit of the
    input (test_edit_ratio_buckets_for_gec has them)."""
    other = tmp_path / "other"
    shutil.copytree(trained_tiny, other)
    rep = tmp_path / "r.json"
    r = decode(
        trained_tiny,
        "--algo",
        "iad",
        "--compare",
        f"greedy,beam@{other / 'model.pt'}",
        "--limit",
        "6",
        "--max-len",
        "12",
        "--dtype",
        "float64",
        "--report",
        str(rep),
        "--max-draft",
        "4",
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    assert [row["algo"] for row in report["runs"]] == [
        "iad@" + trained_tiny.name,
        "greedy@" + trained_tiny.name,
        "beam@other",
    ]
    assert len(report["speedup_matrix"]) == 3 and report["options"]["max_draft"] == 4
    (check,) = report["lossless_checks"]
    assert check["identical"] == 1.0 and check["divergences"] == []
    assert "edit_buckets" not in check
    err = r.stderr.decode()
    assert "speedup of row over column" in err and "0 line(s) differ" in err and "edit ratio" not in err
    assert len(r.stdout.decode().splitlines()) == 6


def heads_file(folder, base, weights=None):
    """Random proposal heads (k = 3) in `folder`/model.pt on the model of checkpoint `base`: stored alone,
    naming `base` as their frozen base (train.py --freeze-base), or with the model `weights` holds."""
    from refdec.checkpoint import file_sha256, save_atomic
    from refdec.proposal import ProposalHeads, proposal_state

    raw = torch.load(weights or base, weights_only=True)
    torch.manual_seed(0)
    raw["proposal"] = proposal_state(ProposalHeads(raw["model_config"]["d_model"], 16, 3))
    if weights is None:
        del raw["model"]
        raw["frozen_base"] = {"path": f"../{base.parent.name}/model.pt", "sha256": file_sha256(base)}
    folder.mkdir()
    save_atomic(raw, folder / "model.pt")
    shutil.copy(base.parent / "tokenizer.json", folder)
    return folder / "model.pt"


def test_every_lossless_compared_run_is_checked_against_greedy_of_its_model(tmp_path, capsys):
    """Case: `--algo greedy --compare iad,blockwise@HEADS` printed "0 line(s) differ" and a lossless_checks
    entry for iad alone. Heads stored alone on a frozen base decode with a second load of the base's
    weights, which greedy reads from the base's file: one model, so blockwise is checked against that
    greedy too. Heads on other weights, which no greedy run decodes with, get a line saying so."""
    from conftest import TEXTS, random_checkpoint

    from refdec.commands import decode as decode_cli

    base = random_checkpoint(tmp_path / "base")
    heads = heads_file(tmp_path / "heads", base)
    other = heads_file(tmp_path / "other", base, weights=random_checkpoint(tmp_path / "weights", seed=1))
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:3]) + "\n", encoding="utf-8")
    assert (
        decode_cli.main(
            [
                "--task",
                "mt-en-de",
                "--model",
                str(base),
                "--algo",
                "greedy",
                "--compare",
                f"iad,blockwise@{heads},blockwise@{other}",
                "--input",
                str(tmp_path / "in.txt"),
                "--max-len",
                "8",
                "--warmup",
                "0",
                "--quiet",
                "--output",
                str(tmp_path / "out.txt"),
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "r.json").read_text())
    checks = {c["algo"]: c for c in report["lossless_checks"]}
    assert set(checks) == {"iad@base", "blockwise@heads"} and checks["blockwise@heads"]["greedy"] == "greedy@base"
    assert checks["blockwise@heads"]["identical"] == 1.0 and checks["blockwise@heads"]["divergences"] == []
    out = capsys.readouterr().out
    assert "iad@base vs greedy@base: 1.0000 identical, 0 line(s) differ" in out
    assert "blockwise@heads vs greedy@base: 1.0000 identical, 0 line(s) differ" in out
    assert "blockwise@other: not checked against greedy: no greedy run here decodes with its model" in out


def test_edit_ratio_buckets_for_gec():
    """On a GEC task a lossless run beside greedy at batch size 1 gets its speedup by edit ratio,
    every sentence in one bucket."""
    from refdec.app import report, runner
    from refdec.app.algorithms import ALGORITHMS
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.load(REPO / "checkpoints" / "gec-uk" / "tokenizer.json")
    lines = ["Це речення без помилок.", "Друге речення тут.", "Третє."]
    models = fake_models()
    runs = [runner.Run(ALGORITHMS[name], {}, models) for name in ("iad", "greedy")]
    for r, secs in zip(runs, (0.1, 0.4)):
        r.outputs = [torch.tensor(tok.encode(s)) for s in lines]
        r.times, r.calls, r.seconds = [secs] * 3, [1] * 3, 3 * secs
        r.stats.sentences = 3
    summary = report.summarise("gec-uk", runs, lines, [lines], [tok.encode(s) for s in lines], tok, "cpu")
    (check,) = summary.checks
    assert check["identical"] == 1.0 and [b["sentences"] for b in check["edit_buckets"]] == [3]
    assert check["edit_buckets"][0]["speedup"] == pytest.approx(4.0) and "edit ratio" in summary.text
    from refdec.app.htmlreport import chart_edit_buckets

    assert "<svg" in chart_edit_buckets(summary.checks)  # the --html page's chart of it


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo,flags",
    [
        ("gad", ["--drafter", "{drafter}"]),
        ("blockwise", ["--model", "{heads}"]),
        ("bild", ["--small", "{tiny}", "--fallback-threshold", "2"]),
        ("speculative", ["--small", "{tiny}", "--gamma", "3"]),
    ],
)
def test_drafter_heads_and_small_model_algorithms_reproduce_greedy(trained_tiny, tiny_extras, tmp_path, algo, flags):
    """Guards decode.py's wiring of the drafter, the proposal heads and the small model: in their
    lossless settings (BiLD: falling back at every step) the outputs are greedy's, in float64."""
    paths = {"drafter": tiny_extras["drafter"], "heads": tiny_extras["heads"], "tiny": trained_tiny / "model.pt"}
    flags = [e.format(**paths) for e in flags]
    rep = tmp_path / "r.json"
    args = [
        "--algo",
        algo,
        "--compare",
        "greedy",
        "--limit",
        "4",
        "--max-len",
        "10",
        "--dtype",
        "float64",
        "--report",
        str(rep),
        "--trace",
    ]
    r = run_py(*DECODE, *(["--model", str(trained_tiny / "model.pt")] if "--model" not in flags else []), *args, *flags)
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    assert report["compare"]["identical"] == 1.0
    assert "[1]" in r.stderr.decode()


@pytest.mark.slow
def test_drafters_heads_and_small_models_are_checked(trained_tiny, tiny_extras):
    r = decode(trained_tiny, "--algo", "blockwise", "--limit", "1")
    assert "no proposal heads" in one_line_error(r)
    r = decode(trained_tiny, "--algo", "gad", "--drafter", str(trained_tiny / "model.pt"), "--limit", "1")
    assert "not a block drafter" in one_line_error(r)
    r = decode(
        trained_tiny,
        "--algo",
        "bild",
        "--small",
        str(trained_tiny / "model.pt"),
        "--limit",
        "2",
        "--sample",
        "--seed",
        "3",
        "--trace",
    )
    assert r.returncode == 0 and "S = small model" in r.stderr.decode()
    r = decode(trained_tiny, "--algo", "gad", "--limit", "1")  # the shipped drafter, on another vocabulary
    assert "does not share the tokenizer" in one_line_error(r)
    r = decode(trained_tiny, "--algo", "gad", "--drafter", str(trained_tiny / "missing.pt"), "--limit", "1")
    assert f"--drafter {trained_tiny / 'missing.pt'}: no such file or folder" in one_line_error(r)


@pytest.mark.slow
def test_compared_runs_take_their_own_options_and_small_models(trained_tiny, tmp_path):
    """A sweep in one process: each --compare entry may set its own algorithm options and small
    model after colons; the rows are told apart by them, the report keeps each run's options, and
    a lossless setting (fallback at every step) still reproduces greedy exactly."""
    tiny = str(trained_tiny / "model.pt")
    rep = tmp_path / "r.json"
    r = decode(
        trained_tiny,
        "--algo",
        "greedy",
        "--limit",
        "3",
        "--max-len",
        "8",
        "--dtype",
        "float64",
        "--report",
        str(rep),
        "--compare",
        f"bild:fallback-threshold=2:small={tiny},speculative:gamma=2:small={tiny}",
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    names = [row["algo"] for row in report["runs"]]
    assert names[1] == f"bild:fallback-threshold=2:small={trained_tiny.name}"
    assert names[2] == f"speculative:gamma=2:small={trained_tiny.name}"
    assert report["runs"][1]["identical"] == 1.0 and report["runs"][2]["identical"] == 1.0
    assert report["runs"][1]["options"]["fallback_threshold"] == 2.0
    assert report["runs"][1]["options"]["rollback_threshold"] == 2.0  # the command line's, unchanged
    assert report["runs"][2]["options"]["gamma"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,message",
    [
        ("bild:gamma=3", "not an option of bild"),
        ("bild:fallback-threshold=high", "not a float"),
        ("bild:fallback-threshold", "NAME=VALUE"),
        ("greedy:small=x.pt", "uses no small model"),
        ("bild:small=nowhere.pt", "--compare bild:small=nowhere.pt: no such file or folder"),
        ("beam:beam-size=0", "--beam-size must be at least 1"),
        ("speculative:seed=3", "--seed has no effect without --sample"),
    ],
)
def test_bad_compare_options_are_refused(trained_tiny, spec, message):
    r = decode(trained_tiny, "--algo", "greedy", "--limit", "1", "--compare", spec)
    assert message in one_line_error(r)


def test_divergences_name_position_and_margin():
    """Guards the float32 audit: a differing line is reported with its first divergent position and
    the model's top-1/top-2 margin there, computed along the greedy prefix."""
    import torch
    from conftest import tiny_model

    from refdec.app.exactness import divergences
    from refdec.decoding import decode_greedy

    m = tiny_model(1, vocab=40)
    src = [[7, 8, 9]]
    g = decode_greedy(m, torch.tensor([[7, 8, 9, 2]]), max_len=8).tokens
    wrong = [g[0].clone()]
    wrong[0][3] = (wrong[0][3] + 1) % 40
    (d,) = divergences(m, src, g, wrong, "cpu")
    assert d["line"] == 1 and d["position"] == 3 and d["greedy_token"] == g[0][3].item()
    assert d["margin_top1_top2"] >= 0 and d["gap_greedy_vs_other"] > 0
    assert divergences(m, src, g, g, "cpu") == []


def test_iad_trace_names_the_source_token_the_copy_starts_at():
    """Case: the IAD trace's "N copied from the source at token i" gave the match before the copy,
    counting the start token as 0, so the first draft of every sentence read "at token 0". It names
    where the copy starts, counting the source's tokens from 1 (its eos after the last): the drafted
    tokens are the source's from that token on."""
    from conftest import random_src, tiny_model

    from refdec.decoding import decode_iad
    from refdec.trace import how_drafted

    src = random_src(5, 4, 16, min_len=6, max_len=12)
    r = decode_iad(tiny_model(3, vocab=16), src, max_len=20, trace=True)
    drafted = 0
    for b, steps in enumerate(r.trace):
        source = [t for t in src[b].tolist() if t != 0]  # the source's tokens, its eos last
        assert how_drafted(steps[0]).startswith(f"{len(source)} copied from the source starting at its token 1, ")
        for s in (s for s in steps if s.drafted):
            start = int(re.search(r"starting at its token (\d+),", how_drafted(s)).group(1))
            assert tuple(source[start - 1 : start - 1 + len(s.drafted)]) == s.drafted, (source, how_drafted(s))
            drafted += 1
    assert drafted > len(r.trace)  # drafts after the first too


def test_gad_trace_separates_the_drafted_tokens():
    """Case: GAD's D line ran a block's tokens together ("D: thethetheg" for 4 tokens). Its tokens are
    separated by a | as greedy's are, each with the space before it, the accepted ones first."""
    from refdec.tokenizer import Tokenizer
    from refdec.trace import Step, strip_colour, trace_text

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    the, g = tok.encode("the")[0], tok.encode("g")[0]
    house, red = tok.encode("the house is red")[1], tok.encode("the house is red")[3]
    steps = [Step((the, the, the, g), 2, red, "drafter"), Step((house, tok.eos_id), 2, None, "drafter")]
    text = trace_text("gad", 0, steps, tok)
    assert "D: the|the|the|g\n" in text and "D:  house| </s>\n" in text
    assert strip_colour(trace_text("gad", 0, steps, tok, colour=True)) == text


@pytest.mark.slow
def test_iad_trace_shows_iterations(trained_tiny):
    r = decode(trained_tiny, "--algo", "iad", "--limit", "2", "--trace", "--max-len", "6")
    assert r.returncode == 0, r.stderr.decode()
    assert "[1]" in r.stderr.decode() and re.search(r"iterations? for", r.stderr.decode())


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--algo", "nope"], "invalid choice"),
        (["--algo", "greedy", "--match", "longest"], "not used by"),
        (["--algo", "iad", "--max-draft", "-1"], "at least 0"),
        (["--algo", "iad", "--compare", "greedy,nope"], "unknown algorithm"),
        (["--algo", "iad", "--compare", "beam@missing.pt"], "--compare beam@missing.pt: no such file or folder"),
        (["--algo", "bild", "--small", "x.pt", "--gamma", "2"], "not used by"),
        (["--algo", "speculative", "--small", "x.pt", "--temperature", "0"], "above 0"),
        (["--algo", "iad", "--drafter", "x.pt"], "not used by"),
        (["--algo", "blockwise", "--epsilon", "1"], "without --block-rule distance"),
        (["--algo", "bild", "--small", "x.pt", "--top-p", "0.5"], "without --sample"),
        (["--algo", "greedy", "--beam-size", "3"], "not used by"),
        (["--algo", "greedy", "--drafter", "x.pt"], "not used by"),
        (["--algo", "greedy", "--batch-size", "0"], "at least 1"),
        (["--algo", "greedy", "--ref", "x.txt"], "needs --input"),
    ],
)
def test_invalid_options(trained_tiny, args, needle):
    """Guards against flags that are silently ignored or crash."""
    r = decode(trained_tiny, *args)
    err = r.stderr.decode()
    assert r.returncode != 0 and needle in err and "Traceback" not in err, err


@pytest.mark.slow
def test_non_utf8_input_is_a_one_line_error(trained_tiny, tmp_path):
    """Guards against a UnicodeDecodeError traceback on Latin-1 input."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\nK\xf6ln\n".encode("latin-1"))
    assert "line 2 is not valid UTF-8" in one_line_error(decode(trained_tiny, "--algo", "greedy", "--input", str(bad)))


@pytest.mark.slow
def test_checkpoint_problems_are_one_line_errors(trained_tiny, tmp_path):
    """Guards against tracebacks for a missing checkpoint, a wrong task, or a swapped tokenizer."""
    missing = tmp_path / "none.pt"
    assert f"--model {missing}: no such file or folder" in one_line_error(
        run_py(*DECODE, "--algo", "greedy", "--model", str(missing))
    )
    r = run_py("decode.py", "--algo", "greedy", "--task", "gec-uk", "--model", str(trained_tiny / "model.pt"))
    assert "trained for task" in one_line_error(r)
    other = tmp_path / "swapped"
    shutil.copytree(trained_tiny, other)
    from refdec.tokenizer import Tokenizer

    Tokenizer.train(["completely different text"] * 10, 300).save(other / "tokenizer.json")
    assert "not the vocabulary" in one_line_error(decode(other, "--algo", "greedy", "--limit", "1"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(trained_tiny, corrupt)
    (corrupt / "model.pt").write_bytes((trained_tiny / "model.pt").read_bytes()[:1000])
    assert "model.pt is truncated or not a checkpoint (1,000 bytes" in one_line_error(
        decode(corrupt, "--algo", "greedy", "--limit", "1")
    )
    shipped = "checkpoints/mt-en-de/model.pt"  # a real checkpoint with another tokenizer
    assert "different tokenizer" in one_line_error(
        decode(trained_tiny, "--algo", "iad", "--compare", f"greedy@{shipped}", "--limit", "1")
    )


@pytest.mark.slow
def test_help_explains():
    """Guards against a --help that does not say what the algorithms are."""
    r = run_py("decode.py", "--help")
    assert r.returncode == 0 and b"--compare" in r.stdout and b"beam search" in r.stdout


@pytest.mark.slow
def test_bild_with_an_early_exit(tmp_path):
    """Guards BiLD's early-exit variant end to end: train.py --early-exit marks the checkpoint,
    decode.py --small early-exit uses its first layers; falling back at every step is greedy."""
    out = tmp_path / "ee"
    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--out-dir",
        str(out),
        "--train-limit",
        "800",
        "--dec-layers",
        "2",
        "--early-exit",
        "1",
        "--max-steps",
        "4",
        "--eval-every",
        "4",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    rep = tmp_path / "r.json"
    r = decode(
        out,
        "--algo",
        "bild",
        "--small",
        "early-exit",
        "--fallback-threshold",
        "2",
        "--compare",
        "greedy",
        "--limit",
        "3",
        "--max-len",
        "8",
        "--dtype",
        "float64",
        "--report",
        str(rep),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(rep.read_text())["compare"]["identical"] == 1.0
    bad = run_py(
        "train.py", "--preset", "tiny", "--out-dir", str(tmp_path / "x"), "--early-exit", "1", "--train-limit", "50"
    )
    assert bad.returncode != 0 and "decoder layers" in bad.stderr.decode()


def test_cli_options_are_the_decoders_keyword_options():
    """decode.py's algorithm options and their defaults come from the decoder functions' signatures
    (a --help that promised one threshold while the run used another was a real bug): every keyword
    option of every decoder has a flag whose help states the decoder's default, and no flag is left
    that no decoder takes."""
    import inspect

    from refdec.app.algorithms import ALGORITHMS, OPTIONS
    from refdec.commands.decode import build_parser

    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    taken = set()
    for algo in ALGORITHMS.values():
        for name, p in inspect.signature(algo.decoder).parameters.items():
            if p.kind is p.KEYWORD_ONLY and isinstance(p.default, (bool, int, float, str)) and name != "trace":
                assert name in OPTIONS and name in flags, (algo.name, name)
                assert algo.defaults()[name] == p.default
                shown = (
                    "on"
                    if p.default is True
                    else "off"
                    if p.default is False
                    else f"{p.default:g}"
                    if isinstance(p.default, float)
                    else str(p.default)
                )
                assert f"{algo.name} {shown}" in flags[name].help or f"default {shown})" in flags[name].help, name
                assert flags[name].default is None  # unset on the command line: each algorithm's own default
                taken.add(name)
    assert taken == set(OPTIONS)
    assert "bild 0.9, speculative 1" in flags["top_p"].help  # the one option whose defaults differ


@pytest.mark.slow
def test_bild_with_a_small_model_on_the_large_models_encoder(trained_tiny, tmp_path):
    """Guards the shared-encoder small model end to end: train.py --encoder-from trains a decoder on
    the frozen encoder (its checkpoint records where that is and which file); decode.py pairs it with
    that large model (BiLD falling back at every step is greedy, the encoder runs once) and refuses a
    changed encoder file with one line."""
    large = tmp_path / "large"
    shutil.copytree(trained_tiny, large)
    out = tmp_path / "shared"
    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--out-dir",
        str(out),
        "--train-limit",
        "800",
        "--enc-layers",
        "0",
        "--encoder-from",
        str(large / "model.pt"),
        "--d-model",
        "16",
        "--max-steps",
        "4",
        "--eval-every",
        "4",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "reads the frozen encoder" in r.stderr.decode()
    from refdec.checkpoint import file_sha256, load_model

    big, _, _ = load_model(large / "model.pt")
    paired, _, _ = load_model(out / "model.pt", loaded={file_sha256(large / "model.pt"): big})
    assert paired.base is big  # the large model in memory is its encoder: no second copy loaded
    assert load_model(out / "model.pt")[0].base is not big
    rep = tmp_path / "r.json"
    r = decode(
        large,
        "--algo",
        "bild",
        "--small",
        str(out / "model.pt"),
        "--fallback-threshold",
        "2",
        "--compare",
        f"greedy,greedy@{out / 'model.pt'}",
        "--limit",
        "3",
        "--max-len",
        "8",
        "--dtype",
        "float64",
        "--report",
        str(rep),
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    assert report["compare"]["identical"] == 1.0
    assert report["runs"][0]["encoder_calls"] == 3  # the large model's encoder, once per sentence for both
    assert report["runs"][2]["encoder_calls"] == 3  # the small model alone runs the encoder it reads
    (large / "model.pt").write_bytes((large / "model.pt").read_bytes() + b"\0")  # another file now
    r = decode(large, "--algo", "bild", "--small", str(out / "model.pt"), "--limit", "1")
    assert r.returncode != 0 and "not the model" in one_line_error(r)
    for args, needle in (
        (["--enc-layers", "0"], "needs encoder_from"),
        (["--encoder-from", str(large / "model.pt")], "needs enc_layers 0"),
    ):
        bad = run_py("train.py", "--preset", "tiny", "--out-dir", str(tmp_path / "x"), *args)
        assert bad.returncode != 0 and needle in bad.stderr.decode() and "Traceback" not in bad.stderr.decode()


@pytest.mark.slow
def test_gad_with_a_drafter_on_the_verifiers_encoder(trained_tiny, tmp_path):
    """Guards the shared-encoder drafter end to end: train.py --drafter-k --encoder-from trains a block
    drafter on the verifier's frozen encoder; decode.py pairs it with that verifier, so GAD runs the
    encoder once per sentence and still gives the verifier's greedy output."""
    out = tmp_path / "drafter"
    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--out-dir",
        str(out),
        "--train-limit",
        "800",
        "--enc-layers",
        "0",
        "--encoder-from",
        str(trained_tiny / "model.pt"),
        "--drafter-k",
        "3",
        "--d-model",
        "16",
        "--max-steps",
        "4",
        "--eval-every",
        "4",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "reads the frozen encoder" in r.stderr.decode() and "block accuracy" in r.stderr.decode()
    rep = tmp_path / "r.json"
    r = decode(
        trained_tiny,
        "--algo",
        "gad",
        "--drafter",
        str(out / "model.pt"),
        "--compare",
        "greedy",
        "--limit",
        "3",
        "--max-len",
        "8",
        "--dtype",
        "float64",
        "--report",
        str(rep),
    )
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(rep.read_text())
    assert report["compare"]["identical"] == 1.0
    assert report["runs"][0]["encoder_calls"] == 3 and report["runs"][0]["drafter_calls"] > 0


@pytest.mark.slow
def test_compare_blockwise_finds_its_heads_as_algo_blockwise_does():
    """Guards against --compare blockwise running on the task's main model (which has no proposal
    heads) while --algo blockwise finds the shipped heads by itself."""
    r = run_py(
        "decode.py",
        "--algo",
        "greedy",
        "--task",
        "mt-en-de",
        "--compare",
        "blockwise",
        "--limit",
        "3",
        "--threads",
        "1",
        "--quiet",
    )
    err = r.stderr.decode()
    assert r.returncode == 0, err
    row = next(line for line in err.splitlines() if line.strip().startswith("blockwise@mt-en-de-blockwise"))
    assert row.rstrip().endswith("1.0000")  # exact blockwise on a frozen base: greedy's outputs


@pytest.mark.slow
def test_fast_route_writes_the_reference_output(trained_tiny, tmp_path):
    """Guards decode.py --fast: in float64 greedy and IAD on the fast route write what greedy on the
    reference route writes, the report says which route ran, and --fast with --invariant is refused."""
    outs = {}
    for name, flags in (("reference", ()), ("fast", ("--fast",)), ("fast-iad", ("--fast",))):
        rep = tmp_path / f"{name}.json"
        algo = "iad" if name == "fast-iad" else "greedy"
        r = decode(
            trained_tiny,
            "--algo",
            algo,
            "--limit",
            "8",
            "--dtype",
            "float64",
            "--max-len",
            "16",
            "--report",
            str(rep),
            *flags,
        )
        assert r.returncode == 0, r.stderr.decode()
        outs[name] = r.stdout.decode()
        assert json.loads(rep.read_text())["fast_route"] is bool(flags)
    assert outs["fast"] == outs["reference"] and outs["fast-iad"] == outs["reference"]
    r = decode(trained_tiny, "--algo", "greedy", "--limit", "1", "--fast", "--invariant")
    assert r.returncode == 2 and "not allowed with" in r.stderr.decode()


@pytest.mark.slow
def test_outputs_cut_at_max_len_are_counted_in_a_warning(trained_tiny):
    """Case: `--max-len 1` cut every output to one token (or none) and nothing said so. One warning line
    now counts the outputs each run stopped at the budget before their eos."""
    r = decode(trained_tiny, "--algo", "greedy", "--compare", "beam", "--limit", "3", "--max-len", "1")
    assert r.returncode == 0, r.stderr.decode()
    cut = [line for line in r.stderr.decode().splitlines() if "cut at" in line]
    assert cut == [
        "warning: outputs cut at --max-len 1 before their eos: greedy 3 of 3, beam 3 of 3; "
        "a larger --max-len lets them end"
    ]


def test_the_reports_speed_is_the_tables(tmp_path):
    """Case: the JSON report's `speedup` was the row's seconds over the first row's (0.83) where the table
    printed "1.21x faster": two figures the other way round. The report now holds the table's figure,
    speed_vs_first (the first row's seconds over the row's: above 1, faster)."""
    from refdec.app import report, runner
    from refdec.app.algorithms import ALGORITHMS
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    lines = ["One line.", "Two lines."]
    runs = [runner.Run(ALGORITHMS[name], {}, fake_models()) for name in ("greedy", "iad", "beam")]
    for r, secs in zip(runs, (1.21, 1.0, 2.42)):
        r.outputs = [torch.tensor(tok.encode(s)) for s in lines]
        r.times, r.calls, r.seconds = [secs / 2] * 2, [1] * 2, secs
        r.stats.sentences = 2
    summary = report.summarise("mt-en-de", runs, lines, [lines], [tok.encode(s) for s in lines], tok, "cpu")
    assert [row.get("speed_vs_first") for row in summary.rows] == [None, pytest.approx(1.21), pytest.approx(0.5)]
    assert "1.21x faster" in summary.text and "2.00x slower" in summary.text
    built = report.build_report("mt-en-de", summary.rows, runs, n_lines=2, fields={})
    assert built["compare"]["speed_vs_first"] == pytest.approx(1.21) and "speedup" not in built["compare"]
    assert "speed_vs_first" in (REPO / "docs" / "usage.md").read_text(encoding="utf-8")


def test_two_transformers_folders_get_two_row_labels(tmp_path, monkeypatch):
    """Case: two transformers folders under one parent (hfx/a, hfx/b) both printed as `greedy@hfx`: the
    label took the parent of the path, as for a model.pt. A folder is named by itself, and where two
    checkpoints share a name, by their paths."""
    from refdec.app import plan

    for folder in ("hfx/a", "hfx/b", "other/a"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    def labels(model, compare):
        return [
            s.label
            for s in plan.plan_runs(
                "greedy", None, model=model, given={}, compares=plan.parse_compare(compare), batch_size=None, sizes=[]
            )
        ]

    assert labels("hfx/a", "greedy@hfx/b,beam@hfx/b") == ["greedy@a", "greedy@b", "beam@b"]
    assert labels("hfx/a", "greedy@other/a") == ["greedy@hfx/a", "greedy@other/a"]
    assert labels("hfx/a", "greedy") == ["greedy", "greedy"]  # one checkpoint: the algorithm alone


def test_model_help_and_usage_name_every_family_refdec_hf_imports():
    """Case: decode.py's --model help and docs/usage.md named only M2M100 and NLLB folders, though
    refdec.hf imports Marian, BART, mBART, Pegasus and T5 as well."""
    from refdec.commands.decode import build_parser
    from refdec.hf.families import FAMILIES

    help_text = " ".join(build_parser().format_help().split()).lower()
    usage = " ".join((REPO / "docs" / "usage.md").read_text(encoding="utf-8").split()).lower()
    for family in FAMILIES.values():
        name = re.split(r"For|MTModel", family.architecture)[0].lower()  # M2M100ForConditional... -> m2m100
        assert name in help_text and name in usage, family.architecture


@pytest.mark.slow
def test_a_byte_order_mark_does_not_change_the_output(trained_tiny, tmp_path):
    """Case: on gec-en "She go to school yesterday." saved with a byte-order mark came out as "The Ital
    ItalShe go to school yesterday.": the mark was decoded as part of the first line. decode.py now gives
    the output of the same file without it, with one note naming the file (stdin alike)."""
    text = "She go to school yesterday.\nClick OK to close the dialog.\n"
    (tmp_path / "plain.txt").write_text(text, encoding="utf-8")
    (tmp_path / "bom.txt").write_text(text, encoding="utf-8-sig")
    want = decode(trained_tiny, "--algo", "greedy", "--input", str(tmp_path / "plain.txt"), "--max-len", "8")
    for args, stdin in (([str(tmp_path / "bom.txt")], None), (["-"], (tmp_path / "bom.txt").read_bytes())):
        r = decode(trained_tiny, "--algo", "greedy", "--max-len", "8", "--input", *args, stdin=stdin)
        assert r.returncode == want.returncode == 0 and r.stdout == want.stdout, r.stderr.decode()
        notes = [line for line in r.stderr.decode().splitlines() if "byte-order mark" in line]
        assert notes == [f"note: {args[0]} starts with a UTF-8 byte-order mark; it is dropped, not read as text"]
