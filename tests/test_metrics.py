"""Tests for refdec.metrics: tokenisation, edit extraction, GEC P/R/F0.5, BLEU/chrF."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdec.metrics import (
    align,
    apply_edits,
    corpus_bleu,
    corpus_chrf,
    edit_ratio,
    extract_edits,
    gec_scores,
    levenshtein,
    tokenize,
)


def test_tokenize_splits_punctuation_english_and_ukrainian():
    """Guards against punctuation glued to words (so a comma fix would look like a
    word substitution) and against ASCII-only \\w breaking Cyrillic text."""
    assert tokenize("Hello, world!") == ["Hello", ",", "world", "!"]
    assert tokenize("Привіт, світе! Я їм м'ясо.") == ["Привіт", ",", "світе", "!", "Я", "їм", "м'ясо", "."]
    assert tokenize("  ") == []


def test_identical_hyp_has_no_edits_and_precision_one():
    """Guards against spurious edits from an unchanged copy, and against P being 0
    (or dividing by zero) when the system proposes nothing."""
    src = "She go to school yesterday ."
    assert extract_edits(tokenize(src), tokenize(src)) == []
    s = gec_scores([src], [src], ["She went to school yesterday ."])
    assert s["tp"] == 0 and s["fp"] == 0 and s["fn"] == 1
    assert s["precision"] == 1.0 and s["recall"] == 0.0 and s["f05"] == 0.0


def test_exact_correction_scores_f05_one():
    """Guards against a correct hypothesis not matching the gold edit exactly
    (e.g. differing spans or tuple-vs-list replacement types)."""
    src, ref = "Я бачу він вчора .", "Я бачив його вчора ."
    s = gec_scores([src], [ref], [ref])
    assert (s["tp"], s["fp"], s["fn"]) == (1, 0, 0)
    assert s["precision"] == s["recall"] == s["f05"] == 1.0


def test_wrong_edit_is_fp_and_missed_gold_is_fn():
    """Guards against partial credit for a wrong replacement of the right span, and
    against missed gold edits not being counted."""
    src = "He go to school and he like it ."
    hyp = "He goes to school and he like them ."  # right 'goes', wrong 'it->them', misses 'likes'
    ref = "He goes to school and he likes it ."
    s = gec_scores([src], [hyp], [ref])
    assert (s["tp"], s["fp"], s["fn"]) == (1, 1, 1)
    assert s["precision"] == pytest.approx(0.5) and s["recall"] == pytest.approx(0.5)
    assert s["f05"] == pytest.approx(0.5)


def test_adjacent_operations_merge_into_one_edit():
    """Guards against a substitution followed by an insertion (or any run of
    non-matches) being split into several edits, which would inflate counts."""
    assert extract_edits(["a", "b", "c"], ["a", "x", "y", "c"]) == [(1, 2, ("x", "y"))]
    assert extract_edits(["a", "b", "c", "d"], ["a", "d"]) == [(1, 3, ())]
    assert extract_edits(["a", "c"], ["a", "b", "c"]) == [(1, 1, ("b",))]
    assert extract_edits([], ["x"]) == [(0, 0, ("x",))]
    assert extract_edits(["x"], []) == [(0, 1, ())]
    # separate runs stay separate
    assert extract_edits(list("abcde"), list("aXcYe")) == [(1, 2, ("X",)), (3, 4, ("Y",))]


def test_multiple_references_pick_the_best():
    """Guards against always scoring against the first reference (or the union of
    references) instead of the one that best matches the hypothesis."""
    src = "I has a apple ."
    hyp = "I have an apple ."
    refs = [["I had an apple .", "I have an apple .", "I has an apple ."]]
    s = gec_scores([src], [hyp], refs)
    assert (s["tp"], s["fp"], s["fn"]) == (1, 0, 0)  # "has a" -> "have an" is one merged edit
    assert (s2 := gec_scores([src], [hyp], [refs[0][0]]))["fp"] == 1 and s2["fn"] == 1
    # plain-string refs and one-element lists agree
    assert gec_scores([src], [hyp], ["I had an apple ."]) == gec_scores([src], [hyp], [["I had an apple ."]])


def test_corpus_counts_are_summed():
    """Guards against averaging per-sentence F0.5 instead of summing TP/FP/FN."""
    s = gec_scores(["a b", "c d"], ["a x", "c d"], ["a x", "c y"])
    assert (s["tp"], s["fp"], s["fn"]) == (1, 0, 1)
    assert s["f05"] == pytest.approx((1.25 * 1 * 0.5) / (0.25 * 1 + 0.5))


def test_bleu_identical_is_100_and_chrf_works():
    """Guards against wrong sacrebleu argument shapes (hyps vs. reference streams)
    and against returning sacrebleu objects instead of floats."""
    hyps = ["the cat sat on the mat .", "Привіт , світе !"]
    assert corpus_bleu(hyps, hyps) == pytest.approx(100.0)
    assert corpus_bleu(hyps, [hyps, ["x", "y"]]) == pytest.approx(100.0)
    chrf = corpus_chrf(hyps, hyps)
    assert isinstance(chrf, float) and chrf == pytest.approx(100.0)
    assert 0.0 < corpus_chrf(["the cat sat"], ["the cat sat on the mat"]) < 100.0
    with pytest.raises(ValueError):
        corpus_bleu(hyps, ["only one line"])


def test_empty_inputs():
    """Guards against crashes (sacrebleu on empty corpora, empty token lists in the
    DP, division by zero) on empty corpora and empty lines."""
    assert corpus_bleu([], []) == 0.0
    assert corpus_chrf([], [[]]) == 0.0
    assert corpus_bleu([""], ["some reference"]) == 0.0
    assert corpus_chrf(["", "a b"], ["x", "a b"]) >= 0.0
    s = gec_scores([], [], [])
    assert (s["tp"], s["fp"], s["fn"]) == (0, 0, 0) and s["f05"] == 1.0
    s = gec_scores([""], [""], [""])
    assert s["precision"] == s["recall"] == 1.0
    s = gec_scores(["a b"], [""], ["a b"])
    assert (s["tp"], s["fp"], s["fn"]) == (0, 1, 0)
    assert edit_ratio("", "") == 0.0 and edit_ratio("", "a b") == 2.0
    with pytest.raises(ValueError):
        gec_scores(["a"], ["a", "b"], ["a"])


def test_edit_ratio_and_levenshtein():
    """Guards against normalising by the output length or counting characters
    instead of tokens."""
    assert levenshtein(["a", "b", "c"], ["a", "x", "c", "d"]) == 2
    assert edit_ratio("a b c d", "a b c d") == 0.0
    assert edit_ratio("a b c d", "a x c d") == pytest.approx(0.25)
    assert edit_ratio("a b", "a b c d e f") == pytest.approx(2.0)


def test_alignment_tie_breaking_is_deterministic():
    """Guards against non-deterministic or undocumented tie-breaking: for a b -> b a
    the documented order (match, substitute, delete, insert, from the end) yields
    two substitutions, and for a a -> a the last copy is matched (first deleted)."""
    assert align(["a", "b"], ["b", "a"]) == ["S", "S"]
    assert extract_edits(["a", "a"], ["a"]) == [(0, 1, ())]


tokens = st.lists(st.sampled_from(["a", "b", "c", ",", "кіт", "the"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(src=tokens, tgt=tokens)
def test_edits_round_trip_and_are_minimal(src, tgt):
    """Guards against index bookkeeping bugs in edit extraction/merging: applying
    the extracted edits to src must reproduce tgt exactly, edits must be sorted,
    non-overlapping and non-adjacent, and the alignment must be minimal."""
    edits = extract_edits(src, tgt)
    assert apply_edits(src, edits) == tgt
    for (_, e1, _), (s2, _, _) in zip(edits, edits[1:]):
        assert e1 < s2
    ops = align(src, tgt)
    assert sum(op != "M" for op in ops) == levenshtein(src, tgt)
    assert (src == tgt) == (edits == [])
