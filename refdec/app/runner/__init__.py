"""What decode.py does between reading its input and reporting: decode every line with every run, the
runs interleaved (`decode_lines`, the timing loop), and write the first run's outputs as they finish.

    record.py   Run, one algorithm's outputs and figures over the whole input; make_runs
    buckets.py  the lines in windows, chunks and batches of neighbours in length (refdec.data.cut_batches)
    memory.py   check_fits: what a run's models or this machine's memory cannot do, refused before decoding
    loop.py     decode_lines, the interleaved timing loop (decode.py's, the bench's, the transformers audit's
                and refdec.commands.ctranslate2's)
    output.py   the output lines, written in input order as they finish; decode_to_output, keep_lines_of
    job.py      an --output file's job: refused, resumed or replaced; its record; the processes' parts merged

Timing covers encoding and decoding of each batch (time.perf_counter around the decoder call, read
once the device has finished its work: refdec.timing.clock), after a warm-up on the first sentences
that is not counted. With several runs the runs alternate batch by batch, and which goes first
alternates too, so drift in machine speed hits all of them alike.
"""

from .buckets import batches, length_chunks
from .job import Job, check_existing, check_job_flags, end_job, finish, open_job, start_job, start_processes
from .loop import WARMUP_ROWS, decode_lines, run_batch
from .memory import check_fits
from .output import OutputLines, decode_to_output, keep_lines_of, text_line, texts
from .record import Run, make_runs

__all__ = [
    "batches",
    "length_chunks",
    "WARMUP_ROWS",
    "decode_lines",
    "run_batch",
    "check_fits",
    "Job",
    "check_existing",
    "open_job",
    "finish",
    "check_job_flags",
    "start_job",
    "end_job",
    "start_processes",
    "OutputLines",
    "decode_to_output",
    "keep_lines_of",
    "text_line",
    "texts",
    "Run",
    "make_runs",
]
