#!/usr/bin/env python3
"""Build the English->German parallel corpus ``mt-en-de`` from Debian packages.

Sources (all downloaded with ``apt-get download`` into the cache folder):

* ``trans-de-en``: the Ding German-English dictionary; only entries that are
  full sentences on both sides are used.
* ``libreoffice-help-en-us`` / ``libreoffice-help-de``: aligned on the
  ``par_id...`` / ``hd_id...`` element ids that both languages share.
* ``debian-handbook``, ``gimp-help-en``/``-de``, ``debian-reference-en``/``-de``,
  ``gnome-user-docs``, ``developers-reference``/``-de``, ``debian-faq``/``-de``:
  block elements aligned in document order, only in files whose block counts
  agree in both languages.

Aligned blocks are split into sentences where both sides have the same number
of sentences (otherwise the whole block is kept), cleaned (entities, markup,
whitespace) and filtered (3-80 English words, German side not identical to
and not looking like English, plausible length ratio, unique pairs).

The split is by document: test = LibreOffice ``schart`` + ``sdraw`` help
modules + 1,000 random Ding sentences, dev = LibreOffice ``smath`` module +
500 random Ding sentences (sampled by dictionary entry), train = the rest;
train pairs whose English side (lowercased) occurs in dev or test are removed,
and so are dev pairs whose English side occurs in test.

Output (gzip, UTF-8, one item per line, mtime 0 so rebuilds are byte-identical):
``{train,dev,test}.{src,tgt,doc}.gz`` with src = English, tgt = German and
doc = a document id such as ``libreoffice/schart/01/04010000`` or ``ding/12345``.

Only the Python standard library and the ``apt-get``/``dpkg-deb``/``tar``
commands are used.
"""

import argparse
import glob
import html
import os
import random
import re
from collections import OrderedDict
from html.parser import HTMLParser

from buildlib import unpack_debs, write_gz

SEED = 1234
N_DING_TEST = 1000
N_DING_DEV = 500
MIN_WORDS, MAX_WORDS = 3, 80
TEST_MODULES = ("schart", "sdraw")
DEV_MODULES = ("smath",)

HERE = os.path.dirname(os.path.abspath(__file__))

# package -> tar wildcards of the members we need (keeps extraction small)
PACKAGES = OrderedDict(
    [
        ("trans-de-en", ["./usr/share/trans/de-en"]),
        ("libreoffice-help-en-us", ["./usr/share/libreoffice/help/en-US/text/*.html"]),
        ("libreoffice-help-de", ["./usr/share/libreoffice/help/de/text/*.html"]),
        (
            "debian-handbook",
            ["./usr/share/doc/debian-handbook/html/en-US/*.html", "./usr/share/doc/debian-handbook/html/de-DE/*.html"],
        ),
        ("gimp-help-en", ["./usr/share/gimp/2.0/help/en/*.html"]),
        ("gimp-help-de", ["./usr/share/gimp/2.0/help/de/*.html"]),
        ("debian-reference-en", ["./usr/share/debian-reference/*.en.html"]),
        ("debian-reference-de", ["./usr/share/debian-reference/*.de.html"]),
        ("gnome-user-docs", ["./usr/share/help/C/*.page", "./usr/share/help/de/*.page"]),
        ("developers-reference", ["./usr/share/developers-reference/*.html"]),
        ("developers-reference-de", ["./usr/share/developers-reference/de/*.html"]),
        ("debian-faq", ["./usr/share/doc/debian/FAQ/*.en.html"]),
        ("debian-faq-de", ["./usr/share/doc/debian/FAQ/de/*.de.html"]),
    ]
)

# versions this corpus was built from (Debian 12 "bookworm"); others still work but give other counts
EXPECTED_VERSIONS = {
    "trans-de-en": "1.9-6",
    "libreoffice-help-en-us": "4:7.4.7-1+deb12u14",
    "libreoffice-help-de": "4:7.4.7-1+deb12u14",
    "debian-handbook": "11.20220922",
    "gimp-help-en": "2.10.34-2",
    "gimp-help-de": "2.10.34-2",
    "debian-reference-en": "2.100",
    "debian-reference-de": "2.100",
    "gnome-user-docs": "43.0-2",
    "developers-reference": "12.18",
    "developers-reference-de": "12.18",
    "debian-faq": "11.1",
    "debian-faq-de": "11.1",
}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------
# text helpers

WS = re.compile(r"\s+")


def norm(text):
    text = html.unescape(text)
    text = text.replace("\u00ad", "").replace("\u200b", "").replace("\ufeff", "")
    text = text.replace("\u00b6", "")  # sphinx header-link pilcrows
    return WS.sub(" ", text).strip()


# abbreviations after which a period does not end a sentence
ABBREV = set(
    """e.g i.e etc vs cf resp approx fig no nr z.b d.h u.a bzw usw vgl ggf ca evtl inkl
bspw s.o s.u z.t u.u o.a o.ä dr mr mrs ms prof st abb tab kap abs ff sog z.zt""".split()
)
SENT_SPLIT = re.compile(r"(?<=[.!?])[\"'”“»«)]*\s+(?=[\"'„“«»(]?[A-ZÄÖÜ0-9])")


def split_sentences(text):
    parts, start = [], 0
    for m in SENT_SPLIT.finditer(text):
        before = text[start : m.start()].rstrip(".!?\"'”“»«)")
        last = before.split()[-1].lower() if before.split() else ""
        if text[m.start() - 1] == "." and (
            last in ABBREV or len(last) <= 1 or last.isdigit() or re.fullmatch(r"(\w\.)+\w", last)
        ):
            continue
        parts.append(text[start : m.end()].strip())
        start = m.end()
    parts.append(text[start:].strip())
    return [p for p in parts if p]


EN_WORDS = set(
    """the and of to is are this that with for you your it be can from or by on
which have has if when these there their they we our should would could been does do
how what where who why any each into than then only use used using click select
choose following page file files window menu options""".split()
)
DE_WORDS = set(
    """der die das und ist nicht mit für ein eine einen einem einer eines sie zu von auf
den dem des werden wird können kann sich oder im zum zur auch bei nach wenn sind wie aus über
nur noch diese dieser dieses diesem wir ich er es ihr ihre ihren man wählen klicken sie dass
hier dann sowie um unter bis durch wählt wurde wurden kein keine einer soll sollte müssen muss
datei dateien seite fenster menü dialog schaltfläche befehl""".split()
)
TOKEN = re.compile(r"[A-Za-zÄÖÜäöüß]+")


def looks_english(de):
    toks = [t.lower() for t in TOKEN.findall(de)]
    if not toks:
        return True  # nothing German-looking at all (numbers, symbols, code)
    en = sum(t in EN_WORDS for t in toks)
    ge = sum(t in DE_WORDS for t in toks) + sum(bool(re.search("[äöüß]", t)) for t in toks)
    return en >= 1 and en > ge


def keep_pair(en, de):
    if not en or not de:
        return False
    n = len(en.split())
    if n < MIN_WORDS or n > MAX_WORDS:
        return False
    if de.lower() == en.lower() or looks_english(de):
        return False
    if not re.search("[A-Za-z]", en):
        return False
    ratio = len(de) / len(en)
    return 0.4 <= ratio <= 3.0


def sentence_pairs(en, de):
    """Pair the sentences of two aligned blocks if their counts agree, else keep the blocks."""
    es, ds = split_sentences(en), split_sentences(de)
    if len(es) == len(ds) and len(es) > 1:
        return list(zip(es, ds))
    return [(en, de)]


# --------------------------------------------------------------------------
# Ding dictionary

DING_TAGS = re.compile(r"\s*(\{[^}]*\}|\[[^\]]*\]|<[^>]*>)")
DING_XREF = re.compile(r"\s*~\S+")
DING_ABBR = re.compile(r"\s+/(?! )[^/|]+/(?=\s*(?:;|\||$))")
DING_SLASH = re.compile(r"\b([A-Za-zÄÖÜäöüß’']+)/([A-Za-zÄÖÜäöüß’']+)\b")
DING_PLACEHOLDER = re.compile(r"\b(sb|sth|jd|jdn|jdm|jds|etw)\.|\bsb’s\b|…|\.\.\.")
KEEP_SLASH = {"and/or", "und/oder", "km/h"}
SENT_START = re.compile(r"^[\"'„“‚‘»«¿¡(]?[A-ZÄÖÜ]")
SENT_END = re.compile(r"[.!?][\"'“”‘’«»)]?$")


def ding_clean(s):
    s = DING_TAGS.sub("", s)
    s = DING_XREF.sub("", s)
    s = s.replace("(", "").replace(")", "")  # optional material: keep it, drop brackets
    s = DING_SLASH.sub(lambda m: m.group(0) if m.group(0).lower() in KEEP_SLASH else m.group(1), s)
    return WS.sub(" ", s).strip()


def ding_is_sentence(s):
    return (
        bool(SENT_START.search(s))
        and bool(SENT_END.search(s))
        and " / " not in s
        and "/" not in s.replace("and/or", "").replace("und/oder", "")
        and not DING_PLACEHOLDER.search(s)
    )


def read_ding(root):
    path = os.path.join(root, "usr/share/trans/de-en")
    out = []  # (doc, en, de)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.startswith("#") or " :: " not in line:
                continue
            de_side, en_side = line.rstrip("\n").split(" :: ", 1)
            de_side, en_side = DING_ABBR.sub("", de_side), DING_ABBR.sub("", en_side)
            des, ens = de_side.split(" | "), en_side.split(" | ")
            if len(des) != len(ens):
                continue
            for d, e in zip(des, ens):
                da = [x for x in (ding_clean(a) for a in d.split("; ")) if ding_is_sentence(x)]
                ea = [x for x in (ding_clean(a) for a in e.split("; ")) if ding_is_sentence(x)]
                if not da or not ea:
                    continue
                pairs = list(zip(ea, da)) if len(da) == len(ea) else [(ea[0], da[0])]
                for en, de in pairs:
                    out.append((f"ding/{lineno}", en, de))
    return out


# --------------------------------------------------------------------------
# HTML parsing


class IdParser(HTMLParser):
    """Collects the text of elements whose id starts with par_id / hd_id (LibreOffice help).

    Inline switches (``<span class="switchinline">`` with one hidden ``<span>`` per
    system or application, e.g. MAC / default) keep only the ``default`` case, or the
    first case where there is none, so that the text reads as one variant.
    """

    SKIP_CLASSES = {"code", "codeintable", "smathcode", "bascode", "youtube_consent"}
    VOID = {"br", "img", "meta", "link", "input", "hr", "area", "base", "col", "embed", "source", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.texts = OrderedDict()
        # entries: {"tag", "id", "parts", "switch" (dict of cases or None), "case" (name or None)}
        self.stack = []

    def _parts(self):
        return self.stack[-1]["parts"] if self.stack else None

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            if tag == "br" and self.stack:
                self.stack[-1]["parts"].append(" ")
            return
        a = dict(attrs)
        ident = a.get("id") or ""
        entry = {"tag": tag, "id": None, "parts": self._parts(), "switch": None, "case": None}
        if ident.startswith(("par_id", "hd_id")) and a.get("class") not in self.SKIP_CLASSES:
            entry["id"], entry["parts"] = ident, []
        elif not self.stack:
            return
        if "switchinline" in (a.get("class") or "").split():
            entry["switch"], entry["parts"] = OrderedDict(), []
        elif self.stack and self.stack[-1]["switch"] is not None and "hidden" in a:
            entry["case"], entry["parts"] = ident or str(len(self.stack[-1]["switch"])), []
        self.stack.append(entry)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i]["tag"] == tag:
                while len(self.stack) > i:
                    self._close(self.stack.pop())
                return

    def _close(self, e):
        parent = self.stack[-1] if self.stack else None
        if e["case"] is not None and parent is not None and parent["switch"] is not None:
            parent["switch"][e["case"]] = "".join(e["parts"])
        elif e["switch"] is not None:
            cases = e["switch"]
            chosen = next(
                (v for k, v in cases.items() if k.startswith("default")),
                next(iter(cases.values()), "".join(e["parts"])),
            )
            if parent is not None:
                parent["parts"].append(chosen)
        if e["id"] is not None:
            if e["id"] not in self.texts:
                self.texts[e["id"]] = norm("".join(e["parts"]))
            if parent is not None and parent["parts"] is not e["parts"]:
                parent["parts"].append("".join(e["parts"]))

    def handle_data(self, data):
        if self.stack:
            self.stack[-1]["parts"].append(data)


class BlockParser(HTMLParser):
    """Splits a document into text segments at block-element boundaries, in order."""

    BLOCKS = {
        "p",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "li",
        "dt",
        "dd",
        "td",
        "th",
        "caption",
        "div",
        "blockquote",
        "figcaption",
        "table",
        "tr",
        "ul",
        "ol",
        "dl",
        "body",
        "section",
        "article",
        "header",
        "footer",
        "nav",
        "title",
        "desc",
        "item",
        "note",
        "terms",
        "tree",
        "list",
        "steps",
        "figure",
        "example",
        "synopsis",
        "page",
        "links",
        "br",
        "hr",
        "subtitle",
        "thead",
        "tbody",
    }
    SKIP = {"script", "style", "pre", "head", "screen", "credit", "license", "revision", "media", "sup", "comment"}

    def __init__(self, skip_classes=()):
        super().__init__(convert_charrefs=True)
        self.segments = []
        self.parts = []
        self.skip_depth = 0
        self.skip_stack = []  # tags that opened a skip zone
        self.skip_classes = set(skip_classes)
        self.bad = False  # segment contains an empty link (auto-generated text missing)
        self.link_text = None

    def flush(self):
        text = norm("".join(self.parts))
        if text and not self.bad:
            self.segments.append(text)
        self.parts = []
        self.bad = False

    def _skips(self, tag, attrs):
        if tag in self.SKIP:
            return True
        cls = (dict(attrs).get("class") or "").split()
        return any(c in self.skip_classes for c in cls)

    def handle_starttag(self, tag, attrs):
        tag = tag.rsplit(":", 1)[-1]
        if self.skip_stack:
            if tag == self.skip_stack[-1]:
                self.skip_depth += 1
            return
        if self._skips(tag, attrs):
            self.skip_stack.append(tag)
            self.skip_depth = 1
            return
        if tag in self.BLOCKS:
            self.flush()
        elif tag in ("a", "link") and any(k in ("href", "xref") for k, _ in attrs):
            self.link_text = len(self.parts)

    def handle_startendtag(self, tag, attrs):
        tag = tag.rsplit(":", 1)[-1]
        if self.skip_stack:
            return
        if tag in ("link", "a") and any(k in ("href", "xref") for k, _ in attrs):
            self.bad = True  # <link xref="..."/>: its text is generated at render time
        elif tag in self.BLOCKS:
            self.flush()

    def handle_endtag(self, tag):
        tag = tag.rsplit(":", 1)[-1]
        if self.skip_stack:
            if tag == self.skip_stack[-1]:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_stack.pop()
            return
        if tag in self.BLOCKS:
            self.flush()
        elif tag in ("a", "link") and self.link_text is not None:
            if not "".join(self.parts[self.link_text :]).strip():
                self.bad = True
            self.link_text = None

    def handle_data(self, data):
        if not self.skip_stack:
            self.parts.append(data)

    def close(self):
        super().close()
        self.flush()


def read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def parse_ids(path):
    p = IdParser()
    p.feed(read_text(path))
    p.close()
    return p.texts


FOOTNOTE = re.compile(r"\[\d+\]")


def parse_blocks(path, skip_classes=()):
    p = BlockParser(skip_classes)
    p.feed(read_text(path))
    p.close()
    return [WS.sub(" ", FOOTNOTE.sub("", s)).strip() for s in p.segments]


# --------------------------------------------------------------------------
# per-source readers: each returns (pairs, stats) with pairs = [(doc, en, de)]


def read_libreoffice(en_root, de_root):
    en_base = os.path.join(en_root, "usr/share/libreoffice/help/en-US/text")
    de_base = os.path.join(de_root, "usr/share/libreoffice/help/de/text")
    files = sorted(os.path.relpath(p, en_base) for p in glob.glob(os.path.join(en_base, "**/*.html"), recursive=True))
    out, nfiles = [], 0
    for rel in files:
        de_path = os.path.join(de_base, rel)
        if not os.path.exists(de_path):
            continue
        nfiles += 1
        en_t, de_t = parse_ids(os.path.join(en_base, rel)), parse_ids(de_path)
        doc = "libreoffice/" + rel[: -len(".html")]
        for ident, en in en_t.items():
            de = de_t.get(ident)
            if de:
                for e, d in sentence_pairs(en, de):
                    out.append((doc, e, d))
    return out, f"{nfiles} files"


def align_files(name, pairs_of_files, skip_classes=()):
    """pairs_of_files: sorted [(doc, en_path, de_path)]; blocks aligned where counts agree."""
    out, ok = [], 0
    for doc, en_path, de_path in pairs_of_files:
        es, ds = parse_blocks(en_path, skip_classes), parse_blocks(de_path, skip_classes)
        if len(es) != len(ds):
            continue
        ok += 1
        for e, d in zip(es, ds):
            for en, de in sentence_pairs(e, d):
                out.append((doc, en, de))
    return out, f"{ok}/{len(pairs_of_files)} files aligned"


def file_pairs(prefix, en_glob, de_fn, exclude=()):
    res = []
    for en_path in sorted(glob.glob(en_glob, recursive=True)):
        base = os.path.basename(en_path)
        if base in exclude:
            continue
        de_path = de_fn(en_path)
        if os.path.exists(de_path):
            doc = prefix + re.sub(r"(\.en)?\.html$", "", base)
            res.append((doc, en_path, de_path))
    return res


def read_handbook(root):
    base = os.path.join(root, "usr/share/doc/debian-handbook/html")
    fp = file_pairs("debian-handbook/", os.path.join(base, "en-US/*.html"), lambda p: p.replace("/en-US/", "/de-DE/"))
    return align_files(
        "debian-handbook", fp, skip_classes={"navfooter", "navheader", "programlisting", "screen", "indexterm"}
    )


def read_gimp(en_root, de_root):
    en_base = os.path.join(en_root, "usr/share/gimp/2.0/help/en")
    de_base = os.path.join(de_root, "usr/share/gimp/2.0/help/de")
    fp = file_pairs("gimp-help/", os.path.join(en_base, "*.html"), lambda p: os.path.join(de_base, os.path.basename(p)))
    return align_files(
        "gimp-help", fp, skip_classes={"navfooter", "navheader", "programlisting", "screen", "indexterm"}
    )


def read_debref(en_root, de_root):
    en_base = os.path.join(en_root, "usr/share/debian-reference")
    de_base = os.path.join(de_root, "usr/share/debian-reference")
    fp = file_pairs(
        "debian-reference/",
        os.path.join(en_base, "*.en.html"),
        lambda p: os.path.join(de_base, os.path.basename(p).replace(".en.html", ".de.html")),
    )
    return align_files(
        "debian-reference", fp, skip_classes={"navfooter", "navheader", "programlisting", "screen", "indexterm"}
    )


def read_gnome(root):
    base = os.path.join(root, "usr/share/help")
    fp = []
    for en_path in sorted(glob.glob(os.path.join(base, "C/*/*.page"))):
        rel = os.path.relpath(en_path, os.path.join(base, "C"))
        de_path = os.path.join(base, "de", rel)
        if os.path.exists(de_path):
            fp.append(("gnome-user-docs/" + rel[: -len(".page")], en_path, de_path))
    return align_files("gnome-user-docs", fp, skip_classes={"code"})


def read_devref(en_root, de_root):
    en_base = os.path.join(en_root, "usr/share/developers-reference")
    de_base = os.path.join(de_root, "usr/share/developers-reference/de")
    fp = file_pairs(
        "developers-reference/",
        os.path.join(en_base, "*.html"),
        lambda p: os.path.join(de_base, os.path.basename(p)),
        exclude=("developers-reference.html", "search.html", "genindex.html"),
    )
    return align_files(
        "developers-reference", fp, skip_classes={"highlight", "sphinxsidebar", "related", "footer", "headerlink"}
    )


def read_faq(en_root, de_root):
    en_base = os.path.join(en_root, "usr/share/doc/debian/FAQ")
    de_base = os.path.join(de_root, "usr/share/doc/debian/FAQ/de")
    fp = file_pairs(
        "debian-faq/",
        os.path.join(en_base, "*.en.html"),
        lambda p: os.path.join(de_base, os.path.basename(p).replace(".en.html", ".de.html")),
    )
    return align_files(
        "debian-faq", fp, skip_classes={"navfooter", "navheader", "programlisting", "screen", "indexterm"}
    )


# --------------------------------------------------------------------------
# split and write


def source_of(doc):
    return doc.split("/", 1)[0]


def split_of(doc):
    parts = doc.split("/")
    if parts[0] == "libreoffice":
        if parts[1] in TEST_MODULES:
            return "test"
        if parts[1] in DEV_MODULES:
            return "dev"
    return "train"


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Build the English->German parallel corpus data/mt-en-de from Debian "
        "documentation and dictionary packages (Ding trans-de-en, LibreOffice help, "
        "debian-handbook, gimp-help, debian-reference, gnome-user-docs, "
        "developers-reference, debian-faq). Downloads the .deb files with "
        "'apt-get download' unless they are already in the cache folder."
    )
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(HERE, ".cache"),
        help="folder for the downloaded .deb files and their extracted text (default: %(default)s)",
    )
    ap.add_argument("--out-dir", default=os.path.join(HERE, "mt-en-de"), help="output folder (default: %(default)s)")
    args = ap.parse_args(argv)

    roots = unpack_debs(args.cache_dir, PACKAGES, EXPECTED_VERSIONS, "mt-en-de-extracted")

    readers = [
        ("ding", lambda: (read_ding(roots["trans-de-en"]), "")),
        ("libreoffice", lambda: read_libreoffice(roots["libreoffice-help-en-us"], roots["libreoffice-help-de"])),
        ("debian-handbook", lambda: read_handbook(roots["debian-handbook"])),
        ("gimp-help", lambda: read_gimp(roots["gimp-help-en"], roots["gimp-help-de"])),
        ("debian-reference", lambda: read_debref(roots["debian-reference-en"], roots["debian-reference-de"])),
        ("gnome-user-docs", lambda: read_gnome(roots["gnome-user-docs"])),
        ("developers-reference", lambda: read_devref(roots["developers-reference"], roots["developers-reference-de"])),
        ("debian-faq", lambda: read_faq(roots["debian-faq"], roots["debian-faq-de"])),
    ]

    all_pairs = collect_pairs(readers)
    splits = split_pairs(all_pairs, ding_heldout(all_pairs))
    os.makedirs(args.out_dir, exist_ok=True)
    write_splits(splits, [name for name, _ in readers], args.out_dir)


def collect_pairs(readers):
    """Every source's pairs, cleaned and filtered: (doc, en, de), deduplicated within each source and
    (LibreOffice) module split, so that a pair shared by a held-out module and a training module
    stays in the held-out split."""
    all_pairs = []  # (doc, en, de)
    log("clean pairs per source (raw aligned -> kept unique):")
    for name, fn in readers:
        raw, info = fn()
        seen = set()
        for doc, en, de in raw:
            en, de = norm(en), norm(de)
            key = (split_of(doc), en, de)
            if not keep_pair(en, de) or key in seen:
                continue
            seen.add(key)
            all_pairs.append((doc, en, de))
        log(f"  {name:22s} {len(raw):8d} -> {len(seen):7d}  {info}")
    log(f"  {'total':22s} {'':8s}    {len({(en, de) for _, en, de in all_pairs}):7d}")
    return all_pairs


def ding_heldout(all_pairs):
    """The Ding held-out sample: whole dictionary entries, fixed seed; doc -> "test" or "dev"."""
    ding_docs = OrderedDict()
    for i, (doc, _en, _de) in enumerate(all_pairs):
        if doc.startswith("ding/"):
            ding_docs.setdefault(doc, []).append(i)
    order = sorted(ding_docs, key=lambda d: int(d.split("/")[1]))
    random.Random(SEED).shuffle(order)
    ding_split = {}
    counts = {"test": 0, "dev": 0}
    for doc in order:
        n = len(ding_docs[doc])
        for split, target in (("test", N_DING_TEST), ("dev", N_DING_DEV)):
            if counts[split] + n <= target:
                ding_split[doc] = split
                counts[split] += n
                break
        if counts["test"] >= N_DING_TEST and counts["dev"] >= N_DING_DEV:
            break
    return ding_split


def split_pairs(all_pairs, ding_split):
    """Pairs per split, unique within each; dev pairs whose English is in test, and train pairs whose
    English is in dev or test, removed."""
    splits = {"train": [], "dev": [], "test": []}
    seen = {s: set() for s in splits}
    for doc, en, de in all_pairs:
        s = ding_split.get(doc, "train") if doc.startswith("ding/") else split_of(doc)
        if (en, de) not in seen[s]:
            seen[s].add((en, de))
            splits[s].append((doc, en, de))

    test_en = {en.lower() for _, en, _ in splits["test"]}
    n_dev = len(splits["dev"])
    splits["dev"] = [p for p in splits["dev"] if p[1].lower() not in test_en]
    held_en = test_en | {en.lower() for _, en, _ in splits["dev"]}
    n_train = len(splits["train"])
    splits["train"] = [p for p in splits["train"] if p[1].lower() not in held_en]
    log(
        f"removed {n_dev - len(splits['dev'])} dev pairs whose English is in test, "
        f"{n_train - len(splits['train'])} train pairs whose English is in dev/test"
    )
    return splits


def write_splits(splits, sources, out_dir):
    """Write {train,dev,test}.{src,tgt,doc}.gz and log the pairs per split and source."""
    log("pairs per split and source:")
    log("  " + f"{'source':22s}" + "".join(f"{s:>8s}" for s in ("train", "dev", "test")))
    for src in sources + ["total"]:
        row = []
        for s in ("train", "dev", "test"):
            row.append(sum(1 for p in splits[s] if src == "total" or source_of(p[0]) == src))
        log("  " + f"{src:22s}" + "".join(f"{n:8d}" for n in row))
    for s, pairs in splits.items():
        write_gz(os.path.join(out_dir, f"{s}.src.gz"), [p[1] for p in pairs])
        write_gz(os.path.join(out_dir, f"{s}.tgt.gz"), [p[2] for p in pairs])
        write_gz(os.path.join(out_dir, f"{s}.doc.gz"), [p[0] for p in pairs])
        n_docs = len({p[0] for p in pairs})
        n_words = sum(len(p[1].split()) for p in pairs)
        log(f"{s}: {len(pairs)} pairs, {n_docs} documents, mean {n_words / max(1, len(pairs)):.1f} English words")
    log(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
