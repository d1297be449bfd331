"""The shipped tasks and how text becomes batches.

Each task lives in data/<task>/ as gzip text, one sentence per line, aligned across files:
    {train,dev,test}.src.gz   source sentences
    {train,dev,test}.tgt.gz   target sentences (first reference)
    {dev,test}.tgt2.gz        a second reference where the corpus has one (gec-uk)
    {train,dev,test}.doc.gz   the document each line comes from (splits never share a document)
data/build_*.py rebuild them from the original packages; data/README.md lists sources and licences.

Token layout used everywhere: the source is `ids + [eos]`; the decoder input is `[bos] + ids` and
its training target is `ids + [eos]`.
"""

from __future__ import annotations

import codecs
import gzip
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .config import BOS_ID, EOS_ID, PAD_ID
from .errors import UsageError
from .repo import REPO, shown

DATA_DIR = REPO / "data"
TASKS = {"mt-en-de": "mt", "gec-uk": "gec", "gec-en": "gec"}


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (gzip if its name ends in .gz; '-' reads stdin), without their
    line endings (LF or CRLF), as every command reads text. A leading byte-order mark, which some
    editors save, is dropped (a note says so): it is no part of the first line. A file that cannot be
    read, is not gzip though named .gz, or is not UTF-8 is a UsageError naming it."""
    name = str(path) if str(path) == "-" else shown(Path(path))
    try:
        raw = sys.stdin.buffer.read() if name == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {name}: {e.strerror}") from None
    if name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            shipped = Path(path).resolve().is_relative_to(DATA_DIR)
            raise UsageError(f"{name} is not a valid gzip file ({e}); " + (f"restore the shipped file: git checkout -- "
                             f"{name}" if shipped else "give the plain text file instead")) from None
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
        print(f"note: {name} starts with a UTF-8 byte-order mark; it is dropped, not read as text", file=sys.stderr)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        raise UsageError(f"{name}: line {line} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                         f"{e.start - start + 1})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


@dataclass
class Split:
    src: list[str]
    refs: list[list[str]]  # reference streams, each aligned with src (refs[0] is the training target)
    docs: list[str]

    @property
    def tgt(self) -> list[str]:
        return self.refs[0]

    def __len__(self) -> int:
        return len(self.src)


def load_split(task: str, split: str, data_dir: str | Path = DATA_DIR) -> Split:
    d = Path(data_dir) / task
    if not d.is_dir() and task in TASKS and Path(data_dir).resolve() != Path(DATA_DIR).resolve():
        raise FileNotFoundError(f"no folder {d}: the data folder {data_dir} holds no {task} task; a distilled "
                                f"training folder is built by python -m refdec distill --task {task} --out {data_dir}")
    if not d.is_dir():
        raise ValueError(f"unknown task {task!r}: no folder {d} (shipped tasks: {', '.join(TASKS)})")
    if not (d / f"{split}.src.gz").exists():
        raise FileNotFoundError(f"{d}/{split}.src.gz not found; rebuild with: python data/build.py {task}")
    src = read_lines(d / f"{split}.src.gz")
    refs = [read_lines(d / f"{split}.tgt.gz")]
    if (d / f"{split}.tgt2.gz").exists():
        refs.append(read_lines(d / f"{split}.tgt2.gz"))
    docs_path = d / f"{split}.doc.gz"
    docs = read_lines(docs_path) if docs_path.exists() else [""] * len(src)
    for name, lines in [("tgt", refs[0]), ("doc", docs)] + [(f"tgt{i + 1}", r) for i, r in enumerate(refs[1:], 1)]:
        if len(lines) != len(src):
            raise ValueError(f"{d}/{split}: {len(src)} source lines but {len(lines)} {name} lines")
    return Split(src, refs, docs)


def pad_batch(seqs: list[list[int]], pad: int = PAD_ID) -> torch.Tensor:
    """Right-pad token lists into a (B, T) LongTensor."""
    T = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(T, 1)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def source_tensor(src_ids: list[list[int]], eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> torch.Tensor:
    """(B, S) encoder input: each source followed by eos, right-padded (an imported model's ids: its own)."""
    return pad_batch([s + [eos_id] for s in src_ids], pad_id)


def source_rows(src: torch.Tensor, eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> list[list[int]]:
    """source_tensor's inverse, for a decoder that takes token lists (another engine's): each row's
    source ids without its eos and right padding."""
    rows = []
    for row in src.tolist():
        while row and row[-1] == pad_id:
            row.pop()
        rows.append(row[:-1] if row and row[-1] == eos_id else row)
    return rows


def training_tensors(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encoder input (B, S), decoder input [bos]+y (B, T) and decoder target y+[eos] (B, T)."""
    return (source_tensor(src_ids), pad_batch([[BOS_ID] + t for t in tgt_ids]),
            pad_batch([t + [EOS_ID] for t in tgt_ids]))


def cut_batches(order: list[int], lengths: Callable[[int], tuple[int, ...]],
                fits: Callable[[int, tuple[int, ...]], bool]) -> list[list[int]]:
    """`order` (example indices) cut into consecutive batches, each as long as `fits(rows, longest)`
    allows, one example at least: `longest` holds the batch's largest of each entry of `lengths(i)`
    (source and target lengths in training, the source's in decoding). The one length bucketer of
    training (token_batches) and decoding (refdec.app.runner's chunks and batches): each sorts its order
    by length first."""
    out: list[list[int]] = []
    batch: list[int] = []
    longest: tuple[int, ...] = ()
    for i in order:
        size = lengths(i)
        wider = tuple(map(max, longest, size)) if batch else size
        if batch and not fits(len(batch) + 1, wider):
            out.append(batch)
            batch, wider = [], size
        batch.append(i)
        longest = wider
    return out + [batch] if batch else out


def token_batches(lengths: list[tuple[int, int]], batch_tokens: int, seed: int | None) -> list[list[int]]:
    """Group example indices into batches of at most `batch_tokens` padded source + target tokens.

    Examples are sorted by length so padding stays small; the batch order is shuffled with `seed`
    (None keeps length order, for evaluation).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i][1], lengths[i][0], i))
    batches = cut_batches(order, lambda i: (lengths[i][0] + 1, lengths[i][1] + 1),  # eos / bos
                          lambda rows, longest: sum(longest) * rows <= batch_tokens)
    if seed is not None:
        random.Random(seed).shuffle(batches)
    return batches
