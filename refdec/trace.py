"""One record per decoding iteration, whatever the algorithm, and the text form of a sentence's trace.

Every decoder, asked for a trace (trace=True), returns a list of `Step`s per sentence
(DecodeResult.trace[b]), one per iteration, which describe an iteration the same way for all of them:

    drafted    what was proposed to the verifier in this call: the source span IAD copies, GAD's
               drafter block, blockwise's proposal heads, the small model's tokens (BiLD,
               speculative decoding); empty for greedy and beam search
    accepted   how many leading drafted tokens passed and were committed (drafted tokens after a
               committed eos, or past max_len, are not)
    own        the verifier's own token committed after them: at the bifurcation, or the free
               token when the whole draft passed, or greedy's token; None when the step ended on
               a drafted eos (or, for BiLD's last run, when the large model never checked it)
    rejected   drafted[accepted:], the drafted tokens that were not committed

The draft-then-verify decoders build theirs from a verification (refdec.decoding.verify.step_of).
`trace_text` is what `decode.py --trace` prints, one format per algorithm here: plain text, or
the same text with ANSI colours (`colour_enabled` decides for a stream). The HTML page draws the
same Steps (refdec.app.htmlreport), its tokens grouped into words as the trace's (`words`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One iteration (one verifier call; for BiLD's last run, the small model's unchecked tokens)."""

    drafted: tuple[int, ...] = ()
    accepted: int = 0
    own: int | None = None
    drafted_by: str = ""  # "source", "drafter", "heads", "small", or "" when nothing is drafted
    # IAD: where the match ends, as an index into (bos, x_1 .. x_n, eos): the output's last token is x_origin,
    # and the draft copies the source from x_(origin + 1) on, the source's token origin + 1 counting from 1
    origin: int | None = None
    rollback: bool = False  # BiLD: the large model rejected some of the small model's tokens
    verified: bool = True  # False: BiLD's final small-model tokens, which no large-model call checked
    beams: tuple[tuple[int, ...], ...] = ()  # beam search: the live beams after this step, best first
    scores: tuple[float, ...] = ()  # ... and their scores

    @property
    def rejected(self) -> tuple[int, ...]:
        return self.drafted[self.accepted :]

    @property
    def committed(self) -> tuple[int, ...]:
        """The tokens this iteration added to the output (beam search commits none until the end)."""
        return self.drafted[: self.accepted] + ((self.own,) if self.own is not None else ())


# Where a drafted token came from (Step.drafted_by), in the words of the terminal trace and the HTML page.
DRAFTED_FROM = {
    "source": "copied from the source",
    "drafter": "drafted by the drafter",
    "heads": "proposed by the heads",
    "small": "written by the small model",
}


def how_drafted(s: Step) -> str:
    """An iteration's draft in words: "4 copied from the source starting at its token 3, 2 accepted",
    where the copy starts: the source's tokens counted from 1 (its eos after the last), x_3 in the IAD
    papers' notation (Step.origin is the match before it)."""
    if not s.drafted:
        return "nothing drafted: a greedy step"
    where = f" starting at its token {s.origin + 1}" if s.origin is not None else ""
    return f"{len(s.drafted)} {DRAFTED_FROM[s.drafted_by]}{where}, {s.accepted} accepted"


def token_pieces(tokenizer):
    """token id -> (its text, whether a space leads it) for a token chip of the HTML page and greedy's
    trace: the token decoded alone, or its byte-level symbol when it is part of a multi-byte character."""
    memo: dict[int, tuple[str, bool]] = {}

    def piece(t: int) -> tuple[str, bool]:
        if t not in memo:
            if t == tokenizer.eos_id:
                memo[t] = ("</s>", True)
            else:
                text = tokenizer.decode([t])
                if "\ufffd" in text or not text:
                    text = tokenizer.tokens([t])[0]
                memo[t] = (text.lstrip(" ") or text, text.startswith(" "))
        return memo[t]

    return piece


def words(ids, piece) -> list[range]:
    """The words that token ids spell, as ranges of positions in ids (piece: token_pieces' function):
    a token whose text a space leads starts a word, any other (a subword piece, or punctuation written
    without a space: the "ly" of "unw|it|ting|ly", the "." of "sent|ence|.") continues the word before
    it. The trace prints a word's tokens with nothing but a | between them and a space before the word;
    the HTML page draws each word as one, its tokens' boundaries thin lines inside it."""
    starts = [i for i, t in enumerate(ids) if i == 0 or piece(t)[1]]
    return [range(a, b) for a, b in zip(starts, starts[1:] + [len(ids)])]


# ANSI colours of the trace's parts in a terminal.
COLOURS = {"accepted": "\x1b[32m", "own": "\x1b[1;36m", "rejected": "\x1b[31m", "note": "\x1b[2m"}
RESET = "\x1b[0m"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def colour_enabled(stream) -> bool:
    """Colour for a terminal, plain text when piped or redirected, and whenever NO_COLOR is set
    (no-color.org) or TERM is dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def print_traces(algo: str, traces: list, tokenizer, stream=None) -> None:
    """decode.py --trace: every sentence's trace (None for an empty line: skipped) on stderr, coloured
    in a terminal."""
    stream = stream or sys.stderr
    for i, steps in enumerate(traces):
        if steps is not None:
            print(trace_text(algo, i, steps, tokenizer, colour=colour_enabled(stream)), file=stream)


def strip_colour(text: str) -> str:
    return ANSI.sub("", text)


def iterations(n: int) -> str:
    return f"{n} iteration" + ("" if n == 1 else "s")


def trace_text(algo: str, index: int, steps: list[Step], tokenizer, *, colour: bool = False) -> str:
    """How sentence `index` was decoded by `algo` (its `steps`): greedy lists its one-by-one tokens,
    beam the best beam per step, the draft-then-verify decoders what was drafted and what was kept,
    iteration by iteration. With `colour`, the same text with the accepted span, the verifier's
    tokens and the rejected ones in ANSI colours."""

    def paint(part: str, s: str) -> str:
        return f"{COLOURS[part]}{s}{RESET}" if colour and s else s

    def text(ids):  # readable text of a span; eos shown as </s>
        ids = list(ids)
        cut = ids[:-1] if ids and ids[-1] == tokenizer.eos_id else ids
        return tokenizer.decode(cut) + (" </s>" if len(cut) < len(ids) else "")

    def own(s: Step) -> str:
        return text([s.own]) if s.own is not None else ""

    piece = token_pieces(tokenizer)

    def tokens(ids, part: str) -> list[str]:  # each token's own text, painted, a space before each word's first
        ids = list(ids)
        return [
            paint(part, " " * (i == w.start and piece(ids[i])[1]) + piece(ids[i])[0])
            for w in words(ids, piece)
            for i in w
        ]

    head = f"[{index + 1}]"
    if algo == "greedy":  # a | between tokens
        return f"{head} {iterations(len(steps))}, one token each: " + "|".join(tokens((s.own for s in steps), "own"))
    if algo == "beam":
        best = steps[-1].beams[0] if steps else ()
        return f"{head} {len(steps)} steps; best live beam at the end: " + text(best)
    if algo == "iad":
        # Like table 2 of the SAD paper: one line per iteration (one verifier call); a copied span
        # that the model accepted in parallel is in brackets, the token the model chose itself
        # (at the bifurcation, or in a plain greedy step) follows it.
        lines = [f"{head} {iterations(len(steps))} for {sum(len(s.committed) for s in steps)} tokens"]
        for it, s in enumerate(steps, 1):
            how = how_drafted(s)
            body = (paint("accepted", f"[{text(s.drafted[: s.accepted])}]") + " " if s.accepted else "") + paint(
                "own", own(s)
            )
            lines.append(f"  {it:3d}  {body}    {paint('note', f'({how})')}")
        return "\n".join(lines)
    if algo == "gad":  # like table 17 of the GAD paper: D = the drafter's block, V = what verification kept
        lines = [f"{head} {iterations(len(steps))}"]
        for it, s in enumerate(steps, 1):
            kept = s.drafted[: s.accepted]
            # the block token by token, as greedy's line: a | between tokens, the accepted ones first
            lines.append(f"  {it:3d} D: " + "|".join(tokens(kept, "accepted") + tokens(s.rejected, "rejected")))
            lines.append(
                f"      V: {paint('accepted', '[' + text(kept) + ']')} {paint('own', own(s))}"
                f"    {paint('note', f'({s.accepted} of {len(s.drafted)} drafted tokens accepted)')}"
            )
        return "\n".join(lines)
    if algo == "blockwise":  # like section 7.4: the tokens each step added; [ ] = accepted proposals
        return f"{head} {len(steps)} steps: " + " | ".join(
            (paint("accepted", f"[{text(s.drafted[: s.accepted])}]") if s.accepted else "") + paint("own", own(s))
            for s in steps
        )
    if algo in ("bild", "speculative"):  # like figure 9 of the BiLD paper: who wrote each token
        parts = []
        for s in steps:
            if s.accepted:
                parts.append(paint("accepted", "S(" + text(s.drafted[: s.accepted]) + ")"))
            if s.rollback:
                parts.append(paint("rejected", f"rollback x{len(s.rejected)}"))
            if s.own is not None:
                parts.append(paint("own", "L(" + own(s) + ")"))
        return f"{head} " + " ".join(parts) + "   " + paint("note", "(S = small model, L = large model)")
    raise ValueError(f"no trace format for algorithm {algo!r}")
