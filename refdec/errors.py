"""The errors refdec's commands report, and the one way every command reports them.

A user sees one line: `error: <what went wrong and what to do>`, exit status 2 for an error the user
can fix (a flag, a file, a checkpoint), 1 for anything else (with its type, since it is likely a bug),
130 for Ctrl-C (143 for a SIGTERM that refdec.interrupt turned into one). REFDEC_DEBUG=1 shows the
traceback instead. Every command's main() is run_command().
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from .interrupt import stopped_by


class UsageError(Exception):
    """Bad input or options: the command prints the message on one line and exits 2."""


class TrainingError(UsageError):
    """A run that cannot start or go on as asked: train.py prints the message on one line and exits 2."""


class CheckpointError(Exception):
    """A checkpoint that is missing, corrupt, or does not fit the task or tokenizer."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """An exception's message cut to its first line (and to `limit` characters), or its type's name."""
    text = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:limit] if limit else text


def run_command(
    body: Callable[[], int], *, known: tuple[type[BaseException], ...] = (), interrupted: str = "interrupted"
) -> int:
    """Run a command's body and turn what it raises into one line on stderr and an exit status.

    known: the error types (beside UsageError and CheckpointError) that the user can fix: printed as
    `error: message`, exit 2. Anything else prints its type too, exit 1. Ctrl-C prints `interrupted`,
    exit 130 (a held SIGTERM: 143); a closed stdout (`... | head`) ends quietly with 0."""
    try:
        return body()
    except KeyboardInterrupt:
        how, status = stopped_by()
        print(interrupted if status == 130 else f"{interrupted} ({how})", file=sys.stderr)
        return status
    except BrokenPipeError:  # the reader of our stdout left: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if os.environ.get("REFDEC_DEBUG"):
            raise
        if isinstance(e, (UsageError, CheckpointError, *known)):
            print(f"error: {first_line(e)}", file=sys.stderr)
            return 2
        print(f"error: {type(e).__name__}: {first_line(e)} (REFDEC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
