"""What decode.py --trace prints, mark by mark (refdec.trace): BiLD's rolled-back tokens named and
counted, blockwise's proposals with the rejected ones, IAD's numbered source and where each copy came
from, GAD's filler after a drafted </s>, and the legend above every algorithm's traces."""

from __future__ import annotations

import html
import io
import re

import pytest
from conftest import REPO, random_src, tiny_model

from refdec.decoding import decode_iad
from refdec.tokenizer import Tokenizer
from refdec.trace import (
    COLOURS,
    LEGENDS,
    RESET,
    Step,
    iad_notes,
    print_traces,
    source_tokens,
    strip_colour,
    token_pieces,
    trace_text,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")


def test_bild_names_the_tokens_it_rolled_back_and_counts_them(tok):
    """Case: BiLD's `rollback x1` read as "one rollback" where it counted the small model's tokens thrown
    away, and never said which. It says "rolled back N token(s)" and lists them, | between tokens."""
    the, house, is_, red, very = tok.encode("the house is red very")[:5]
    steps = [
        Step((the, house, is_), 1, red, "small", rollback=True),
        Step((very,), 0, is_, "small", rollback=True),
        Step((house, tok.eos_id), 2, None, "small", verified=False),
    ]
    text = trace_text("bild", 0, steps, tok)
    assert "S(the) rolled back 2 tokens ( house| is) L( red) rolled back 1 token ( very) L( is)" in text
    assert "rollback x" not in text
    coloured = trace_text("bild", 0, steps, tok, colour=True)
    assert strip_colour(coloured) == text and f"{COLOURS['rejected']} house{RESET}" in coloured
    # speculative decoding's refused tokens are named the same way, as rejected
    spec = trace_text("speculative", 0, [Step((the, house), 1, red, "small")], tok)
    assert "S(the) rejected 1 token ( house) L( red)" in spec


def test_blockwise_shows_every_call_s_proposals_with_the_rejected_ones_marked(tok):
    """Case: blockwise's trace printed only the committed tokens, hiding the proposals it rejected. Each
    call has a P line (the heads' proposals: the accepted ones green, the rejected red) and a V line
    (what was committed), as GAD's D/V lines; the first call has none."""
    the, house, is_, red = tok.encode("the house is red")[:4]
    steps = [Step(own=the), Step((house, red, the), 1, is_, "heads"), Step((red, tok.eos_id), 2, None, "heads")]
    text = trace_text("blockwise", 0, steps, tok)
    assert text.splitlines() == [
        "[1] 3 iterations",
        "    1 P: (none)",
        "      V: [] the    (no proposals yet)",
        "    2 P:  house| red|the",  # "the" as the sentence's first token: no space before it
        "      V: [ house]  is    (1 of 3 proposals accepted)",
        "    3 P:  red| </s>",
        "      V: [ red </s>]     (2 of 2 proposals accepted)",
    ]
    coloured = trace_text("blockwise", 0, steps, tok, colour=True)
    assert strip_colour(coloured) == text
    assert f"{COLOURS['accepted']} house{RESET}|{COLOURS['rejected']} red{RESET}|{COLOURS['rejected']}the" in coloured


def test_gad_says_the_tokens_after_a_drafted_eos_are_filler(tok):
    """Case: GAD's blocks padded with </s> after the drafter's own </s> were explained nowhere. The V
    line's note counts them as filler and the legend says why (the block is always full)."""
    the, house = tok.encode("the house")[:2]
    eos = tok.eos_id
    steps = [Step((the, house, eos, eos, eos), 3, None, "drafter"), Step((the, eos, eos), 0, house, "drafter")]
    text = trace_text("gad", 0, steps, tok)
    assert "D: the| house| </s>| </s>| </s>\n" in text
    assert "(3 of 5 drafted tokens accepted; the 2 after the drafted </s> are filler)" in text
    assert "(0 of 3 drafted tokens accepted; the 1 after the drafted </s> is filler)" in text
    assert "filler" in LEGENDS["gad"] and "</s>" in LEGENDS["gad"]


def test_iad_shows_the_source_token_by_token_and_where_each_copy_came_from(tok):
    """Case: an IAD step that drafted nothing right after a "." while the source still had its </s> left
    could not be understood without the source's tokens: the output's "." was not the source's token.
    The trace numbers the source's tokens from 1, says which source token the output's end matched before
    a copy, and why nothing was copied: the output's last token is not in the source, or is in it at
    several places with no longer end of the output in it exactly once."""
    ids = tok.encode("New York")
    source = tuple(ids) + (tok.eos_id,)
    dot, the = tok.encode("York.")[-1], tok.encode("the")[0]
    n = len(ids)
    steps = [
        Step(source, n, dot, "source", origin=0, source=source),  # copied all but </s>, then "." of its own
        Step((), 0, tok.eos_id, origin=None, source=source),  # "." is not in the source: a greedy step
    ]
    text = trace_text("iad", 0, steps, tok)
    lines = text.splitlines()
    piece = token_pieces(tok)
    assert lines[1] == "      source: " + source_tokens(source, piece)
    assert lines[1].endswith(f"{n + 1}:</s>") and lines[1].startswith("      source: 1:New ")
    assert "nothing drafted: a greedy step; the output's last token '.' is not in the source" in lines[3]
    # a match after the start: the source token the output's end matched, before the copy from the next
    the, house, is_, red = tok.encode("the house is red")[:4]
    source = (the, house, is_, house, red, tok.eos_id)
    steps = [
        Step(source, 1, red, "source", origin=0, source=source),  # "the" accepted, " red" its own
        Step(source[5:], 0, house, "source", origin=5, source=source),  # " red" matched token 5: copy from 6
        Step((), 0, is_, source=source),  # after " house", at 2 and 4 (" red house" is not there): no match
    ]
    notes = iad_notes(steps, piece)
    assert (
        notes[1] == "matched up to source token 5 ' red'; 1 copied from the source starting at its token 6, 0 accepted"
    )
    assert notes[2] == (
        "nothing drafted: a greedy step; the output's last token ' house' is source tokens 2, 4, "
        "and no longer end of the output is in the source exactly once"
    )
    assert all(note in trace_text("iad", 0, steps, tok) for note in notes)


def test_iad_steps_carry_their_source_and_match_it():
    """Every IAD Step holds its sentence's source (x_1 .. x_n, eos, without padding) in a batch as alone,
    and a copy's drafted tokens follow the source token its origin names."""
    src = random_src(5, 4, 16, min_len=6, max_len=12)
    model = tiny_model(3, vocab=16)
    r = decode_iad(model, src, max_len=20, trace=True)
    matched = 0
    for b, steps in enumerate(r.trace):
        source = tuple(t for t in src[b].tolist() if t != 0)
        assert all(s.source == source for s in steps)
        alone = decode_iad(model, src[b : b + 1][:, : len(source)], max_len=20, trace=True)
        assert alone.trace[0] == steps
        for s in steps:
            if s.drafted and s.origin:
                assert s.drafted == source[s.origin :][: len(s.drafted)]
                matched += 1
    assert matched


def test_the_legend_comes_once_above_the_traces():
    """print_traces starts with the algorithm's legend (what its marks mean), once, coloured as a note in
    a terminal; blank lines' traces (None) are skipped."""
    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    a = tok.encode("the")[0]
    assert set(LEGENDS) == {"greedy", "beam", "iad", "gad", "blockwise", "bild", "speculative"}
    out = io.StringIO()
    print_traces("greedy", [[Step(own=a)], None, [Step(own=a)]], tok, stream=out)
    text = out.getvalue()
    assert text.startswith("greedy trace: ") and text.count("greedy trace: ") == 1
    assert re.findall(r"^\[\d+\]", text, re.M) == ["[1]", "[3]"]
    assert text.index("greedy trace: ") < text.index("[1]")
    assert max(len(line) for line in text.splitlines() if not line.startswith("[")) <= 100


def test_the_page_shows_iad_s_numbered_source_and_notes(tok):
    from refdec.app.htmlreport import steps_html

    piece = token_pieces(tok)
    ids = tuple(tok.encode("New York")) + (tok.eos_id,)
    steps = [Step(ids, 2, tok.encode("York.")[-1], "source", origin=0, source=ids), Step((), 0, tok.eos_id, source=ids)]
    page = steps_html("iad", steps, piece)
    assert html.escape(source_tokens(ids, piece)) in page
    for note in iad_notes(steps, piece):
        assert html.escape(note) in page
