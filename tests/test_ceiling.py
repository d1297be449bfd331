"""refdec.commands.ceiling: the GAD loop fed the model's own output as its draft is greedy decoding, in the
number of calls a drafter of that quality would take (float64), and its command reports every run."""

from __future__ import annotations

import json
import random

import pytest
from conftest import random_src, tiny_model

from refdec.commands.ceiling import main
from refdec.config import EOS_ID
from refdec.decoding.scripted import greedy_output, scripted_draft, scripted_gad


def test_scripted_draft_keeps_tokens_until_the_first_one_it_changes():
    y = [5, 6, 7, 8, 9, EOS_ID]
    assert scripted_draft(y, 1, 3, 1.0, random.Random(0), 12) == [6, 7, 8]
    assert scripted_draft(y, 4, 8, 1.0, random.Random(0), 12) == [9, EOS_ID]  # no draft past the output's end
    assert scripted_draft(y, 0, 4, 0.0, random.Random(0), 12) == [6]  # the first token is changed, and the draft ends
    for seed in range(20):
        d = scripted_draft(y, 0, 5, 0.5, random.Random(seed), 12)
        assert d[:-1] == y[: len(d) - 1] and 1 <= len(d) <= 5


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_scripted_gad_is_greedy_in_the_calls_its_acceptance_allows(seed, k):
    vocab = 12 if seed % 2 else 40
    model = tiny_model(seed, vocab=vocab)
    drafter = tiny_model(seed + 50, vocab=vocab, layers=(1, 1))
    src = random_src(seed, 1, vocab)
    for max_len in (3, 30):
        y, steps = greedy_output(model, src, max_len)
        assert len(y) == steps and (y[-1] == EOS_ID or len(y) == max_len)
        out, calls = scripted_gad(model, src, y, k=k, accept=1.0, max_len=max_len, rng=random.Random(seed))
        assert out == y and calls == -(-len(y) // (k + 1))  # k drafted + the verifier's own token per call
        out, calls = scripted_gad(model, src, y, k=k, accept=0.0, max_len=max_len, rng=random.Random(seed))
        assert out == y and calls == len(y)  # every draft refused at once: one token per call
        for layout in ("causal", "bidirectional"):
            out, calls = scripted_gad(
                model, src, y, k=k, accept=0.7, max_len=max_len, rng=random.Random(seed), drafter=drafter, layout=layout
            )
            assert out == y and -(-len(y) // (k + 1)) <= calls <= len(y)
        out, calls = scripted_gad(
            model, src, y, k=k, accept=0.7, max_len=max_len, rng=random.Random(seed), small=drafter
        )  # as an autoregressive small model: one step per drafted token
        assert out == y and -(-len(y) // (k + 1)) <= calls <= len(y)


@pytest.mark.slow
def test_ceiling_command_reports_every_run(trained_tiny, tmp_path, capsys):
    rep = tmp_path / "ceiling.json"
    assert (
        main(
            [
                "--model",
                str(trained_tiny / "model.pt"),
                "--drafter",
                "none",
                "--limit",
                "3",
                "--warmup",
                "1",
                "--k",
                "2,4",
                "--accept",
                "1,0",
                "--threads",
                "1",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())
    assert [row["run"] for row in r["rows"]] == [
        "greedy",
        "k=2 accept=1 free drafts",
        "k=2 accept=0 free drafts",
        "k=4 accept=1 free drafts",
        "k=4 accept=0 free drafts",
    ]
    assert r["sentences"] == 3 and r["drafter"] is None
    assert r["environment"]["threads"] == 1 and r["environment"]["cpu"] and r["environment"]["cpu_capability"]
    rows = {row["run"]: row for row in r["rows"]}
    assert rows["greedy"]["tokens_per_call"] == 1.0 and rows["k=2 accept=0 free drafts"]["tokens_per_call"] == 1.0
    assert all(row["seconds"] > 0 and 0.0 <= row["identical"] <= 1.0 for row in r["rows"])
    assert (
        rows["k=4 accept=1 free drafts"]["calls_per_sentence"] <= rows["k=2 accept=1 free drafts"]["calls_per_sentence"]
    )
    assert "speed" in capsys.readouterr().out


@pytest.mark.slow
def test_ceiling_command_times_a_small_model(trained_tiny, tmp_path):
    rep = tmp_path / "ceiling.json"
    path = str(trained_tiny / "model.pt")
    assert (
        main(
            [
                "--model",
                path,
                "--drafter",
                "none",
                "--small",
                path,
                "--limit",
                "2",
                "--warmup",
                "0",
                "--k",
                "3",
                "--threads",
                "1",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())
    assert [(row["run"], row["small"]) for row in r["rows"]] == [
        ("greedy", False),
        ("k=3 accept=1 free drafts", False),
        ("k=3 accept=1 + small model", True),
    ]
    assert r["small"] == path


@pytest.mark.parametrize(
    "args, said",
    [
        (["--k", "0"], "--k 0: give whole numbers of at least 1"),
        (["--k", "x"], "--k x: give whole numbers"),
        (["--accept", "1.5"], "--accept 1.5: give numbers in [0, 1]"),
        (["--limit", "0"], "--limit 0: must be at least 1"),
        (["--limit", "-3"], "--limit -3: must be at least 1"),
        (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    ],
)
def test_ceiling_refuses_bad_options_with_one_line(args, said, capsys):
    """Case: `--limit -3` was answered with every option's rule at once; the line now names the value."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {said}"), err


@pytest.mark.slow
def test_ceiling_refuses_a_model_that_is_not_a_drafter(trained_tiny, capsys):
    path = str(trained_tiny / "model.pt")
    assert main(["--model", path, "--drafter", path, "--limit", "1"]) == 2
    assert "is not a block drafter" in capsys.readouterr().err
