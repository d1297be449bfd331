"""Ctrl-C that is never lost, and never breaks an import, while the scripts start.

Python turns SIGINT into KeyboardInterrupt wherever the interpreter happens to be. During start-up
that is usually inside `import torch`, and an exception raised half-way through importing a compiled
extension leaves it broken for the rest of the process: a later import of the same module fails
("cannot load module more than once per process") and the user sees a traceback, or the process
aborts. Some libraries also swallow the KeyboardInterrupt with a bare `except:` around an optional
import, and the script then runs on as if nothing was pressed.

So the scripts call `hold_sigint` first thing: a Ctrl-C is then only recorded. Once their imports
are done they call `release_sigint`, which raises the held KeyboardInterrupt if one came, and from
then on Ctrl-C raises at once as usual.

decode.py treats SIGTERM (what `kill`, `timeout` and batch schedulers send) as Ctrl-C: held the
same way, then a KeyboardInterrupt that keeps every finished line, and `stopped_by` tells the two
apart for the message and the exit status (130 for SIGINT, 143 for SIGTERM, as a shell reports them).
"""

from __future__ import annotations

import contextlib
import signal
import threading

_received: int | None = None  # the last SIGINT or SIGTERM the handler got
_holding = False


def _handler(signum, frame):
    global _received
    _received = signum
    if not _holding:
        raise KeyboardInterrupt


def hold_sigint(*, sigterm: bool = False) -> None:
    """Record Ctrl-C (and with `sigterm`, SIGTERM) without raising until `release_sigint` (even where
    SIGINT was inherited as ignored)."""
    global _holding, _received
    if threading.current_thread() is threading.main_thread():
        _holding, _received = True, None
        signal.signal(signal.SIGINT, _handler)
        if sigterm:
            signal.signal(signal.SIGTERM, _handler)


def stopped_by() -> tuple[str, int]:
    """What stopped the run, in words, and the exit status that says so: Ctrl-C 130, SIGTERM 143."""
    return ("stopped by SIGTERM", 128 + signal.SIGTERM) if _received == signal.SIGTERM else ("interrupted", 130)


def release_sigint(raise_held: bool = True) -> None:
    """Stop holding: raise the KeyboardInterrupt of a Ctrl-C pressed since `hold_sigint`, if any
    (unless `raise_held` is False: a script that ends before its imports were done); a later Ctrl-C
    raises where it lands."""
    global _holding
    _holding = False
    if _received and raise_held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_deferred():
    """Hold SIGINT and SIGTERM back for the duration (POSIX): they are delivered, as usual, right after.
    What must not be cut in half (an output line written and counted) runs inside."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
