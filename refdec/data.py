"""The shipped tasks, a corpus of one's own, and how text becomes batches.

Each task lives in <data folder>/<task>/ (the shipped ones in data/<task>/), one sentence per line,
aligned across files, each file gzip (name.gz, as shipped) or plain text (name):
    {train,dev,test}.src      source sentences
    {train,dev,test}.tgt      target sentences (first reference)
    {dev,test}.tgt2           a second reference where the corpus has one (gec-uk)
    {train,dev,test}.doc      the document each line comes from (splits never share a document)
train.src and train.tgt are what training needs; a folder without a dev split has one held out from
its training pairs (training_splits, carve_dev), and test is read only by decoding and distillation.
data/build_*.py rebuild the shipped tasks from the original packages; data/README.md lists sources
and licences.

Token layout used everywhere: the source is `ids + [eos]`; the decoder input is `[bos] + ids` and
its training target is `ids + [eos]`.
"""

from __future__ import annotations

import codecs
import gzip
import heapq
import random
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import BOS_ID, EOS_ID, PAD_ID
from .errors import UsageError
from .repo import REPO, shown

DATA_DIR = REPO / "data"
TASKS = {"mt-en-de": "mt", "gec-uk": "gec", "gec-en": "gec"}


def read_lines(path: str | Path, *, bad_lines: str | None = None) -> list[str]:
    """The lines of a UTF-8 text file (gzip if its name ends in .gz; '-' reads stdin), without their
    line endings (LF or CRLF), as every command reads text. A leading byte-order mark, which some
    editors save, is dropped (a note says so): it is no part of the first line. A file that cannot be
    read, is not gzip though named .gz, or is not UTF-8 is a UsageError naming it.

    bad_lines: what bytes that are not valid UTF-8 do. None (every command without decode's --bad-lines):
    the UsageError names the first such line. "fail": the same, and it names `--bad-lines replace`.
    "replace": each invalid sequence becomes U+FFFD, Unicode's replacement character, and one warning
    names the lines that held one, so that every line still gives one output line (a line's bytes
    never hold a newline, so each line's characters are the same whichever way the file is decoded)."""
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
            raise UsageError(
                f"{name} is not a valid gzip file ({e}); "
                + (
                    f"restore the shipped file: git checkout -- {name}"
                    if shipped
                    else "give the plain text file instead"
                )
            ) from None
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
        print(f"note: {name} starts with a UTF-8 byte-order mark; it is dropped, not read as text", file=sys.stderr)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if bad_lines != "replace":
            line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
            raise UsageError(
                f"{name}: line {line} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start - start + 1})"
                + ("; `--bad-lines replace` decodes the rest with U+FFFD in its place" if bad_lines else "")
            ) from None
        bad = [i for i, line in enumerate(raw.split(b"\n"), 1) if not valid_utf8(line)]
        print(
            f"warning: {name}: {len(bad)} line(s) hold bytes that are not valid UTF-8, decoded with U+FFFD in "
            f"their place: {which_lines(bad)}",
            file=sys.stderr,
            flush=True,
        )
        text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def which_lines(numbers: list[int], shown: int = 20) -> str:
    """Line numbers as a warning names them: "line(s) 3, 17", the first `shown`, then "..."."""
    return "line(s) " + ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")


def valid_utf8(raw: bytes) -> bool:
    """Whether `raw` decodes as UTF-8 (read_lines names the lines that do not)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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

    def rows(self, idx: list[int]) -> Split:
        """The split's lines `idx`, in that order."""
        return Split([self.src[i] for i in idx], [[r[i] for i in idx] for r in self.refs], [self.docs[i] for i in idx])


# What a task's folder holds, for the errors that name a missing file of a task that is not shipped.
LAYOUT = (
    "a task's folder holds train.src and train.tgt (plain text, or gzipped as train.src.gz and "
    "train.tgt.gz), one sentence a line, aligned; dev.src and dev.tgt if you have a dev set"
)


def split_file(folder: Path, split: str, side: str) -> Path | None:
    """The file of one side of a split in a task's folder: `<split>.<side>.gz` or the plain
    `<split>.<side>`, whichever is there (None: neither). Both at once is a UsageError: which one a
    run read would be a guess."""
    gz, plain = folder / f"{split}.{side}.gz", folder / f"{split}.{side}"
    if gz.is_file() and plain.is_file():
        raise UsageError(f"{shown(folder)} holds both {plain.name} and {gz.name}: keep one of them")
    return gz if gz.is_file() else plain if plain.is_file() else None


def has_split(folder: Path, split: str) -> bool:
    """Whether a task's folder holds any file of `split` (its source or its target)."""
    return split_file(folder, split, "src") is not None or split_file(folder, split, "tgt") is not None


def is_repo_data(data_dir: str | Path) -> bool:
    return Path(data_dir).resolve() == Path(DATA_DIR).resolve()


def missing_hint(task: str, data_dir: str | Path) -> str:
    """What to do about a task's folder or file that is not there: rebuild a shipped task's data,
    distil a shipped task into another data folder, or (any other task) what the folder must hold;
    never a command of the repository's for a task it does not ship."""
    if task in TASKS and is_repo_data(data_dir):
        return f"rebuild with: python data/build.py {task}"
    if task in TASKS:
        return f"a distilled training folder is built by python -m refdec distill --task {task} --out {data_dir}"
    return LAYOUT


def task_folders(data_dir: str | Path) -> list[str]:
    """The task folders of a data folder: those holding training data."""
    root = Path(data_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and split_file(p, "train", "src") is not None)


def split_files(task: str, split: str, data_dir: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """The source and target files of a task's split (plain or gzip), or the error that names what is
    missing and what to do: a shipped task's command (data/build.py, distill), or for any other task
    what its folder must hold (LAYOUT)."""
    d = Path(data_dir) / task
    if not d.is_dir():
        others = [t for t in task_folders(data_dir) if t != task]
        if is_repo_data(data_dir) and task not in TASKS:
            raise ValueError(
                f"unknown task {task!r}: no folder {shown(d)} (shipped tasks: {', '.join(TASKS)}; a corpus of your "
                f"own: --data-dir DIR with DIR/{task}/, where {LAYOUT})"
            )
        raise FileNotFoundError(
            f"no folder {shown(d)}: the data folder {shown(Path(data_dir))} holds no task {task}"
            + (
                f"; it holds {', '.join(others)} (--task names the folder)"
                if others
                else f"; {missing_hint(task, data_dir)}"
            )
        )
    paths = split_file(d, split, "src"), split_file(d, split, "tgt")
    for side, path in zip(("src", "tgt"), paths):
        if path is None:
            raise FileNotFoundError(
                f"no {split}.{side} or {split}.{side}.gz in {shown(d)}: {missing_hint(task, data_dir)}"
            )
    return paths


def load_split(task: str, split: str, data_dir: str | Path = DATA_DIR) -> Split:
    d = Path(data_dir) / task
    src_path, tgt_path = split_files(task, split, data_dir)
    src = read_lines(src_path)
    refs = [read_lines(tgt_path)]
    tgt2_path = split_file(d, split, "tgt2")
    if tgt2_path is not None:
        refs.append(read_lines(tgt2_path))
    docs_path = split_file(d, split, "doc")
    docs = read_lines(docs_path) if docs_path is not None else [""] * len(src)
    for name, lines in [("tgt", refs[0]), ("doc", docs)] + [(f"tgt{i + 1}", r) for i, r in enumerate(refs[1:], 1)]:
        if len(lines) != len(src):
            raise ValueError(f"{shown(d)}/{split}: {len(src)} source lines but {len(lines)} {name} lines")
    return Split(src, refs, docs)


# A dev split held out from the training pairs when a task's folder has none: one pair in DEV_SHARE,
# at least 1 and at most DEV_MAX, drawn with the fixed DEV_SEED (not the run's --seed), so that every
# run on the same training files (a verifier, its drafter and heads, a distilled copy of the folder,
# whose training pairs keep their order) holds out the same pairs.
DEV_SHARE, DEV_MAX, DEV_SEED = 20, 1000, 0


def carve_dev(n: int) -> list[int]:
    """The rows, in order, of an n-pair training set held out as its dev split (DEV_SHARE, DEV_MAX,
    DEV_SEED): the rows whose random.Random(DEV_SEED).random() draws are the smallest (random()'s
    sequence for a seed is the one thing Python keeps the same across its versions)."""
    if n < 2:
        raise ValueError(f"{n} training pair(s): too few to hold out a dev split and train on the rest")
    draws = random.Random(DEV_SEED)
    keys = [draws.random() for _ in range(n)]
    return sorted(heapq.nsmallest(min(DEV_MAX, max(1, n // DEV_SHARE)), range(n), key=keys.__getitem__))


def training_splits(task: str, data_dir: str | Path = DATA_DIR) -> tuple[Split, Split, int]:
    """A task's training and dev splits, and how many training pairs were held out as the dev split:
    0 when the folder has dev files; without them, carve_dev's rows (the training split returned is
    the rest, which never includes them). The test split is never read."""
    train = load_split(task, "train", data_dir)
    if has_split(Path(data_dir) / task, "dev"):
        return train, load_split(task, "dev", data_dir), 0
    held = carve_dev(len(train))
    dev_rows = set(held)
    keep = [i for i in range(len(train)) if i not in dev_rows]
    return train.rows(keep), train.rows(held), len(held)


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


def training_tensors(
    src_ids: list[list[int]], tgt_ids: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encoder input (B, S), decoder input [bos]+y (B, T) and decoder target y+[eos] (B, T)."""
    return (
        source_tensor(src_ids),
        pad_batch([[BOS_ID] + t for t in tgt_ids]),
        pad_batch([t + [EOS_ID] for t in tgt_ids]),
    )


def cut_batches(
    order: list[int], lengths: Callable[[int], tuple[int, ...]], fits: Callable[[int, tuple[int, ...]], bool]
) -> list[list[int]]:
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
    batches = cut_batches(
        order,
        lambda i: (lengths[i][0] + 1, lengths[i][1] + 1),  # eos / bos
        lambda rows, longest: sum(longest) * rows <= batch_tokens,
    )
    if seed is not None:
        random.Random(seed).shuffle(batches)
    return batches
