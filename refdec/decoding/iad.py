"""Input-guided aggressive decoding (IAD; Sun et al. 2021, "Instantaneous Grammatical Error Correction
with Shallow Aggressive Decoding"; Ge et al. 2022, section 3.1, Algorithm 1).

In rewriting tasks (grammatical error correction) the output is mostly a copy of the input. IAD
drafts the input itself and lets the model verify the draft in one parallel decoder call. Ge et al.'s
Algorithm 1, numbered as the paper numbers it (Sun et al.'s Algorithm 1 is the same, line for line):

    Input: model, x = (bos, x_1 .. x_n, pad), o = (o_0) = (bos)
     1: j <- 0
     2: while o_j != eos and j < max_len:
     3:     if a suffix o_(j-q .. j), q >= 0, is a unique substring of x, ending at x_i:
     4:         aggressive decode o~_(j+1 ..): the draft x_(i+1) .. (up to the pad; at most max_draft
                tokens) fed after o_<=j, every position in one decoder call (Eq. 5-6)
     5:         find the bifurcation j + k (k > 0): o~_(j+1 .. j+k-1) = x_(i+1 .. i+k-1), o~_(j+k) != x_(i+k)
     6:         o <- CAT(o, o~_(j+1 .. j+k))   (the verified tokens, the model's own token at the
                                                bifurcation included)
     7:         j <- j + k
     8:     else:
     9:         decode o*_(j+1) = argmax P(o_(j+1) | o_<=j, x): one ordinary greedy step
    10:         o <- CAT(o, o*_(j+1))
    11:         j <- j + 1
    12:     end if
    13: end while

Every verified token is the model's argmax given the tokens before it, so the output is
token-for-token the greedy output (refdec.decoding.verify has the argument). refdec's sources end
in eos, so x here is (bos, x_1 .. x_n, eos, pad): a sentence the model copies verbatim is accepted
with its eos in a single call. The pad sentinel guarantees a bifurcation in the paper (line 5), a
drafted position the model never agrees with; refdec's verification step always returns the model's token
after the last drafted one, which is that guarantee, so the sentinel only marks where drafts end
and is never fed to the decoder. A step with nothing to draft is a verification of an empty draft:
one greedy step (lines 9-11). Rejected positions leave the KV cache by `truncate`, never by recomputation.

Which suffix, and which occurrence of it, is a policy (`match`):

    unique    the paper's: the shortest suffix (at most max_suffix tokens) that occurs exactly
              once in x; when every suffix up to that length is ambiguous or absent, a greedy step
    leftmost  as unique, but where unique gives up on an ambiguous suffix (a repeated n-gram), take
              the leftmost occurrence of the longest ambiguous suffix instead of a greedy step
    longest   the longest suffix (at most max_suffix tokens) that occurs in x, at its leftmost
              occurrence: the rule of prompt-lookup decoding, which scans from the longest n-gram
              down and takes the first match (HF's version matches the output's own n-grams, not
              the source's)

SAD, the shallow form, is this same algorithm run on a model with a deep encoder and a shallow
decoder (9+3 instead of 6+6): every decoder call gets cheaper, the encoder runs once per sentence.

Batches: every row still decoding verifies its own draft in the same decoder call (Rows.verify:
refdec.decoding.verify.verify_rows): drafts of different lengths are padded, each row accepts its
own prefix and its cache keeps its own length. A row that reaches eos or max_len leaves the batch
with its cache and memory rows (refdec.decoding.rows.Rows), so a batch costs what its longest
sentence costs in calls.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .result import DecodeResult, DecodeStats, check_eval
from .rows import Rows

MATCH_POLICIES = ("unique", "leftmost", "longest")


def find_match(x: list[int], out: list[int], policy: str = "unique", max_suffix: int = 0) -> int | None:
    """The index i in x after which to draft (x[i] aligns with out[-1]), or None for a greedy step:
    Algorithm 1's line 3, the suffix o_(j-q .. j) ending at x_i, under the match policy `policy`.

    x: the source as (bos, x_1 .. x_n, eos, pad); out: the output so far, starting with bos.
    max_suffix: longest suffix of `out` tried, in tokens (0 = no limit)."""
    if policy not in MATCH_POLICIES:
        raise ValueError(f"unknown match policy {policy!r}; choose one of {', '.join(MATCH_POLICIES)}")
    limit = len(out) if max_suffix <= 0 else min(max_suffix, len(out))
    occ = [i for i, t in enumerate(x) if t == out[-1]]  # ends of the 1-token suffix's occurrences
    q, found = 1, None
    while occ:
        if policy == "longest":
            found = occ[0]  # leftmost occurrence of the longest suffix seen so far
        elif len(occ) == 1:
            return occ[0]  # unique (and leftmost, which agrees while the match is unique)
        elif policy == "leftmost":
            found = occ[0]
        if q == limit:
            break
        q += 1
        tok = out[-q]
        occ = [i for i in occ if i - q + 1 >= 0 and x[i - q + 1] == tok]
    return found


def source_span(x: list[int], i: int | None, max_draft: int) -> list[int]:
    """The draft after a match at x_i: x_(i+1) .. up to the pad sentinel (never fed), at most
    max_draft tokens (0 = no limit); nothing without a match."""
    if i is None:
        return []
    draft = x[i + 1 : len(x) - 1]
    return draft[:max_draft] if max_draft > 0 else draft


@torch.inference_mode()
def decode_iad(
    model: Transformer,
    src: torch.Tensor,
    *,
    max_len: int,
    match: str = "unique",
    max_suffix: int = 0,
    max_draft: int = 0,
    trace: bool = False,
) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> the greedy output of each row.

    max_draft: most tokens drafted per call (the papers' L_max; 0 = up to the end of the source)."""
    check_eval(model)
    if match not in MATCH_POLICIES:
        raise ValueError(f"unknown match policy {match!r}; choose one of {', '.join(MATCH_POLICIES)}")
    cfg = model.cfg
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=1)
    widest = (max_draft or src.shape[1]) + 1  # a verification call's widest: room for it past the budget
    rows = Rows(
        cfg,
        B,
        max_len,
        stats,
        trace,
        memories=[model.encode(src)],
        caches=[model.new_cache(B, capacity=max_len + widest)],
    )
    xs = [[cfg.bos_id] + row[row.ne(cfg.pad_id)].tolist() + [cfg.pad_id] for row in src]
    rows.sentence_marks["source"] = [tuple(x[1:-1]) for x in xs]  # the trace's Step.source: x_1 .. x_n, eos
    while rows:  # Algorithm 1, line 2: while o_j != eos and j < max_len
        # Line 3: a suffix of o found in x, ending at x_i; line 4: draft x_(i+1) .., stopping before the pad.
        matches = [find_match(xs[b], prefix, match, max_suffix) for b, prefix in zip(rows.alive, rows.prefixes())]
        drafts = [source_span(xs[b], i, max_draft) for b, i in zip(rows.alive, matches)]
        # Lines 4-5 (an empty draft: line 9): one parallel call decodes o~_(j+1) .. after the draft
        # (Eq. 5-6) and finds the bifurcation j + k.
        verified = rows.verify(model, drafts)
        # Lines 6-7 (after a greedy step, lines 10-11): o <- CAT(o, o~_(j+1 .. j+k)); j <- j + k. Finished rows
        # leave the batch.
        rows.commit(drafts, verified, drafted_by="source", origin=matches)
    return rows.result(src.device)
