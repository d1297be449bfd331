"""Helpers shared by the data build scripts (build_mt_en_de.py, build_gec_uk.py, build_gec_en.py).

The scripts are run as `python data/build_x.py`, which puts this folder first on sys.path, so
they import this module as plain `import buildlib`. Standard library only.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import sys
from typing import Iterable, Sequence

# Characters that str.splitlines() treats as line breaks, plus tab: a sentence containing one
# would break the one-sentence-per-line format or a tab-separated consumer.
BAD_CHARS = frozenset("\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def fits_one_line(s: str) -> bool:
    """True when a sentence can be stored on one line: non-empty, no tab / line-break char."""
    return bool(s.strip()) and not (set(s) & BAD_CHARS)


def sha256_of(path: str) -> str:
    """Hex SHA-256 digest of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str, expected: str) -> None:
    """Exit with an error message when the file at `path` does not have SHA-256 `expected`."""
    digest = sha256_of(path)
    if digest != expected:
        sys.exit(f"error: {path} has sha256 {digest}, expected {expected}; "
                 "delete it and run again")


def write_gz(path: str, lines: Iterable[str]) -> None:
    """Write `lines` as UTF-8, one per line, gzip level 9 with mtime 0 and no file name in the
    header, so that the same lines always give the same bytes."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(data)


def edit_stats(src: Sequence[str], tgt: Sequence[str], *,
               spacing_only_counts: bool = False) -> dict:
    """Unchanged rate, token similarity and edit counts over aligned source/target pairs.

    Tokens are whitespace-split words; edits are the non-equal difflib opcodes between the
    source and target tokens. A changed pair whose tokens are equal (it differs only in
    spacing) goes into the 1-edit bin of the histogram; it adds one edit to
    `edits_per_changed` when `spacing_only_counts` is true, none otherwise.

    Returns a dict with `pairs`, `unchanged` (fraction), `sim_mean` and `sim_median` (difflib
    ratio, 1.0 for unchanged pairs), `edits_per_changed` and `hist` ({1, 2, 3, "4+"} -> number
    of changed pairs). Rates are 0.0 when there are no pairs.
    """
    unchanged = 0
    ratios = []
    hist = {1: 0, 2: 0, 3: 0, "4+": 0}
    n_edits = 0
    for s, t in zip(src, tgt):
        if s == t:
            unchanged += 1
            ratios.append(1.0)
            continue
        sm = difflib.SequenceMatcher(None, s.split(), t.split(), autojunk=False)
        ratios.append(sm.ratio())
        k = sum(1 for op in sm.get_opcodes() if op[0] != "equal")
        if k == 0:  # differs only in spacing
            n_edits += int(spacing_only_counts)
            k = 1
        else:
            n_edits += k
        hist[k if k <= 3 else "4+"] += 1
    n = len(src)
    ratios.sort()
    changed = n - unchanged
    return {
        "pairs": n,
        "unchanged": unchanged / n if n else 0.0,
        "sim_mean": sum(ratios) / n if n else 0.0,
        "sim_median": ratios[n // 2] if n else 0.0,
        "edits_per_changed": n_edits / changed if changed else 0.0,
        "hist": hist,
    }
