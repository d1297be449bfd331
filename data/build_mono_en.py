#!/usr/bin/env python3
"""Build `mono-en`: monolingual English sentences (sources without references) for distillation.

Sources:
  * the Linux manual pages, Debian `manpages` and `manpages-dev` 6.03-2: the roff sources of
    usr/share/man/man*/*.gz, read as prose only (see RoffProse);
  * the Python documentation, Debian `python3.11-doc` 3.11.2-6+deb12u9 (what `python3-doc` depends
    on): the <p> paragraphs of the Sphinx HTML pages (see SphinxProse);
  * the Brown corpus and the State of the Union addresses, read by build_gec_en.py's own loaders
    (the clean sentences gec-en draws its targets from).

Paragraphs are split into sentences with build_mt_en_de.py's splitter and kept when they look
like prose (build_gec_en.is_clean_sentence: 4-60 words, a capital or digit first, . ! or ? last,
none of []{}<>*|\\#@~^=+, at most 30% numbers; `_` is allowed in identifiers here). Sentences
are deduplicated across all sources on a normalised key (NFKC, case folded, straight quotes,
punctuation and spaces collapsed), first occurrence kept, and every sentence whose key occurs in
the mt-en-de dev, test or train sources is dropped (the counts are printed), so that the corpus
never holds a held-out sentence and adds only sources the translation data lacks.

Output (gzip, UTF-8, one sentence per line, mtime 0): <out>/train.src.gz and train.doc.gz (the
document: `man/<section>/<page>`, `python/<page>`, `brown/<file>`, `sotu/<address>`), in a fixed
order: manual pages, Python documentation, Brown, State of the Union, each in sorted document
order. Standard library plus `apt-get`, `dpkg-deb` and `tar`; rebuilds are byte-identical.
"""

import argparse
import gzip
import os
import re
import sys
import unicodedata
from html.parser import HTMLParser

from build_gec_en import fetch, load_brown, load_sotu
from build_mt_en_de import norm, split_sentences
from buildlib import fits_one_line, unpack_debs, write_gz

HERE = os.path.dirname(os.path.abspath(__file__))

# package -> tar wildcards of the members used
PACKAGES = {
    "manpages": ["./usr/share/man/man*/*.gz"],
    "manpages-dev": ["./usr/share/man/man*/*.gz"],
    "python3.11-doc": ["./usr/share/doc/python3.11/html/*.html", "./usr/share/doc/python3.11/html/*.html.gz"],
}
EXPECTED_VERSIONS = {"manpages": "6.03-2", "manpages-dev": "6.03-2", "python3.11-doc": "3.11.2-6+deb12u9"}

# ----------------------------------------------------------------------------- manual pages

# man(7) sections that hold no running prose
MAN_SKIP_SECTIONS = {
    "NAME",
    "SYNOPSIS",
    "LIBRARY",
    "SEE ALSO",
    "COLOPHON",
    "AUTHOR",
    "AUTHORS",
    "COPYRIGHT",
    "REPORTING BUGS",
}
# requests that end a paragraph
MAN_BREAKS = {
    "PP",
    "P",
    "LP",
    "TP",
    "TQ",
    "IP",
    "HP",
    "SH",
    "SS",
    "sp",
    "br",
    "RS",
    "RE",
    "in",
    "INDENT",
    "UNINDENT",
    "SY",
    "YS",
    "ti",
    "bp",
    "ne",
    "PD",
}
# font requests: their arguments are text, joined with spaces (B, I) or alternating without (BR...)
MAN_FONT_SPACED = {"B", "I", "SM", "SB"}
MAN_FONT_ALTERNATING = {"BR", "BI", "IR", "RB", "RI", "IB"}
# no-fill blocks (code, examples, tables, macro definitions): start -> end request
MAN_BLOCKS = {"nf": "fi", "EX": "EE", "TS": "TE", "de": "..", "EQ": "EN"}
# roff special characters \(xx and \[xx]
ROFF_CHARS = {
    "em": "\u2014",
    "en": "\u2013",
    "hy": "-",
    "aq": "'",
    "dq": '"',
    "lq": "\u201c",
    "rq": "\u201d",
    "oq": "\u2018",
    "cq": "\u2019",
    "bu": "\u2022",
    "co": "\u00a9",
    "rg": "\u00ae",
    "tm": "\u2122",
    "mu": "\u00d7",
    "di": "\u00f7",
    "+-": "\u00b1",
    "<=": "\u2264",
    ">=": "\u2265",
    "!=": "\u2260",
    "ti": "~",
    "ha": "^",
    "ga": "`",
    "rs": "\\",
    "sl": "/",
    "ul": "_",
    "pl": "+",
    "mi": "-",
    "eq": "=",
    "dg": "\u2020",
    "de": "\u00b0",
    "->": "\u2192",
    "<-": "\u2190",
    "Fo": "\u00ab",
    "Fc": "\u00bb",
    "fo": "\u2039",
    "fc": "\u203a",
    "ss": "\u00df",
    'a"': "\u00e4",
    'o"': "\u00f6",
    'u"': "\u00fc",
    "e'": "\u00e9",
    "`e": "\u00e8",
    "'e": "\u00e9",
    "lh": "\u261c",
    "rh": "\u261e",
    "at": "@",
    "sh": "#",
    "Do": "$",
    "ct": "\u00a2",
    "Eu": "\u20ac",
    "Po": "\u00a3",
    "ps": "\u00b6",
    "sc": "\u00a7",
    "fm": "\u2032",
    "sd": "\u2033",
    "or": "|",
    "ba": "|",
    "dd": "\u2021",
}
ROFF_STRINGS = {"lq": "\u201c", "rq": "\u201d", "R": "\u00ae", "Tm": "\u2122"}
ROFF_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)"  # font change
    r"|\((..)|\[([^\]]*)\]"  # special character \(xx \[name]
    r"|\*(?:\((..)|\[([^\]]*)\]|(.))"  # string \*x \*(xx \*[name]
    r"|s[-+]?(?:\d|\(\d\d|\[\d+\])"  # size change
    r"|[hvwmMNoDlLbxXkzY]'[^']*'|[kzmMYn](?:\[[^\]]*\]|\(..|.)"  # motions and registers
    r"|(.))"
)  # one-character escape
ROFF_SIMPLE = {
    "-": "-",
    "e": "\\",
    "\\": "\\",
    "&": "",
    "~": " ",
    " ": " ",
    "0": " ",
    "|": "",
    "^": "",
    "%": "",
    ":": "",
    ",": "",
    "/": "",
    "c": "",
    "'": "'",
    "`": "`",
    ".": ".",
    "t": " ",
    "a": "",
    "d": "",
    "u": "",
    "p": "",
    "r": "",
}


def roff_text(s):
    """Roff text with escapes resolved; None when it holds an escape this reader does not know."""
    unknown = False

    def sub(m):
        nonlocal unknown
        named = m.group(1) or m.group(2)
        if named is not None:
            if named not in ROFF_CHARS:
                unknown = True
            return ROFF_CHARS.get(named, "")
        string = m.group(3) or m.group(4) or m.group(5)
        if string is not None:
            if string not in ROFF_STRINGS:
                unknown = True
            return ROFF_STRINGS.get(string, "")
        one = m.group(6)
        if one is None:
            return ""
        if one not in ROFF_SIMPLE:
            unknown = True
        return ROFF_SIMPLE.get(one, "")

    out = ROFF_ESCAPE.sub(sub, s)
    return None if unknown else out


def roff_args(s):
    """Arguments of a request line, with roff's double-quote rules."""
    args, cur, quoted, i, has = [], [], False, 0, False
    while i < len(s):
        c = s[i]
        if quoted:
            if c == '"':
                if s[i + 1 : i + 2] == '"':
                    cur.append('"')
                    i += 1
                else:
                    quoted = False
            else:
                cur.append(c)
        elif c == '"' and not cur:
            quoted, has = True, True
        elif c in " \t":
            if cur or has:
                args.append("".join(cur))
            cur, has = [], False
        elif c == "\\" and i + 1 < len(s):
            cur.append(s[i : i + 2])
            i += 1
        else:
            cur.append(c)
        i += 1
    if cur or has:
        args.append("".join(cur))
    return args


class RoffProse:
    """Running text of a man(7) page: the paragraphs outside no-fill blocks (.nf/.fi, .EX/.EE),
    tables (.TS/.TE), macro definitions and the NAME, SYNOPSIS, SEE ALSO, ... sections; the tags of
    .TP/.TQ/.IP items (option names, constants) are left out, their descriptions kept. A paragraph
    holding an escape this reader cannot render is dropped whole."""

    def __init__(self, text):
        self.paragraphs = []
        self.parts = []
        self.bad = False
        self.section = ""
        self.block_end = None
        self.skip_next_line = False
        lines = text.replace("\\\n", "").split("\n")
        for line in lines:
            self.line(line)
        self.flush()

    def flush(self):
        if self.parts and not self.bad and self.section not in MAN_SKIP_SECTIONS:
            text = norm("".join(self.parts))
            if text:
                self.paragraphs.append(text)
        self.parts, self.bad = [], False

    def add(self, s, space=True):
        t = roff_text(s)
        if t is None:
            self.bad = True
            return
        if space and self.parts:
            self.parts.append(" ")
        self.parts.append(t)

    def line(self, line):
        if line.startswith(('.\\"', "'\\\"", ".\\#", '\\"')):
            return
        m = re.search(r'(?<!\\)\\["#]', line)
        if m:
            line = line[: m.start()]
        if self.block_end is not None:
            if re.match(r"^[.']\s*" + re.escape(self.block_end) + r"\b", line) or (
                self.block_end == ".." and line.strip() == ".."
            ):
                self.block_end = None
            return
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name in MAN_BLOCKS:
                self.flush()
                self.block_end = MAN_BLOCKS[name]
                return
            if name in MAN_BREAKS:
                self.flush()
                if name == "SH":
                    self.section = " ".join(roff_text(a) or "" for a in roff_args(rest)).strip().upper()
                self.skip_next_line = name in ("TP", "TQ")
                return
            args = roff_args(rest)
            if name in MAN_FONT_SPACED or name in MAN_FONT_ALTERNATING:
                if self.skip_next_line:  # a .TP tag written as a font request
                    self.skip_next_line = False
                    return
                if not args:
                    return  # the font applies to the next line, which is read as text
                self.add((" " if name in MAN_FONT_SPACED else "").join(args))
            elif name == "UE":  # end of a link: trailing punctuation follows without a space
                self.add("".join(args), space=False)
            elif name in ("so", "if", "ie", "el", "TH"):
                if name == "so":
                    self.bad = True
                return
            # any other request (.ad, .nh, .hy, .UR, .ft, ...) carries no text
            return
        if self.skip_next_line:
            self.skip_next_line = False
            return
        if not line.strip():
            self.flush()
            return
        self.add(line)


def read_manpages(roots):
    """{doc: [paragraphs]} over the man pages of both packages, `man/<section>/<page>` sorted."""
    docs = {}
    for root in roots:
        base = os.path.join(root, "usr/share/man")
        for sec in sorted(os.listdir(base)):
            for name in sorted(os.listdir(os.path.join(base, sec))):
                path = os.path.join(base, sec, name)
                if not name.endswith(".gz") or os.path.islink(path):
                    continue
                with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                    text = f.read()
                paras = RoffProse(text).paragraphs
                if paras:
                    docs[f"man/{sec[3:]}/{name[:-3]}"] = paras
    return dict(sorted(docs.items()))


# ----------------------------------------------------------------------------- Python docs


class SphinxProse(HTMLParser):
    """Text of the <p> elements in a Sphinx page's body, leaving out code (pre, highlight
    blocks), tables, signatures (<dt>), navigation, sidebars, footers and header links."""

    SKIP_TAGS = {"pre", "table", "dt", "script", "style", "head", "nav", "footer", "sup"}
    SKIP_CLASSES = {
        "highlight",
        "sphinxsidebar",
        "related",
        "footer",
        "headerlink",
        "admonition-title",
        "versionmodified",
        "doctest",
        "rubric",
        "toctree-wrapper",
    }

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs = []
        self.stack = []  # open tags inside a skipped element
        self.in_body = 0
        self.parts = None

    def skips(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        return tag in self.SKIP_TAGS or any(c.split("-")[0] in self.SKIP_CLASSES or c in self.SKIP_CLASSES for c in cls)

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "input", "meta", "link", "wbr"):
            return
        if self.stack:
            self.stack.append(tag)
            return
        if self.skips(tag, attrs):
            self.stack.append(tag)
            return
        if tag == "div" and dict(attrs).get("role") == "main":
            self.in_body = 1
        elif self.in_body and tag == "div":
            self.in_body += 1
        if tag == "p" and self.in_body:
            self.parts = []

    def handle_endtag(self, tag):
        if self.stack:
            if tag in self.stack:
                while self.stack and self.stack.pop() != tag:
                    pass
            return
        if tag == "div" and self.in_body:
            self.in_body -= 1
        if tag == "p" and self.parts is not None:
            text = norm("".join(self.parts))
            if text:
                self.paragraphs.append(text)
            self.parts = None

    def handle_data(self, data):
        if not self.stack and self.parts is not None:
            self.parts.append(data)


PYTHON_SKIP_PAGES = {"genindex", "py-modindex", "search", "contents", "download"}


def read_python_docs(root):
    """{`python/<page>`: [paragraphs]} over the HTML pages, sorted."""
    base = os.path.join(root, "usr/share/doc/python3.11/html")
    docs = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), base)
            page = re.sub(r"\.html(\.gz)?$", "", rel)
            if page == rel or page in PYTHON_SKIP_PAGES or name.startswith("genindex"):
                continue
            p = SphinxProse()
            with (gzip.open if name.endswith(".gz") else open)(
                os.path.join(dirpath, name), "rt", encoding="utf-8"
            ) as f:
                p.feed(f.read())
            p.close()
            if p.paragraphs:
                docs["python/" + page] = p.paragraphs
    return dict(sorted(docs.items()))


# ----------------------------------------------------------------------------- sentences

MIN_WORDS, MAX_WORDS = 3, 80
CODE_CHARS = set("[]{}<>*|\\#@~^=+$")
ISSUE_REF = re.compile(r"^(?:gh-|bpo-|Issue #|issue #)\d+: ")


def is_prose(s):
    """A documentation sentence that reads as prose: 3-80 words with at least three words of
    letters, a capital, digit or opening quote/parenthesis first, a full stop, ! ? or : last
    (optionally before a closing quote/parenthesis), none of the characters of code or markup
    (CODE_CHARS; `_` in identifiers is allowed), no `...`, at most 30% numbers."""
    if not fits_one_line(s) or set(s) & CODE_CHARS or "..." in s:
        return False
    words = s.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or sum(1 for w in words if re.search(r"[a-z]{2}", w)) < 3:
        return False
    if not re.match(r"^[\"'(\u201c\u2018]?[A-Z0-9]", s) or not re.search(r"[.!?:][\"')\u201d\u2019]?$", s):
        return False
    numbers = sum(1 for w in re.findall(r"\w+", s) if re.fullmatch(r"[\d.,]+", w))
    return numbers <= 0.3 * len(words)


def prose_sentences(paragraphs):
    """The sentences of `paragraphs` that read as prose (is_prose); a changelog entry's leading
    issue reference (`gh-92173: `) is removed first."""
    return [s for para in paragraphs for s in split_sentences(ISSUE_REF.sub("", para)) if is_prose(s)]


QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "`": "'"})


def overlap_key(s):
    """Normalised form used for deduplication and the held-out check: NFKC, case folded, straight
    quotes, every run of characters that are neither letters nor digits turned into one space."""
    s = unicodedata.normalize("NFKC", s).casefold().translate(QUOTES)
    return " ".join(re.findall(r"[^\W_]+", s))


def read_sources(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Build data/mono-en: English sentences from the Linux manual pages, the Python "
        "documentation, the Brown corpus and the State of the Union addresses, without "
        "any sentence of the mt-en-de data."
    )
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(HERE, ".cache"),
        help="folder for the downloaded packages and their extracted files (default: %(default)s)",
    )
    ap.add_argument("--out-dir", default=os.path.join(HERE, "mono-en"), help="output folder (default: %(default)s)")
    ap.add_argument(
        "--mt-dir",
        default=os.path.join(HERE, "mt-en-de"),
        help="mt-en-de folder whose sources are kept out (default: %(default)s)",
    )
    args = ap.parse_args(argv)

    roots = unpack_debs(args.cache_dir, PACKAGES, EXPECTED_VERSIONS, "mono-en-extracted")

    sources = [
        ("man", read_manpages([roots["manpages"], roots["manpages-dev"]])),
        ("python", read_python_docs(roots["python3.11-doc"])),
        ("brown", load_brown(fetch(args.cache_dir, "brown"))[0]),
        ("sotu", load_sotu(fetch(args.cache_dir, "stdlib"))),
    ]
    held_out, exact = {}, {}
    for split in ("test", "dev", "train"):
        for s in read_sources(os.path.join(args.mt_dir, f"{split}.src.gz")):
            held_out.setdefault(overlap_key(s), split)
            exact.setdefault(s, split)

    seen = set()
    src, doc = [], []
    print(
        "sentences per source (documents, prose sentences, after deduplication, "
        "dropped as in mt-en-de test / dev / train (of which the same string), kept):"
    )
    totals, rows = [0] * 8, []
    for name, docs in sources:
        n_sent = n_unique = 0
        dropped = {"test": 0, "dev": 0, "train": 0}
        n_exact = 0
        for d, paras in docs.items():
            sents = paras if name in ("brown", "sotu") else prose_sentences(paras)
            for s in sents:
                n_sent += 1
                key = overlap_key(s)
                if key in seen:
                    continue
                seen.add(key)
                n_unique += 1
                if key in held_out:
                    dropped[held_out[key]] += 1
                    n_exact += s in exact
                    continue
                src.append(s)
                doc.append(d)
        kept = n_unique - sum(dropped.values())
        row = [len(docs), n_sent, n_unique, dropped["test"], dropped["dev"], dropped["train"], n_exact, kept]
        totals = [a + b for a, b in zip(totals, row)]
        rows.append(row)
    for name, row in [*zip([n for n, _ in sources], rows), ("total", totals)]:
        print(
            f"  {name:8s} {row[0]:6d} docs {row[1]:8d} {row[2]:8d}  {row[3]:4d} / {row[4]:4d} / {row[5]:5d}"
            f" ({row[6]:2d} exact)  {row[7]:8d}"
        )
    assert all(fits_one_line(s) for s in src)
    words = sum(len(s.split()) for s in src)
    print(f"mono-en: {len(src)} sentences, {len(set(doc))} documents, mean {words / len(src):.1f} words")
    os.makedirs(args.out_dir, exist_ok=True)
    write_gz(os.path.join(args.out_dir, "train.src.gz"), src)
    write_gz(os.path.join(args.out_dir, "train.doc.gz"), doc)
    size = sum(os.path.getsize(os.path.join(args.out_dir, f"train.{k}.gz")) for k in ("src", "doc"))
    print(f"wrote {args.out_dir}/train.{{src,doc}}.gz ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
