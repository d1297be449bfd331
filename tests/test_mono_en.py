"""data/mono-en and its build script: prose only, and nothing of the mt-en-de data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"
sys.path.insert(0, str(DATA))

from build_mono_en import RoffProse, SphinxProse, is_prose, overlap_key, prose_sentences, read_sources  # noqa: E402

PAGE = r""".\" SPDX-License-Identifier: Linux-man-pages-copyleft
.TH open 2 2023-02-05 "Linux man-pages 6.03"
.SH NAME
open \- open and possibly create a file
.SH SYNOPSIS
.nf
.B #include <fcntl.h>
.fi
.SH DESCRIPTION
The
.BR open ()
system call opens the file specified by
.IR pathname .
.\" a comment that is not text
It returns a file descriptor \(em a small integer.
.TP
.B O_CREAT
If the file does not exist, it will be created.
.PP
.EX
int fd = open("x", O_RDONLY);
.EE
Unknown \(zz escapes drop the paragraph.
.SH SEE ALSO
.BR close (2)
"""


def test_man_page_prose_leaves_out_synopsis_code_tags_and_see_also():
    """Guards against code, option tags or boilerplate sections leaking into the corpus."""
    assert RoffProse(PAGE).paragraphs == [
        "The open() system call opens the file specified by pathname. "
        "It returns a file descriptor \u2014 a small integer.",
        "If the file does not exist, it will be created.",
    ]


def test_sphinx_prose_keeps_paragraphs_not_code_or_signatures():
    """Guards against signatures, code blocks and tables read as sentences."""
    p = SphinxProse()
    p.feed(
        '<html><body><div class="sphinxsidebar"><p>Navigation text here.</p></div>'
        '<div role="main"><dl><dt>os.open(path)</dt><dd><p>Open the file <code>path</code>.</p></dd></dl>'
        '<div class="highlight"><pre>x = 1</pre></div><table><tr><td><p>Cell text.</p></td></tr></table>'
        '<p>Changed in <span class="versionmodified">Changed in version 3.3:</span> a note.</p></div>'
        '<div class="footer"><p>Copyright text.</p></div></body></html>'
    )
    p.close()
    assert p.paragraphs == ["Open the file path.", "Changed in a note."]


def test_prose_filter_and_overlap_key():
    assert is_prose("The file descriptor is used in calls to fanotify_mark(2).")
    assert is_prose("The use of the dirfd file descriptor also has other benefits:")
    assert not is_prose("For example:")  # too short
    assert not is_prose("Use d[k] = d.pop(k) to move the key.")  # code
    assert not is_prose("errno is set to EDOM.")  # starts in lower case
    assert prose_sentences(["gh-92173: Fix the defs argument. Patch by Dong-hee Na."]) == [
        "Fix the defs argument.",
        "Patch by Dong-hee Na.",
    ]
    assert overlap_key("I haven\u2019t the faintest idea.") == overlap_key("\"I haven't the  faintest IDEA.")


@pytest.mark.slow  # reads the whole shipped corpus
def test_shipped_corpus_holds_no_mt_en_de_sentence():
    """Guards against distilling a held-out sentence: no mono-en line shares its normalised key with
    an mt-en-de source, and no line repeats."""
    mono = read_sources(DATA / "mono-en" / "train.src.gz")
    docs = read_sources(DATA / "mono-en" / "train.doc.gz")
    assert len(mono) == len(docs) >= 200_000
    keys = [overlap_key(s) for s in mono]
    assert len(set(keys)) == len(keys)
    for split in ("test", "dev", "train"):
        mt = {overlap_key(s) for s in read_sources(DATA / "mt-en-de" / f"{split}.src.gz")}
        assert not mt & set(keys), split
