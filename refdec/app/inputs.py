"""What a run reads and where it writes, checked before any model loads: input files (UTF-8, gzip),
text piped to a run that does not read it, reference files, output paths (never a file the run reads,
nor one in the shipped checkpoints/ or data/: check_outputs, which every command calls),
the device and thread count; the source ids and output budget of each
line; and how a path is recorded in a report (as given, or relative to the repository).
"""

from __future__ import annotations

import os
import re
import select
import stat
import sys
from pathlib import Path

import torch

from .. import data as data_mod
from ..errors import UsageError
from ..machine import allocator_option, check_device, usable_cores
from ..repo import check_not_shipped, repo_file
from ..tokenizer import Tokenizer


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def check_no_piped_text(path: str | None) -> None:
    """Refuse text piped to a run without --input: it would decode the task's test set and leave the text
    unread without a word. Only text that is there counts: stdin must be a pipe or a file, readable now
    (select), and give a byte. A terminal, /dev/null, a closed stdin, and a pipe that is open but empty
    or not written yet (as CI runners and test harnesses leave it) go on."""
    if path:
        return
    try:
        if not (stat.S_ISFIFO(mode := os.fstat(0).st_mode) or stat.S_ISREG(mode)):
            return
        if not select.select([0], [], [], 0)[0] or not os.read(0, 1):
            return
    except (OSError, ValueError):
        return
    raise UsageError(
        "text was piped to stdin, but without --input the task's test set is decoded; give --input - to decode it"
    )


def check_writable(path: str | Path, flag: str) -> None:
    """Fail before any decoding if `path` cannot be written, so that finished work is never lost at the
    end: the folder must exist, the path must not be a folder, and opening it for appending must work
    (this creates no file that was not there)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path} cannot be written: {e.strerror}") from None
    if not existed:
        p.unlink()


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same path once resolved, or one file under two names."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_outputs(
    outputs: dict[str, str | Path | list | None],
    reads: dict[str, str | Path | None],
    *,
    folders_made: bool = False,
    opt_in: tuple[str, bool] | None = None,
) -> None:
    """Every path a command writes, checked before any work by every command alike: none may be a
    file the run reads, nor another output, nor lie in the shipped checkpoints/ or data/
    (refdec.repo.check_not_shipped; `opt_in`: the command's flag that allows it, and whether given),
    and each must be writable (unless `folders_made`: the command makes their folders).

    outputs: flag -> path (or a list of paths), None when not given. reads: what -> path of everything
    the run reads, defaults included (input_files, checkpoint_files); a folder there stands for every
    file in it."""
    written = [
        (flag, path)
        for flag, paths in outputs.items()
        for path in ([paths] if isinstance(paths, (str, Path)) else paths or [])
    ]
    for i, (flag, path) in enumerate(written):
        p = Path(path)
        for what, read in ((w, Path(r)) for w, r in reads.items() if r and str(r) != "-"):
            if same_file(p, read) or (read.is_dir() and p.exists() and p.resolve().is_relative_to(read.resolve())):
                raise UsageError(
                    f"{flag} {path} {'lies in' if read.is_dir() else 'is also'} {what}, which this "
                    f"run reads: it would be overwritten; give another path"
                )
        for other_flag, other in written[:i]:
            if same_file(p, Path(other)):
                raise UsageError(f"{flag} {path} is also the {other_flag} path: give each output its own")
    for flag, path in written:  # then where they go (a file the run reads, named above, is the worse mistake)
        check_not_shipped(flag, path, opt_in)
        if not folders_made:
            check_writable(path, flag)


def input_files(task: str | None, path: str | None, ref_paths: list[str] | None = None) -> dict[str, str | Path]:
    """What read_input reads, for check_outputs: --input and each --ref, else the task's data folder."""
    if path:
        return {"the input": path, **{f"the --ref file {r}": r for r in ref_paths or []}}
    folder = data_mod.DATA_DIR / task if task else None
    return {f"the data folder of --task {task} ({shown_path(folder)})": folder} if folder else {}


def checkpoint_files(what: str, path: str | Path | None) -> dict[str, str | Path]:
    """What loading a checkpoint reads, for check_outputs: a refdec checkpoint and the tokenizer.json
    beside it, or a transformers folder (every file in it)."""
    if path is None or str(path) == "early-exit":
        return {}
    p = Path(path)
    if p.is_dir():
        return {f"the folder {path} ({what})": p}
    return {what: p, f"the tokenizer beside {what}": p.parent / "tokenizer.json"}


def add_threads(p, *, default: int | str | None = None, several: bool = False, says: str = "") -> None:
    """The one --threads of every command: torch's intra-op threads, one count, or with `several` a
    comma-separated list of counts (a round of the measurement each); `says` what the default does.
    Checked by check_threads."""
    p.add_argument(
        "--threads",
        type=str if several else int,
        default=default,
        metavar="T,T" if several else "N",
        help=("thread counts, comma-separated" if several else "torch threads") + f" (default: {says or default})",
    )


def check_threads(value: int | str | None, several: bool = False, flag: str = "--threads") -> int | list[int] | None:
    """The one check of a thread count (add_threads): each a whole number between 1 and the cores this
    machine gives the run (more threads than cores only slows the work down). Returns the count, or with
    `several` the sorted counts; None stays None (the command's own default)."""
    if value is None:
        return None
    try:
        counts = sorted({int(v) for v in str(value).split(",")}) if several else [int(value)]
    except ValueError:
        raise UsageError(f"{flag} takes whole numbers separated by commas, not {value!r}") from None
    for n in counts:
        if not 1 <= n <= usable_cores():
            raise UsageError(
                f"{flag} {n}: must be between 1 and the {usable_cores()} cores this machine gives the run "
                "(more threads than cores only slows the work down)"
            )
    return counts if several else counts[0]


def add_device(p, *, default: str | None = "cpu", says: str = "") -> None:
    """The one --device of every command (cpu or cuda; checked by refdec.machine.check_device)."""
    p.add_argument("--device", default=default, help=f"cpu or cuda (default {default})" + (f"; {says}" if says else ""))


def add_machine_flags(g) -> None:
    """decode.py's --device, --dtype, --threads (checked and set by check_machine) and --allocator."""
    add_device(g)
    g.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype (default float32)")
    add_threads(
        g,
        says="torch's count, from OMP_NUM_THREADS or the cores, cut to the cores other processes leave idle while "
        "the models load, at least one; a note says so",
    )
    allocator_option(g)


def check_machine(device: str, threads: int | None) -> None:
    """The device and the thread count this machine has, checked before any model loads (the C allocator
    is the command's to set: refdec.machine.set_allocator)."""
    check_device(device)
    if (threads := check_threads(threads)) is not None:
        torch.set_num_threads(threads)


def read_input(
    task: str, path: str | None, ref_paths: list[str], limit: int | None, *, bad_lines: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """The input lines and their reference streams (the task's test set unless `path`). bad_lines:
    decode.py's --bad-lines, what bytes that are not valid UTF-8 do in the input and references
    (refdec.data.read_lines; None: refused, as every other command does)."""
    task_dir = data_mod.DATA_DIR / task
    if path:
        lines = data_mod.read_lines(path, bad_lines=bad_lines)
        refs = [data_mod.read_lines(r, bad_lines=bad_lines) for r in ref_paths]
        for ref, r in zip(ref_paths, refs):
            if len(r) != len(lines):
                raise UsageError(f"--ref {ref} has {len(r)} lines but the input has {len(lines)}")
    else:
        repo_file("data", task, "test.src.gz", flag="--input FILE")  # an installed copy without the repository
        if not (task_dir / "test.src.gz").exists():
            raise UsageError(f"{task_dir}/test.src.gz not found; rebuild it with python data/build.py")
        lines = data_mod.read_lines(task_dir / "test.src.gz", bad_lines=bad_lines)
        refs = [
            data_mod.read_lines(task_dir / name, bad_lines=bad_lines)
            for name in ("test.tgt.gz", "test.tgt2.gz")
            if (task_dir / name).exists()
        ]
    if limit is not None:
        lines, refs = lines[:limit], [r[:limit] for r in refs]
    return lines, refs


# Unicode's control characters (category Cc): C0 (tab among them), DEL and C1. Line ends never reach
# source_ids: read_lines splits on them.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def source_ids(tokenizer: Tokenizer, lines: list[str], max_positions: int) -> list[list[int] | None]:
    """Token ids per line; None for an empty line (its output is empty). Overlong lines are cut
    to what the model accepts, with a warning: the line still gets an output.

    Every tab and other control character (CONTROL) is a space before tokenising, with one note naming
    the lines: the shipped models' training text holds none, so a byte token the model never saw would
    otherwise change the output of the words around it ("This sentence\\thas" decodes as "This sentence
    has"). The rule lives here, not in read_input, because every command that decodes text turns it into
    ids here (decode.py, bench, ceiling, ctranslate2, hf audit), so all apply it alike, while the lines as
    read stay as the user gave them in the report and the HTML page."""
    out = []
    limit = max_positions - 1  # room for the eos that ends every source
    controlled = [i for i, line in enumerate(lines, 1) if CONTROL.search(line)]
    if controlled:
        print(
            f"note: {len(controlled)} input line(s) hold tabs or control characters, replaced by spaces before "
            f"tokenising (the shipped models were trained on text without them): {data_mod.which_lines(controlled)}",
            file=sys.stderr,
            flush=True,
        )
    for i, line in enumerate(lines, 1):
        line = CONTROL.sub(" ", line)
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
