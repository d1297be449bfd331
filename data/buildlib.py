"""Helpers shared by the data build scripts (build_mt_en_de.py, build_gec_uk.py, build_gec_en.py,
build_mono_en.py).

The scripts are run as `python data/build_x.py`, which puts this folder first on sys.path, so
they import this module as plain `import buildlib`. Standard library only.
"""

from __future__ import annotations

import difflib
import glob
import gzip
import hashlib
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterable, Sequence

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
        sys.exit(f"error: {path} has sha256 {digest}, expected {expected}; delete it and run again")


def find_deb(cache: str, pkg: str) -> str | None:
    """Path of the newest cached `pkg_*.deb` in `cache`, or None."""
    hits = sorted(glob.glob(os.path.join(cache, glob.escape(pkg) + "_*.deb")))
    return hits[-1] if hits else None


def deb_version(path: str) -> str:
    """Package version from a .deb file name as apt-get download writes it (`pkg_1%3a2.0_all.deb`)."""
    name = os.path.basename(path)[: -len(".deb")]
    return urllib.parse.unquote(name.split("_")[1])


def ensure_debs(cache: str, packages: Iterable[str]) -> dict:
    """{package: path of its .deb in `cache`}, fetched with `apt-get download` when missing."""
    os.makedirs(cache, exist_ok=True)
    debs = {}
    for pkg in packages:
        deb = find_deb(cache, pkg)
        if deb is None:
            print(f"downloading {pkg} ...", flush=True)
            r = subprocess.run(["apt-get", "download", pkg], cwd=cache)
            deb = find_deb(cache, pkg)
            if r.returncode != 0 or deb is None:
                sys.exit(f"apt-get download {pkg} failed (run 'apt-get update' first?)")
        debs[pkg] = deb
    return debs


def extract(deb: str, dest_root: str, patterns: Sequence[str]) -> str:
    """Extract the members matching the tar wildcards `patterns` of `deb` into
    `dest_root/<deb name>/` (once: a `.extracted` marker is left) and return that folder."""
    dest = os.path.join(dest_root, os.path.basename(deb)[: -len(".deb")])
    marker = os.path.join(dest, ".extracted")
    if os.path.exists(marker):
        return dest
    os.makedirs(dest, exist_ok=True)
    deb_p = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", dest, "--wildcards", "--no-same-owner", *patterns], stdin=deb_p.stdout)
    deb_p.stdout.close()
    if deb_p.wait() != 0 or tar.returncode != 0:
        sys.exit(f"extracting {deb} failed")
    open(marker, "w").close()
    return dest


def unpack_debs(cache: str, packages: dict, expected: dict, folder: str) -> dict:
    """Fetch (ensure_debs) and extract (extract) the packages {name: tar wildcards} into
    `cache/folder/`, print each one's version, with a warning where it is not the `expected` one
    the data was built from, and return {name: extracted root}."""
    debs = ensure_debs(cache, packages)
    roots = {pkg: extract(deb, os.path.join(cache, folder), packages[pkg]) for pkg, deb in debs.items()}
    print("packages:", flush=True)
    for pkg, deb in debs.items():
        v = deb_version(deb)
        note = "" if v == expected[pkg] else f"  (WARNING: built from {expected[pkg]})"
        print(f"  {pkg} {v}{note}", flush=True)
    return roots


def write_gz(path: str, lines: Iterable[str]) -> None:
    """Write `lines` as UTF-8, one per line, gzip level 9 with mtime 0 and no file name in the
    header, so that the same lines always give the same bytes."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(data)


def edit_stats(src: Sequence[str], tgt: Sequence[str], *, spacing_only_counts: bool = False) -> dict:
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
