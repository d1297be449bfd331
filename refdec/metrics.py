"""Evaluation metrics for refdec: BLEU / chrF (via sacrebleu) and a simple GEC edit F0.5.

The GEC scorer is in the spirit of the M2 scorer / ERRANT, but self-contained:

1. ``tokenize`` splits text into word tokens and single punctuation tokens (see
   ``TOKEN_RE``); it uses unicode ``\\w`` so Ukrainian and English both work.
2. ``extract_edits`` aligns source -> target tokens with a minimal Levenshtein
   alignment and merges each maximal run of non-match operations into one edit
   ``(start, end, replacement_tokens)`` over the source span ``[start, end)``.
3. ``gec_scores`` compares hypothesis edits with reference edits as sets:
   TP = |hyp & ref|, FP = |hyp - ref|, FN = |ref - hyp|, summed over the corpus.

No edit types or classification are used: an edit only counts if the span and the
replacement match a gold edit exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import sacrebleu

Edit = tuple[int, int, tuple[str, ...]]
Refs = Sequence[str] | Sequence[Sequence[str]]

# A token is either a word (a run of \w characters, optionally joined by internal
# apostrophes or hyphens, so "don't", "м'ясо" and "будь-який" stay one token) or a
# single character that is neither a word character nor whitespace (punctuation).
TOKEN_RE = re.compile(r"\w+(?:['’ʼ-]\w+)*|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into word and punctuation tokens using ``TOKEN_RE``."""
    return TOKEN_RE.findall(text)


# ---------------------------------------------------------------- BLEU / chrF


def _ref_streams(hyps: Sequence[str], refs: Refs) -> list[list[str]]:
    """Normalise ``refs`` to sacrebleu's list of reference streams and check lengths.

    ``refs`` is either one stream (``list[str]``, one reference per hypothesis) or
    several streams (``list[list[str]]``, each stream has one line per hypothesis).
    """
    streams = [list(refs)] if refs and isinstance(refs[0], str) else [list(s) for s in refs]
    if not streams:
        raise ValueError("no reference streams given")
    for s in streams:
        if len(s) != len(hyps):
            raise ValueError(f"reference stream has {len(s)} lines, expected {len(hyps)}")
    return streams


def corpus_bleu(hyps: Sequence[str], refs: Refs) -> float:
    """Corpus BLEU (sacrebleu defaults, 0-100) of ``hyps`` against one or several
    reference streams. Returns 0.0 for an empty corpus."""
    if not hyps:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hyps), _ref_streams(hyps, refs)).score)


def corpus_chrf(hyps: Sequence[str], refs: Refs) -> float:
    """Corpus chrF (sacrebleu defaults, 0-100) of ``hyps`` against one or several
    reference streams. Returns 0.0 for an empty corpus."""
    if not hyps:
        return 0.0
    return float(sacrebleu.corpus_chrf(list(hyps), _ref_streams(hyps, refs)).score)


# ------------------------------------------------------------ alignment / edits


def _distance_table(src: Sequence[str], tgt: Sequence[str]) -> list[list[int]]:
    """Plain O(n*m) Levenshtein DP table; ``d[i][j]`` = distance(src[:i], tgt[:j])."""
    n, m = len(src), len(tgt)
    d = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        d[i][0] = i
    for j in range(m + 1):
        d[0][j] = j
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost = 0 if src[i - 1] == tgt[j - 1] else 1
            d[i][j] = min(d[i - 1][j - 1] + cost, d[i - 1][j] + 1, d[i][j - 1] + 1)
    return d


def levenshtein(src: Sequence[str], tgt: Sequence[str]) -> int:
    """Token-level edit distance (unit cost insert / delete / substitute)."""
    return _distance_table(src, tgt)[len(src)][len(tgt)]


def align(src: Sequence[str], tgt: Sequence[str]) -> list[str]:
    """Minimal alignment as a list of ops: "M" match, "S" substitute, "D" delete
    (source token dropped), "I" insert (target token added), in source order.

    Tie-breaking is deterministic: backtracking from the end, we prefer a
    match, then a substitution, then a deletion, then an insertion.
    """
    d = _distance_table(src, tgt)
    i, j, ops = len(src), len(tgt), []
    while i > 0 or j > 0:
        diag = d[i - 1][j - 1] if i > 0 and j > 0 else None
        if diag is not None and src[i - 1] == tgt[j - 1] and d[i][j] == diag:
            ops.append("M")
            i, j = i - 1, j - 1
        elif diag is not None and d[i][j] == diag + 1:
            ops.append("S")
            i, j = i - 1, j - 1
        elif i > 0 and d[i][j] == d[i - 1][j] + 1:
            ops.append("D")
            i -= 1
        else:
            ops.append("I")
            j -= 1
    return ops[::-1]


def extract_edits(src_tokens: Sequence[str], tgt_tokens: Sequence[str]) -> list[Edit]:
    """Edits turning ``src_tokens`` into ``tgt_tokens``, as ``(start, end, repl)``
    where source tokens ``[start, end)`` are replaced by the tuple ``repl``.

    Adjacent non-match operations are merged into one edit, so
    ``a b c -> a x y c`` gives ``[(1, 2, ("x", "y"))]``. Pure insertions have
    ``start == end``; pure deletions have ``repl == ()``.
    """
    edits: list[Edit] = []
    i = j = 0  # current positions in source and target
    start: int | None = None  # source start of the edit being built, if any
    repl: list[str] = []
    for op in align(src_tokens, tgt_tokens):
        if op == "M":
            if start is not None:
                edits.append((start, i, tuple(repl)))
                start, repl = None, []
            i += 1
            j += 1
            continue
        if start is None:
            start = i
        if op in ("S", "I"):
            repl.append(tgt_tokens[j])
            j += 1
        if op in ("S", "D"):
            i += 1
    if start is not None:
        edits.append((start, i, tuple(repl)))
    return edits


def apply_edits(src_tokens: Sequence[str], edits: Sequence[Edit]) -> list[str]:
    """Apply non-overlapping ``edits`` (as from ``extract_edits``) to ``src_tokens``."""
    out: list[str] = []
    pos = 0
    for start, end, repl in sorted(edits):
        out.extend(src_tokens[pos:start])
        out.extend(repl)
        pos = end
    out.extend(src_tokens[pos:])
    return out


def edit_ratio(src: str, out: str) -> float:
    """Token edit distance between ``src`` and ``out`` divided by
    ``max(1, number of source tokens)``. 0.0 means unchanged."""
    src_tokens = tokenize(src)
    return levenshtein(src_tokens, tokenize(out)) / max(1, len(src_tokens))


# ------------------------------------------------------------------ GEC P/R/F0.5


def _prf(tp: int, fp: int, fn: int, beta: float = 0.5) -> tuple[float, float, float]:
    """Precision, recall, F_beta with the M2 conventions: P = 1 when nothing was
    proposed, R = 1 when there are no gold edits, F = 0 when P + R = 0."""
    p = tp / (tp + fp) if tp + fp else 1.0
    r = tp / (tp + fn) if tp + fn else 1.0
    b2 = beta * beta
    f = (1 + b2) * p * r / (b2 * p + r) if p + r else 0.0
    return p, r, f


def gec_scores(sources: Sequence[str], hyps: Sequence[str], refs: Refs) -> dict:
    """Edit-level precision / recall / F0.5 of ``hyps`` against ``refs``.

    ``refs`` has one entry per sentence: a reference string, or a list of
    alternative reference strings for that sentence. With several references we
    follow the M2 scorer: sentence by sentence, pick the reference that maximises
    the running corpus-level F0.5 (totals so far plus this sentence), breaking
    ties by more TP, then fewer FP, then fewer FN, then the earliest reference.

    Returns ``{"precision", "recall", "f05", "tp", "fp", "fn"}``. An empty corpus
    scores P = R = F0.5 = 1.0 (nothing proposed, nothing missed).
    """
    if not len(sources) == len(hyps) == len(refs):
        raise ValueError(f"length mismatch: {len(sources)} sources, {len(hyps)} hyps, {len(refs)} refs")
    tp = fp = fn = 0
    for src, hyp, sent_refs in zip(sources, hyps, refs):
        alternatives = [sent_refs] if isinstance(sent_refs, str) else list(sent_refs)
        if not alternatives:
            raise ValueError(f"no reference for source {src!r}")
        src_tokens = tokenize(src)
        hyp_edits = set(extract_edits(src_tokens, tokenize(hyp)))
        best_key, best_counts = None, (0, 0, 0)
        for ref in alternatives:
            ref_edits = set(extract_edits(src_tokens, tokenize(ref)))
            counts = (len(hyp_edits & ref_edits), len(hyp_edits - ref_edits), len(ref_edits - hyp_edits))
            f = _prf(tp + counts[0], fp + counts[1], fn + counts[2])[2]
            key = (f, counts[0], -counts[1], -counts[2])
            if best_key is None or key > best_key:
                best_key, best_counts = key, counts
        tp, fp, fn = tp + best_counts[0], fp + best_counts[1], fn + best_counts[2]
    p, r, f = _prf(tp, fp, fn)
    return {"precision": p, "recall": r, "f05": f, "tp": tp, "fp": fp, "fn": fn}
