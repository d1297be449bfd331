"""decode.py's job on an --output file: refused when the file holds earlier work unless --resume continues it
or --overwrite replaces it, a record beside it of what was decoded (so that a resumed run is the same job),
and the lines already done, read back (refdec.app.resume: the output's whole lines and, under torchrun,
every process's partial file).

    out.txt             the outputs, one line per input line, in input order
    out.txt.job.json    the job: input, models, algorithm and every option that changes an output
    out.txt.partial.<rank>.jsonl   under torchrun, each process's finished lines until they are merged
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...checkpoint import file_sha256
from ...errors import UsageError
from ...interrupt import stopped_by
from ...machine import usable_cores
from ..inputs import shown_path, warn
from ..resume import keep_whole_lines, partial_files, read_partials, start_partial, whole_lines, write_atomically


def record_path(output: Path) -> Path:
    """The job record beside an output file."""
    return output.with_name(output.name + ".job.json")


def partial_stem(output: Path) -> str:
    """The stem of the partial files of the processes that decode into `output` under torchrun."""
    return output.name + ".partial"


def text_sha256(lines: list[str]) -> str:
    """A fingerprint of the input text as read (so that a piped input can be resumed too)."""
    return hashlib.sha256("\n".join(lines).encode("utf-8", errors="surrogateescape")).hexdigest()


def check_existing(output: Path, *, resume: bool, overwrite: bool) -> None:
    """Before any model loads: an output that holds earlier work is refused unless --resume continues it
    or --overwrite replaces it (an empty file is no work); --resume needs the job record beside it."""
    if resume and overwrite:
        raise UsageError("--resume continues the job in --output and --overwrite replaces it: give one of them")
    held = keep_lines(output) if output.exists() else 0
    partials = partial_files(output.parent, partial_stem(output))
    if resume:
        if not record_path(output).exists():
            raise UsageError(
                f"--resume: there is no job record {record_path(output).name} beside {output}, so nothing says what "
                "it holds; decode without --resume (with --overwrite to replace the file)"
            )
    elif (held or partials or record_path(output).exists()) and not overwrite:
        what = f"holds {held} line(s)" if held else "has the record of an unfinished job"
        raise UsageError(
            f"--output {output} already {what}: add --resume to continue that job, or --overwrite to replace it"
        )


def keep_lines(output: Path) -> int:
    """How many whole lines an existing output holds (its size > 0 counts as at least one)."""
    n = output.read_bytes().count(b"\n")
    return n or int(output.stat().st_size > 0)


@dataclass
class Job:
    """What an --output file holds of a job, and where this process writes: `start` whole lines of the
    output are done, `known` maps every later line some process already finished to its text."""

    output: Path
    record: dict
    start: int = 0
    known: dict[int, str] = field(default_factory=dict)
    rank: int = 0
    world: int = 1
    complete: bool = False  # every line was done before this run started

    @property
    def partial(self) -> Path:
        return self.output.with_name(f"{partial_stem(self.output)}.{self.rank}.jsonl")

    def done(self, n: int) -> set[int]:
        """The lines of an input of `n` lines that are done."""
        return set(range(self.start)) | {i for i in self.known if i < n}


def differences(stored: dict, record: dict) -> list[str]:
    """The keys whose values differ between two job records. A file is the same by its SHA-256 wherever it
    lies: the paths a record keeps (`path`) say where it was, and a resumed run may name it another way."""

    def comparable(value):
        if isinstance(value, dict):
            return {k: comparable(v) for k, v in value.items() if k != "path" or not value.get("sha256")}
        return value

    return sorted(k for k in stored.keys() | record.keys() if comparable(stored.get(k)) != comparable(record.get(k)))


def open_job(output: Path, record: dict, n: int, *, resume: bool, rank: int = 0, world: int = 1, barrier=None) -> Job:
    """Start or continue the job `record` on `output` (an input of `n` lines): a new job (rank 0 under
    torchrun) empties the output, removes any partial files and writes the record; a resumed one is refused
    in one line when the record beside the output differs, keeps the output's whole lines and reads every
    partial file of the job. Under torchrun each process then has its partial file (refdec.app.resume)."""
    barrier = barrier or (lambda: None)
    rec = record_path(output)
    if resume:
        stored = json.loads(rec.read_text(encoding="utf-8"))
        if diff := differences(stored, record):
            raise UsageError(
                f"--resume: {output} holds another job's output ({rec.name} differs in {', '.join(diff)}); "
                "give the options it records, or --overwrite to replace it"
            )
    elif rank == 0:
        output.write_bytes(b"")
        for path in partial_files(output.parent, partial_stem(output)):
            path.unlink()
        write_atomically(rec, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    barrier()  # rank 0 has set the files up before any process reads them
    start = len(whole_lines(output))
    if start > n:
        raise UsageError(f"--resume: {output} holds {start} lines but the input has {n}: it is not this job's output")
    job = Job(output, record, start, rank=rank, world=world)
    if world > 1:
        job.known = start_partial(job.partial, record, barrier)
    else:
        if rank == 0:
            keep_whole_lines(output)  # a line a kill cut off is decoded again
        job.known = read_partials(output.parent, partial_stem(output), record)
    return job


def finish(job: Job, n: int) -> None:
    """Once every process has done its lines (rank 0 alone calls this): under torchrun the output merged
    from every partial file; in one process, the output holds every line already, and partial files that an
    earlier run under torchrun left (read when this run started) are removed."""
    if job.world > 1:
        merge(job, n)
    else:
        for path in partial_files(job.output.parent, partial_stem(job.output)):
            path.unlink()


def merge(job: Job, n: int) -> None:
    """The output written whole from its lines and every partial file, the partial files removed. A line no
    file holds is an error that says to run the command again."""
    lines = whole_lines(job.output)[: job.start]
    known = read_partials(job.output.parent, partial_stem(job.output), job.record)
    missing = [i + 1 for i in range(len(lines), n) if i not in known]
    if missing:
        raise UsageError(
            f"{len(missing)} of {n} lines are in no partial file beside {job.output} (line {missing[0]} the first): "
            "run the same command with --resume"
        )
    text = "".join(line + "\n" for line in lines + [known[i] for i in range(len(lines), n)])
    write_atomically(job.output, text)
    for path in partial_files(job.output.parent, partial_stem(job.output)):
        path.unlink()


def check_job_flags(args) -> tuple[int, int]:
    """--resume and --overwrite act on an --output file ('-': standard output, as --input - reads standard
    input); under torchrun every process writes its part of one --output file and nothing else (one table,
    report or page per process would each cover a part), and by default takes its share of the cores.
    Returns torchrun's (WORLD_SIZE, RANK), (1, 0) in one process."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.output == "-":
        args.output = None
    if world > 1 and args.threads is None:  # the machine's cores shared between its processes
        args.threads = max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if (args.resume or args.overwrite) and not args.output:
        raise UsageError(
            f"--{'resume' if args.resume else 'overwrite'} acts on an --output FILE, which this run has none of"
        )
    if args.resume and (args.compare or args.batch_sizes or args.html or args.trace):
        raise UsageError(
            "--resume continues one algorithm's --output: run --compare, --batch-sizes, --html and --trace without it"
        )
    if world > 1:
        if not args.output or args.input == "-":
            raise UsageError(
                "under torchrun give an --output FILE (on a folder every process reaches) and an --input FILE"
            )
        if args.compare or args.batch_sizes or args.html or args.trace or args.report:
            raise UsageError(
                "under torchrun every process decodes part of one --output file: run --compare, --batch-sizes, "
                "--report, --html and --trace in one process"
            )
    if args.window < 0:
        raise UsageError(f"--window {args.window}: must be at least 0 (0 sorts the whole input)")
    return world, rank


def start_processes(world: int):
    """Under torchrun (WORLD_SIZE > 1): the process group (gloo, only to wait for each other; no tensors are
    exchanged), and its barrier; in one process a barrier that returns at once."""
    if world == 1:
        return lambda: None
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.barrier


def job_record(args, spec, shared: dict, input_path: str, lines: list[str], loader) -> dict:
    """What the --output file holds the outputs of: the input, the models and every option that changes an
    output (refdec.app.runner.job). Read back by --resume, which refuses a record that differs."""

    def model(path) -> dict:
        p = Path(path)
        return {"path": shown_path(p), "sha256": file_sha256(p) if p.is_file() else None}

    companions = {r: v for r, v in {**shared, **spec.companions}.items() if r in spec.algo.companion_roles}
    record = {
        "input": {"path": input_path, "sha256": text_sha256(lines), "lines": len(lines)},
        "model": model(loader.main_path),
        **{role: (v if str(v) == "early-exit" else model(v)) for role, v in sorted(companions.items())},
        "algo": spec.algo.name,
        "options": spec.options,
        "max_len": args.max_len,
        "batch_size": args.batch_size,
        "batch_tokens": args.batch_tokens,
        "window": args.window,
        "route": {"fast": args.fast, "graphed": args.graphed, "int8": args.int8, "invariant": args.invariant},
        "device": str(args.device).split(":")[0],
        "dtype": args.dtype,
        "languages": [args.src_lang, args.tgt_lang],
        "bad_lines": args.bad_lines,
    }
    return json.loads(json.dumps(record))  # as it reads back from the file


def start_job(args, spec, shared: dict, input_path: str, lines: list[str], loader, world: int, rank: int, barrier):
    """decode.py's job on its --output file (None without one): started, or continued with --resume (a note
    says how much is done); `Job.complete` when nothing is left to decode (the partial files merged)."""
    if not args.output:
        return None
    record = job_record(args, spec, shared, input_path, lines, loader)
    job = open_job(Path(args.output), record, len(lines), resume=args.resume, rank=rank, world=world, barrier=barrier)
    done = len(job.done(len(lines)))
    if done == len(lines):
        job.complete = True
        barrier()
        if rank == 0:
            finish(job, len(lines))
            print(f"{args.output} is complete: all {len(lines)} lines are done", file=sys.stderr, flush=True)
    elif done and not args.quiet:
        print(f"continuing {args.output}: {done} of {len(lines)} lines already done", file=sys.stderr, flush=True)
    return job


def end_job(job: Job | None, handed: list[int], finished: bool, n: int, runs: list, barrier) -> None:
    """After decoding: every process done, the output finished by rank 0 (finish); stopped, a warning of
    how many lines are written and that --resume continues them."""
    if finished and job is not None:
        barrier()  # every process has its lines in its partial file
        if job.rank == 0:
            finish(job, n)
    if not finished:
        output = str(job.partial if job.world > 1 else job.output) if job else None
        warn(stopped_note(len(handed), n, output, runs, resumable=job is not None))


def stopped_note(n: int, total: int, output: str | None, runs: list, resumable: bool = False) -> str:
    """The warning after an interruption that left `n` of `total` lines written."""
    return (
        f"{stopped_by()[0]} after {n} of {total} input lines: those lines are written"
        + (f" to {output}" if output else "")
        + ("; the same command with --resume continues from there" if resumable else "")
        + (
            "; the scores below cover them alone, the times and counts every batch finished (batches are "
            "formed by length, so some of those lines come later in the input)"
            if any(r.batch_size != 1 for r in runs)
            else "; the figures below cover them alone"
        )
    )
