"""Byte-level BPE: exact round trips for any text, fixed special ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdec.config import SPECIAL_TOKENS
from refdec.data import load_split
from refdec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    mt, uk = load_split("mt-en-de", "dev"), load_split("gec-uk", "dev")
    return Tokenizer.train(mt.src + mt.tgt + uk.src[:500], vocab_size=1200)


def test_special_ids(tok):
    """Guards against the special tokens moving (models and decoders hard-code ids 0-4)."""
    assert [tok.tokens([i])[0] for i in range(5)] == list(SPECIAL_TOKENS)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)


def test_real_lines_round_trip(tok):
    """Guards against lossy normalisation: real German, English and Ukrainian lines come back exactly."""
    lines = load_split("mt-en-de", "test").tgt[:300] + load_split("gec-uk", "test").src[:300]
    for line in lines:
        assert tok.decode(tok.encode(line)) == line


@pytest.mark.parametrize(
    "text",
    [
        "<mask> and </s> <s><pad><unk> are text",
        "😀 emoji",
        "漢字とかな",
        "עברית ו-العربية",
        "tab\there",
        "ctrl \x00\x07\x1b[0m",
        "  leading and trailing  ",
        "",
        "\u200bzero-width",
        "combining é vs é",
    ],
)
def test_unknown_characters_round_trip(tok, text):
    """Guards against characters outside the training text turning into <unk> or vanishing."""
    ids = tok.encode(text)
    assert min(ids, default=5) > tok.mask_id  # no special id, <unk> included, ever comes from text
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips(text):
    """Guards against any string, including surrogate-free random unicode, failing to round-trip."""
    tok = _shared()
    assert tok.decode(tok.encode(text)) == text


_TOK = None


def _shared() -> Tokenizer:
    global _TOK
    if _TOK is None:
        _TOK = Tokenizer.train(["hello world", "Привіт світе", "Hallo Welt"] * 20, 300)
    return _TOK


def test_decode_drops_specials_and_save_load(tok, tmp_path):
    """Guards against bos/eos/pad/mask leaking into output text, and a save/load that changes ids."""
    ids = tok.encode("Hallo Welt")
    assert tok.decode([1] + ids + [2, 0, 4]) == "Hallo Welt"
    tok.save(tmp_path / "t.json")
    again = Tokenizer.load(tmp_path / "t.json")
    assert again.encode("Hallo Welt") == ids and again.sha256 == tok.sha256
