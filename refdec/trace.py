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
    rejected   drafted[accepted:], the drafted tokens that were not committed: those the verifier
               refused (BiLD's rolled-back tokens, blockwise's rejected proposals), and any after a
               drafted eos (GAD's drafter fills its whole block, mostly with eos, past the end)

and, for IAD, where the copy came from: `source`, the source's tokens, and `origin`, the source
token that the output's end matched.

The draft-then-verify decoders build theirs from a verification (refdec.decoding.verify.step_of).
`trace_text` is what `decode.py --trace` prints, one format per algorithm here, after the
algorithm's `legend` (`print_traces`): plain text, or the same text with ANSI colours
(`colour_enabled` decides for a stream). The HTML page draws the same Steps (refdec.app.htmlreport),
its tokens grouped into words as the trace's (`words`), with the same notes (`iad_notes`,
`accepted_note`).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
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
    source: tuple[int, ...] = ()  # IAD: the source the drafts are copied from, x_1 .. x_n, eos (every step)

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


def quoted(t: int, piece) -> str:
    """One token as the notes name it: its text in quotes as Python writes a string, with the space
    that leads it (' .' and '.' are different tokens)."""
    text, spaced = piece(t)
    return repr(" " * spaced + text)


def source_tokens(source, piece) -> str:
    """IAD's source as the notes count it: each token after its number, from 1 (the eos last), a word's
    tokens joined by |, as in greedy's trace: "1:He 2:unw|3:it|4:ting|5:ly 6:wrote 7:. 8:</s>"."""
    source = list(source)
    return " ".join("|".join(f"{i + 1}:{piece(source[i])[0]}" for i in w) for w in words(source, piece))


def iad_notes(steps: list[Step], piece) -> list[str]:
    """Each IAD iteration's note: how_drafted, after where the output's end matched the source (the
    source token that the copy follows, numbered as source_tokens numbers it) or, when nothing was
    drafted, why: the output's last token is not in the source, or is in it more than once and no
    longer end of the output is in it exactly once (the unique match policy's rule)."""
    notes, out = [], []
    for s in steps:
        how = how_drafted(s)
        if s.source and s.origin is not None and s.origin > 0:
            how = f"matched up to source token {s.origin} {quoted(s.source[s.origin - 1], piece)}; {how}"
        elif s.source and s.origin is None and out:
            last = out[-1]
            at = [i + 1 for i, t in enumerate(s.source) if t == last]
            if not at:
                how += f"; the output's last token {quoted(last, piece)} is not in the source"
            else:
                how += (
                    f"; the output's last token {quoted(last, piece)} is source tokens "
                    + ", ".join(map(str, at))
                    + ", and no longer end of the output is in the source exactly once"
                )
        notes.append(how)
        out += s.committed
    return notes


def accepted_note(s: Step, eos_id: int, noun: str = "drafted tokens", verb: str = "drafted") -> str:
    """A D/V or P/V line's note: how many of the drafted tokens were accepted, and how many follow a
    drafted eos (filler: a block is always full, and nothing after an eos is ever committed)."""
    note = f"{s.accepted} of {len(s.drafted)} {noun} accepted"
    after = len(s.drafted) - 1 - s.drafted.index(eos_id) if eos_id in s.drafted else 0
    if after:
        note += f"; the {after} after the {verb} </s> " + ("is filler" if after == 1 else "are filler")
    return note


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


# What each algorithm's trace shows, printed once above its sentences (docs/usage.md, "Reading a trace",
# has an example of each).
LEGENDS = {
    "greedy": "one model call per token: the tokens written, a | between tokens (a space before a word's first).",
    "beam": "the number of steps (one model call each, for every live beam) and the best beam still live "
    "after the last: the output is the best finished hypothesis (one that wrote </s>), which can differ.",
    "iad": "one line per model call. [...] = tokens copied from the source that the model accepted; then the "
    "model's own token, at the first copied token it refused or after the whole copy. The source line "
    "numbers the source's tokens from 1; a note gives the source token the output's end matched, where the "
    "copy starts, or why nothing was copied (a greedy step).",
    "gad": "per model call, D = the drafter's block (accepted tokens green, rejected red in a terminal), "
    "V = what verification committed: [the accepted drafted tokens] then the verifier's own token. The "
    "block always has k tokens: after the drafter's own </s> the rest is filler (mostly </s> again, "
    "positions it was never trained on), never committed.",
    "blockwise": "per model call, P = the proposal heads' tokens (accepted green, rejected red in a "
    "terminal), V = [the accepted proposals] then the model's own token (p_1's). The first call has no "
    "proposals: the heads propose from the state of the call before.",
    "bild": "S(...) = the small model's tokens that the large model kept; L(...) = the large model's own "
    "token, each time the small model was unsure and fell back; rolled back N token(s) (...) = the small "
    "model's tokens that the large model refused, thrown away before its own. An S(...) after the last "
    "L(...) ended the sentence (the small model's </s>, or max_len): no large-model call checked it.",
    "speculative": "S(...) = the small model's tokens that the large model accepted; rejected N token(s) "
    "(...) = those it refused, thrown away; L(...) = the large model's own token after them (a free one "
    "when every drafted token passed). An S(...) without an L(...) after it ended on a drafted </s>.",
}


def legend(algo: str) -> str:
    """The note above an algorithm's traces: what its marks mean."""
    return textwrap.fill(f"{algo} trace: {LEGENDS[algo]}", 100)


def print_traces(algo: str, traces: list, tokenizer, stream=None) -> None:
    """decode.py --trace: the algorithm's legend, then every sentence's trace (None for an empty line:
    skipped) on stderr, coloured in a terminal."""
    stream = stream or sys.stderr
    colour = colour_enabled(stream)
    if algo in LEGENDS and any(steps is not None for steps in traces):
        text = legend(algo)
        print(f"{COLOURS['note']}{text}{RESET}" if colour else text, file=stream)
    for i, steps in enumerate(traces):
        if steps is not None:
            print(trace_text(algo, i, steps, tokenizer, colour=colour), file=stream)


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
        # (at the bifurcation, or in a plain greedy step) follows it. Above them, the source's
        # tokens, numbered as the notes count them.
        lines = [f"{head} {iterations(len(steps))} for {sum(len(s.committed) for s in steps)} tokens"]
        if steps and steps[0].source:
            lines.append("      source: " + source_tokens(steps[0].source, piece))
        for it, (s, how) in enumerate(zip(steps, iad_notes(steps, piece)), 1):
            body = (paint("accepted", f"[{text(s.drafted[: s.accepted])}]") + " " if s.accepted else "") + paint(
                "own", own(s)
            )
            lines.append(f"  {it:3d}  {body}    {paint('note', f'({how})')}")
        return "\n".join(lines)
    if algo in ("gad", "blockwise"):
        # GAD like table 17 of its paper: D = the drafter's block, V = what verification kept; blockwise
        # the same, P = the proposal heads' tokens (none on the first call, section 4's merged step).
        mark, noun, verb = ("D", "drafted tokens", "drafted") if algo == "gad" else ("P", "proposals", "proposed")
        lines = [f"{head} {iterations(len(steps))}"]
        for it, s in enumerate(steps, 1):
            kept = s.drafted[: s.accepted]
            # the block token by token, as greedy's line: a | between tokens, the accepted ones first
            drafted = "|".join(tokens(kept, "accepted") + tokens(s.rejected, "rejected"))
            note = accepted_note(s, tokenizer.eos_id, noun, verb) if s.drafted else "no proposals yet"
            lines.append(f"  {it:3d} {mark}: " + (drafted if s.drafted else paint("note", "(none)")))
            lines.append(
                f"      V: {paint('accepted', '[' + text(kept) + ']')} {paint('own', own(s))}"
                f"    {paint('note', f'({note})')}"
            )
        return "\n".join(lines)
    if algo in ("bild", "speculative"):  # like figure 9 of the BiLD paper: who wrote each token
        gone = "rolled back" if algo == "bild" else "rejected"
        parts = []
        for s in steps:
            if s.accepted:
                parts.append(paint("accepted", "S(" + text(s.drafted[: s.accepted]) + ")"))
            if s.rejected:  # the small model's tokens the large model refused (BiLD: Step.rollback)
                n = len(s.rejected)
                parts.append(
                    paint("rejected", f"{gone} {n} token" + "s" * (n != 1) + " (")
                    + "|".join(tokens(s.rejected, "rejected"))
                    + paint("rejected", ")")
                )
            if s.own is not None:
                parts.append(paint("own", "L(" + own(s) + ")"))
        return f"{head} " + " ".join(parts) + "   " + paint("note", "(S = small model, L = large model)")
    raise ValueError(f"no trace format for algorithm {algo!r}")
