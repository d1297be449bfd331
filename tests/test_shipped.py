"""The checkpoints shipped in checkpoints/: they load safely and decode the real test set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import REPO

from refdec.checkpoint import load_checkpoint, load_model
from refdec.data import TASKS, load_split, source_tensor
from refdec.decoding import decode_beam, decode_greedy, decode_iad

pytestmark = pytest.mark.slow  # the shipped checkpoints on their test sets

# checkpoints/<task>/ and checkpoints/<task>-<variant>/ (gec-uk-6x6, gec-uk-9x3: the SAD pair)
SHIPPED = sorted(
    p
    for p in (REPO / "checkpoints").glob("*/model.pt")
    if any(p.parent.name == t or p.parent.name.startswith(t + "-") for t in TASKS)
)
GEC = [p for p in SHIPPED if TASKS[load_checkpoint(p)["task"]] == "gec"]


def test_the_mt_checkpoint_is_shipped():
    """Guards against a fresh clone that cannot run `decode.py --task mt-en-de` (the README's first command)."""
    assert (REPO / "checkpoints" / "mt-en-de" / "model.pt").is_file()
    assert (REPO / "checkpoints" / "mt-en-de" / "tokenizer.json").is_file()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_checkpoint_decodes_exactly(path: Path):
    """Guards against a shipped file that is too large (the largest, BiLD's large mt-en-de model of
    13.1M parameters, is 25 MiB in float16), needs a pickle, or whose float64 greedy and beam(1)
    outputs differ on real sentences."""
    assert path.stat().st_size < 32 * 2**20
    checkpoint = load_checkpoint(path)
    assert path.parent.name == checkpoint["task"] or path.parent.name.startswith(checkpoint["task"] + "-")
    model, tok, _ = load_model(path, task=checkpoint["task"], dtype=torch.float64)
    src = [tok.encode(s) for s in load_split(checkpoint["task"], "test").src[:4]]
    for ids in src:
        x = source_tensor([ids])
        g = decode_greedy(model, x, max_len=2 * len(ids) + 10)
        b = decode_beam(model, x, max_len=2 * len(ids) + 10, beam_size=1)
        assert torch.equal(g.tokens[0], b.tokens[0])


@pytest.mark.parametrize("path", GEC, ids=[p.parent.name for p in GEC])
def test_shipped_gec_checkpoint_iad_is_greedy(path: Path):
    """Guards against input-guided aggressive decoding drifting from greedy on a real model and real
    UA-GEC sentences, where drafts are long and mostly accepted (float64)."""
    checkpoint = load_checkpoint(path)
    model, tok, _ = load_model(path, task=checkpoint["task"], dtype=torch.float64)
    calls = tokens = 0
    for line in load_split(checkpoint["task"], "test").src[:12]:
        ids = tok.encode(line)
        x = source_tensor([ids])
        g = decode_greedy(model, x, max_len=2 * len(ids) + 10)
        r = decode_iad(model, x, max_len=2 * len(ids) + 10)
        assert torch.equal(g.tokens[0], r.tokens[0])
        calls, tokens = calls + r.stats.verifier_calls, tokens + r.stats.tokens
    assert calls * 3 < tokens  # a trained GEC model copies: several tokens per verifier call


def test_shipped_drafter_and_proposal_heads_are_greedy():
    """Guards GAD's shipped drafter (on the verifier's encoder) and the shipped blockwise heads (on the
    frozen verifier) against drifting from the verifier's greedy output on real mt-en-de sentences
    (float64), and against a drafter or heads that never guess a token right."""
    from refdec.checkpoint import file_sha256
    from refdec.decoding import decode_blockwise, decode_gad
    from refdec.drafter import Drafter
    from refdec.proposal import load_proposal

    ckpts = REPO / "checkpoints"
    verifier, tok, _ = load_model(ckpts / "mt-en-de" / "model.pt", task="mt-en-de", dtype=torch.float64)
    drafter, _, dck = load_model(
        ckpts / "mt-en-de-drafter" / "model.pt",
        task="mt-en-de",
        dtype=torch.float64,
        loaded={file_sha256(ckpts / "mt-en-de" / "model.pt"): verifier},
    )
    assert drafter.base is verifier
    base, _, bck = load_model(ckpts / "mt-en-de-blockwise" / "model.pt", task="mt-en-de", dtype=torch.float64)
    heads = load_proposal(bck, dtype=torch.float64)
    for name, t in verifier.state_dict().items():  # the heads' base is the verifier, frozen
        assert torch.equal(t, base.state_dict()[name]), name
    drafted = calls = 0
    for line in load_split("mt-en-de", "test").src[:6]:
        ids = tok.encode(line)
        x = source_tensor([ids])
        n = 2 * len(ids) + 10
        g = decode_greedy(verifier, x, max_len=n)
        r = decode_gad(verifier, Drafter(drafter, k=dck["drafter"]["k"], layout=dck["drafter"]["layout"]), x, max_len=n)
        b = decode_blockwise(base, heads, x, max_len=n)
        assert torch.equal(g.tokens[0], r.tokens[0]) and torch.equal(g.tokens[0], b.tokens[0])
        assert r.stats.encoder_calls == 1
        drafted, calls = (
            drafted + r.stats.tokens + b.stats.tokens,
            calls + r.stats.verifier_calls + b.stats.verifier_calls,
        )
    assert drafted > 1.1 * calls
