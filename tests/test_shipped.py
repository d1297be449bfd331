"""The checkpoints shipped in checkpoints/: they load safely and decode the real test set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import REPO
from refdec.checkpoint import load_checkpoint, load_model
from refdec.data import load_split, source_tensor
from refdec.decoding import beam_search, greedy

SHIPPED = sorted(p for p in (REPO / "checkpoints").glob("*/model.pt") if p.parent.name in ("mt-en-de", "gec-uk", "gec-en"))


def test_the_mt_checkpoint_is_shipped():
    """Guards against a fresh clone that cannot run `decode.py --task mt-en-de` (the README's first command)."""
    assert (REPO / "checkpoints" / "mt-en-de" / "model.pt").is_file()
    assert (REPO / "checkpoints" / "mt-en-de" / "tokenizer.json").is_file()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_checkpoint_decodes_exactly(path: Path):
    """Guards against a shipped file that is too large, needs a pickle, or whose float64 greedy and
    beam(1) outputs differ on real sentences."""
    assert path.stat().st_size < 16 * 2 ** 20
    ck = load_checkpoint(path)
    assert ck["task"] == path.parent.name
    model, tok, _ = load_model(path, task=ck["task"], dtype=torch.float64)
    src = [tok.encode(s) for s in load_split(ck["task"], "test").src[:4]]
    for ids in src:
        x = source_tensor([ids])
        g = greedy(model, x, max_len=2 * len(ids) + 10)
        b = beam_search(model, x, max_len=2 * len(ids) + 10, beam_size=1)
        assert torch.equal(g.tokens[0], b.tokens[0])
