"""Work kept as it finishes and continued after a stop, whatever stopped it (Ctrl-C, SIGTERM, kill -9):
the one mechanism of `refdec decode --output` and `refdec distill`, in one process or many under torchrun.

Two kinds of file hold finished work:

- an output file written in input order, one whole line per input line, each flushed as it is done
  (decode in one process): its whole lines are the lines done; a last line cut off by a kill is not.
- a partial file per process (`<stem>.jsonl`, under torchrun `<stem>.<rank>.jsonl`): a first line that
  says what job it belongs to (a JSON object of every option that changes an output), then one JSON
  record `{"i": line, "out": text}` per finished line, in any order. A record cut off by a kill is
  ignored, and its line decoded again.

A rerun of the same job, with any number of processes, reads every partial file whose first line is
its own, and the output file's whole lines, and decodes only what none of them holds. Once every line is
done, one process writes the result and removes the partial files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def partial_name(stem: str, rank: int, world: int) -> str:
    """The partial file of process `rank` of `world`: `<stem>.jsonl` alone, `<stem>.<rank>.jsonl` under torchrun."""
    return f"{stem}.jsonl" if world == 1 else f"{stem}.{rank}.jsonl"


def partial_files(folder: Path, stem: str) -> list[Path]:
    """Every partial file of `stem` in `folder`, by any number of processes."""
    return sorted(p for p in folder.glob(f"{stem}*.jsonl") if stem_of(p) == stem)


def read_partial(path: Path, job: dict) -> dict[int, str] | None:
    """The records of a partial file whose first line is `job` ({line: text}), or None when there is no
    such file or it belongs to another job. A last record cut off by a kill is left out."""
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    try:
        if json.loads(lines[0]) != job:
            return None
    except json.JSONDecodeError:
        return None
    done = {}
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # the empty string after the last newline, or a record cut off mid-write
        done[rec["i"]] = rec["out"]
    return done


def read_partials(folder: Path, stem: str, job: dict) -> dict[int, str]:
    """The records of every partial file of `stem` in `folder` that belongs to `job`, by any process."""
    done = {}
    for path in partial_files(folder, stem):
        done.update(read_partial(path, job) or {})
    return done


def start_partial(path: Path, job: dict, barrier=lambda: None) -> dict[int, str]:
    """The records of this job saved so far by this process and any other (an earlier run's too); then
    this process's own partial file rewritten whole with its records, so that new records never follow
    a line cut off mid-write (after `barrier`: every process has read the files by then)."""
    mine = read_partial(path, job) or {}
    done = read_partials(path.parent, stem_of(path), job)
    barrier()
    path.write_text(json.dumps(job, ensure_ascii=False) + "\n", encoding="utf-8")
    Records(path).put_many(list(mine.items()))
    return done


def stem_of(path: Path) -> str:
    """The stem of a partial file's name (`x.partial.3.jsonl`, `x.partial.jsonl` -> `x.partial`)."""
    name = path.name.removesuffix(".jsonl")
    head, _, tail = name.rpartition(".")
    return head if tail.isdigit() else name


class Records:
    """A partial file's writer: each finished line's record appended and flushed at once, so that a
    kill loses at most the record being written (which a rerun decodes again)."""

    def __init__(self, path: Path):
        self.path = path

    def put(self, index: int, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"i": index, "out": text}, ensure_ascii=False) + "\n")

    def put_many(self, items: list[tuple[int, str]]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"i": i, "out": t}, ensure_ascii=False) + "\n" for i, t in items))


def whole_lines(path: Path) -> list[str]:
    """An output file's whole lines: those ended by a newline (a last line cut off by a kill is not one).
    Read as bytes and cut at the last newline, so that a cut-off multi-byte character is no error."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    return raw[: raw.rfind(b"\n") + 1].decode("utf-8", errors="replace").split("\n")[:-1]


def keep_whole_lines(path: Path) -> int:
    """Cut an output file after its last newline (dropping a line a kill cut off); returns its lines."""
    raw = path.read_bytes() if path.exists() else b""
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        with open(path, "r+b") as f:
            f.truncate(end)
    return raw.count(b"\n")


def write_atomically(path: Path, text: str) -> None:
    """`text` written to `path` through a temporary file beside it and a rename, so that the file is
    either the old one or the whole new one, whenever the process is stopped."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
