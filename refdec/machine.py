"""What this machine gives a run: cores, free memory, how busy other processes keep it, and which CPU it is.

A timing taken while other processes hold the cores a run's threads need is not a measurement of the
algorithm: a thread that waits for a busy core can make decoding many times slower. BusyCores measures
the other processes' share from /proc/stat over a window long enough to see it, so that decode.py can
say so before decoding and again in its table, and so that a run given no thread count uses only the
cores the others leave idle. Every timing report records the CPU (`environment`), and a run on the int8
route is warned where the CPU has no fast int8 products (`warn_if_int8_slow`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import UsageError

# A sample: (monotonic seconds, seconds of CPU time every process used, seconds of CPU time this process used).
Sample = tuple[float, float, float]

MIN_WINDOW = 0.5  # seconds a measurement of other processes' CPU use spans at least (a tick is 10 ms)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable on Linux), or None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def decode_bytes(cfg, rows: int, src_len: int, out_len: int, itemsize: int) -> int:
    """A rough peak of the memory decoding `rows` rows at once takes (beams count as rows): per row,
    every decoder layer's self-attention keys and values over the output and cross-attention ones
    over the source, the encoder's activations, and a few vocabulary-wide score rows."""
    per_row = (
        cfg.dec_layers * 2 * (out_len + src_len) * cfg.d_model
        + 2 * src_len * max(cfg.d_ff, 4 * cfg.d_model)
        + 4 * cfg.vocab_size
    )
    return rows * per_row * itemsize


def proc_stat_sample() -> Sample | None:
    """Now, the machine's busy CPU seconds (/proc/stat's first line, idle and iowait left out) and this
    process's own; None where /proc/stat cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    times = os.times()
    return time.monotonic(), (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), times.user + times.system


class BusyCores:
    """How many cores other processes kept busy since this object was made (the machine's busy CPU
    time less this process's own, over the wall time between two samples). `sample` and `sleep` are
    the clock and /proc/stat reader (replaceable, so that a test can drive a busy machine)."""

    def __init__(
        self, sample: Callable[[], Sample | None] = proc_stat_sample, sleep: Callable[[float], None] = time.sleep
    ):
        self.sample, self.sleep = sample, sleep
        self.start = sample()

    def others(self, min_window: float = MIN_WINDOW) -> float | None:
        """Cores other processes kept busy since the start, on average; if less than `min_window`
        seconds have passed, this waits for the rest first (so a check made right after the start still
        measures something). None where the machine does not say."""
        now = self.sample()
        if self.start is None or now is None:
            return None
        if now[0] - self.start[0] < min_window:
            self.sleep(min_window - (now[0] - self.start[0]))
            now = self.sample()
        wall = now[0] - self.start[0]
        if wall <= 0:
            return None
        return max(0.0, ((now[1] - self.start[1]) - (now[2] - self.start[2])) / wall)


def threads_fit(others: float, threads: int, cores: int) -> bool:
    """Whether `threads` threads fit beside other processes that keep `others` of `cores` cores busy:
    less than half a core in all is noise, and a quarter of a core beyond the idle ones is tolerated
    (a sampled share of a core is not exact)."""
    return others < 0.5 or others + threads <= cores + 0.25


def default_threads(others: float, cores: int) -> int:
    """The most threads that fit beside other processes keeping `others` of `cores` cores busy, and at
    least one: other processes' 0.3 of a core costs no thread, 0.8 costs one, 1.3 two. The same rule as
    busy_warning's, so that a run given this count is not warned about before it starts (unless even
    one thread does not fit)."""
    return next((t for t in range(cores, 0, -1) if threads_fit(others, t, cores)), 1)


def fit_threads(others: float | None) -> str | None:
    """For a run given no thread count: torch's thread count cut to default_threads beside other
    processes keeping `others` cores busy (BusyCores.others; None where the machine does not say, and
    torch's count is kept). Returns a note saying why when it cut the count. A count set by
    OMP_NUM_THREADS is never raised."""
    threads = torch.get_num_threads()
    chosen = threads if others is None else min(threads, default_threads(others, usable_cores()))
    if chosen == threads:
        return None
    torch.set_num_threads(chosen)
    return (
        f"using {chosen} thread(s), not {threads}: other processes keep about {others:.1f} of this machine's "
        f"{usable_cores()} cores busy, and threads that wait for a busy core can make a run many times slower; "
        f"--threads N overrides"
    )


def busy_warning(others: float | None, threads: int, cores: int, when: str) -> str | None:
    """The warning for a run of `threads` threads while other processes keep `others` of `cores` cores
    busy (`when`: "keep" before the run, "kept" after it), or None when the run's threads fit."""
    if others is None or threads_fit(others, threads, cores):
        return None
    return (
        f"other processes {when} about {others:.1f} of this machine's {cores} cores busy and this run "
        f"uses {threads} thread(s): timings will not be reliable, and threads that wait for a busy core can "
        f"make decoding many times slower; run alone"
        + (f", or with --threads {default_threads(others, cores)}" if threads > 1 else "")
    )


def check_device(name: str) -> torch.device:
    """The device a command's --device names, or a one-line UsageError (exit 2): a name that is not
    cpu or cuda[:N], or cuda on a machine without a CUDA device (or without that many)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: refdec runs on cpu or cuda (cuda:N for one GPU of several)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def device_name(device: torch.device | str) -> str:
    """What a report says the device is: the GPU's name on CUDA, else the device type."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def environment(threads, device, dtype) -> dict:
    """What every timing report records of the machine it ran on: the CPU by name, the vector instructions
    torch's kernels use there (its CPU capability) and the CPU's flags that decide which kernels run,
    whether int8 products are fast on it, torch's version, the thread count (a list where a command
    times several), the device and dtype, the allocator, and what the routes' probes decided in this run
    (refdec.routes.probes.found: each int8 weight shape's plan with its timings, where the fast route's
    encoder may attend over sources of one length in one call, the machine report they were read from)."""
    from .routes import probes

    return {
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "cpu_flags": reported_flags(),
        "cpu_int8_products": "fast" if int8_products_fast() else "slow",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": threads,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "allocator": allocator(),
        "probes": probes.found(),
    }


def machine_line(threads) -> str:
    """The machine in one line, for a command's printed header: "AMD EPYC, torch 2.13.0+cpu, CPU capability
    AVX512 (avx512_vnni), 1 thread(s)"."""
    dot = ", ".join(f for f in reported_flags() or () if f in INT8_DOT_FLAGS)
    return (
        f"{cpu_model()}, torch {torch.__version__}, CPU capability {cpu_capability()}"
        + (f" ({dot})" if dot else "")
        + f", {threads} thread(s)"
    )


# -- the CPU, and where int8 products pay ----------------------------------------------------------------
# torch._int_mm on a CPU is oneDNN's gemm_s8s8s32. oneDNN runs it with its own int8 kernel straight away
# only where the CPU has AVX-512 (avx512f, avx512bw, avx512vl, avx512dq: oneDNN's "avx512_core", the set
# torch reports as the AVX512 capability); VNNI (one instruction per 4 products) and AMX make that kernel
# faster still; without AVX-512 the int8 product is many times slower than float32's (docs/int8.md, "Which
# CPUs it pays on", gives the commands and their figures). torch's capability alone is not enough where
# ATEN_CPU_CAPABILITY holds torch's own kernels below what the CPU has: oneDNN still uses AVX-512 then, so
# the CPU's flags decide.
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
REPORTED_FLAGS = ("avx2", "fma", *AVX512_CORE, *INT8_DOT_FLAGS, "avx512_bf16", "amx_bf16")


def cpu_capability() -> str:
    """The vector instructions torch's CPU kernels use here, as torch names them: "AVX2", "AVX512", "DEFAULT"
    (no AVX2, or not x86), "SVE256", ..."""
    return torch.backends.cpu.get_cpu_capability()


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n")[0]  # processors are separated by blank lines
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo's model name (a virtual machine may show less than the part's full name),
    else what the platform says, else the architecture."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (/proc/cpuinfo), or None where the system does not list them."""
    flags = cpuinfo().get("flags")
    return frozenset(flags.split()) if flags is not None else None


def reported_flags() -> list[str] | None:
    """Which of the flags that choose torch's and oneDNN's kernels (REPORTED_FLAGS) the CPU has; None where
    it does not say."""
    flags = cpu_flags()
    return None if flags is None else [f for f in REPORTED_FLAGS if f in flags]


def int8_products_fast() -> bool:
    """Whether torch._int_mm has its fast kernel on this CPU: torch reports AVX512, or the CPU's flags show
    AVX-512 where torch's own kernels are held below it."""
    flags = cpu_flags()
    return cpu_capability() == "AVX512" or (flags is not None and set(AVX512_CORE) <= flags)


def int8_warning(device, instead: str) -> str | None:
    """The warning for a run on the int8 route on `device` where int8 products are slow (a CPU without
    AVX-512), ending with `instead`, what to run instead; None on a GPU or where they are fast. It gives the
    slowdown measured here (refdec.routes.probes.int8_slowdown, once per process and thread count, or as a
    machine report records it), and says what the int8 route's outputs are checked against: its own
    greedy, whose outputs may differ from float32 greedy's."""
    from .routes import probes

    if torch.device(device).type != "cpu" or int8_products_fast():
        return None
    ratio, (m, k, n) = probes.int8_slowdown(), probes.SLOWDOWN_SHAPE
    product = f"one {m} x {k} by {k} x {n} product"
    measured = (
        f"int8 products measured {ratio:.1f}x slower than float32 here ({product}): the int8 route will be several "
        f"times slower than float32 here"
        if ratio >= 1  # else the flags and the timing disagree (a CPU held below what it has): both are said
        else f"yet int8 products measured {1 / ratio:.1f}x faster than float32 here ({product}), where CPUs "
        f"without AVX-512 have run the int8 route several times slower than float32: time it before relying on it"
    )
    return (
        f"torch's int8 products are slow on this CPU ({cpu_model()}, CPU capability {cpu_capability()}; their "
        f"fast kernel needs AVX-512): {measured} (docs/int8.md); a run on it equals int8 greedy (the int8 "
        f"route's own greedy), not float32 greedy; {instead}"
    )


def warn_if_int8_slow(device, instead: str) -> str | None:
    """Prints int8_warning on stderr where there is one (a command calls this once, where it chooses the
    int8 route), and returns it."""
    warning = int8_warning(device, instead)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return warning


# -- the C allocator's handling of freed memory ----------------------------------------------------------
# PyTorch's CPU tensors come from the C library's malloc. glibc's malloc serves a large request (from
# 128 KB, a threshold it raises as it sees larger blocks freed, up to 32 MB) with fresh pages from the
# system and hands them back on free, and gives back the free top of its heap past a trimming threshold:
# every buffer of a decoding call (a batch's logits, a verification call's attention, a KV cache the
# finished rows leave) is then faulted in, page by page, again at every call. `keep` sets the threshold
# to its largest value and stops the trimming, so freed memory stays in the heap for later buffers: the
# same values, fewer page faults (buffers over 32 MB are still mapped fresh). It pays most on the int8
# route, whose float64 cache and attention make the largest buffers (docs/int8.md, "The allocator", gives
# the runs that measure it). What the process keeps is at most its peak, which it had already reached.
ALLOCATORS = ("keep", "system")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
KEEP = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))
_allocator = "system"  # what this process's malloc does: "system" (the C library's defaults) or "keep"


def allocator_option(p, applies_to: str = "") -> None:
    """The --allocator flag of a command that times decoding (set by `set_allocator`)."""
    p.add_argument(
        "--allocator",
        default="keep",
        choices=ALLOCATORS,
        help="what the C allocator does with memory the run frees: keep = keep it for the next buffers "
        "(glibc; fewer page faults, the same values; docs/int8.md), system = the C library's "
        f"defaults (default keep){applies_to}",
    )


def allocator() -> str:
    """What this process's malloc does now: "keep" or "system"."""
    return _allocator


def set_allocator(mode: str) -> str:
    """`keep`: glibc's malloc keeps the memory a process frees for its next allocations (mallopt: the
    largest mmap threshold, no trimming); `system`: the C library's own behaviour, left as it is. For
    the whole process, from now on, and not undone by a later "system" (glibc's adaptive threshold
    cannot be restored). Returns what is in effect: "keep" needs glibc; elsewhere it is "system"."""
    global _allocator
    if mode not in ALLOCATORS:
        raise UsageError(f"unknown allocator {mode!r}; choose one of {', '.join(ALLOCATORS)}")
    if mode == "keep" and _allocator != "keep":
        mallopt = glibc_mallopt()
        if mallopt is not None and all(mallopt(param, value) == 1 for param, value in KEEP):
            _allocator = "keep"
    return _allocator


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None in a process whose C library is not glibc (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        return libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
