"""What a run reads and where it writes, checked before any model loads: input files (UTF-8, gzip),
reference files, output paths, the device and thread count; the source ids and output budget of each
line; and how a path is recorded in a report (as given, or relative to the repository).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import data as data_mod
from .errors import UsageError
from .machine import usable_cores
from .tokenizer import Tokenizer


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def read_text_lines(path: str) -> list[str]:
    """Lines of a UTF-8 file, or of stdin for '-'. Invalid UTF-8 is an error naming the line."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    if path.endswith(".gz"):
        import gzip
        import zlib
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UsageError(f"{path} is not a valid gzip file ({e}); give the plain text file instead") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(line.rstrip(b"\r").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: line {i} is not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None
    return out


def check_writable(path: str, what: str, *, not_paths: dict[str, str] | None = None) -> None:
    """Fail before any decoding if `path` cannot be written, so that finished work is never lost at the
    end: the folder must exist, the path must not be a folder (or one of `not_paths`, e.g. the input),
    and opening it for appending must work (this creates no file that was not there)."""
    p = Path(path)
    for other_what, other in (not_paths or {}).items():
        if other and other != "-" and Path(other).resolve() == p.resolve():
            raise UsageError(f"{what} {path} is also the {other_what}: it would be overwritten")
    if p.is_dir():
        raise UsageError(f"{what} {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"{what} {path}: the folder {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be written: {e.strerror}") from None
    if not existed:
        p.unlink()



def check_machine(device: str, threads: int | None, *, output: str | None, report: str | None, html: str | None,
                  reads: dict[str, str]) -> None:
    """Device and threads this machine has; output paths checked now, so that a run never decodes
    for an hour to fail on its output. `reads`: name -> path of every file the run reads. (Whether
    --html can draw its charts is refdec.htmlreport.check_available's to say.)"""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    if threads is not None:
        if not 1 <= threads <= usable_cores():
            raise UsageError(f"--threads must be between 1 and the {usable_cores()} cores this machine gives "
                             f"the run (more threads than cores only slows decoding down)")
        torch.set_num_threads(threads)
    if output:
        check_writable(output, "--output", not_paths=reads)
    if report:
        check_writable(report, "--report", not_paths={**reads, "--output": output})
    if html:
        check_writable(html, "--html", not_paths={**reads, "--output": output, "--report": report})


def read_input(task: str, path: str | None, ref_paths: list[str], limit: int | None) -> tuple[list[str], list[list[str]]]:
    """The input lines and their reference streams (the task's test set unless `path`)."""
    task_dir = data_mod.DATA_DIR / task
    if path:
        lines = read_text_lines(path)
        refs = [read_text_lines(r) for r in ref_paths]
        for ref, r in zip(ref_paths, refs):
            if len(r) != len(lines):
                raise UsageError(f"--ref {ref} has {len(r)} lines but the input has {len(lines)}")
    else:
        if not (task_dir / "test.src.gz").exists():
            raise UsageError(f"{task_dir}/test.src.gz not found; rebuild it with python data/build.py")
        lines = data_mod.read_lines(task_dir / "test.src.gz")
        refs = [data_mod.read_lines(task_dir / name) for name in ("test.tgt.gz", "test.tgt2.gz")
                if (task_dir / name).exists()]
    if limit is not None:
        lines, refs = lines[:limit], [r[:limit] for r in refs]
    return lines, refs


def source_ids(tokenizer: Tokenizer, lines: list[str], max_positions: int) -> list[list[int] | None]:
    """Token ids per line; None for an empty line (its output is empty). Overlong lines are cut
    to what the model accepts, with a warning: the line still gets an output."""
    out = []
    limit = max_positions - 1  # room for the eos that ends every source
    for i, line in enumerate(lines, 1):
        if not line.strip():
            out.append(None)
            continue
        ids = tokenizer.encode(line)
        if len(ids) > limit:
            warn(f"input line {i} has {len(ids)} tokens, more than the model's {limit}; decoding its first {limit}")
            ids = ids[:limit]
        out.append(ids)
    return out


def max_len_for(batch: list[list[int]], max_len: int | None, max_positions: int) -> int:
    """Output budget in tokens (eos included): --max-len if given, else 2 x source + 10, within the
    model's positions."""
    budget = max_len if max_len is not None else 2 * max(len(s) for s in batch) + 10
    return max(1, min(budget, max_positions - 1))


def shown_path(path: str | Path) -> str:
    """A path as a report records it: relative to the repository when it lies inside it (the default
    checkpoints and test sets), else as the user gave it; never this machine's absolute path to the
    repository, so that a report reads the same on every machine."""
    p = Path(path)
    if p.is_absolute():
        try:
            return p.resolve().relative_to(data_mod.REPO).as_posix()
        except ValueError:
            return str(path)
    return str(path)
