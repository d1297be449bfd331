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
"""

from __future__ import annotations

import signal
import threading

_pressed = False
_holding = False


def _handler(signum, frame):
    global _pressed
    _pressed = True
    if not _holding:
        raise KeyboardInterrupt


def hold_sigint() -> None:
    """Record Ctrl-C without raising until `release_sigint` (even where SIGINT was inherited as ignored)."""
    global _holding, _pressed
    if threading.current_thread() is threading.main_thread():
        _holding, _pressed = True, False
        signal.signal(signal.SIGINT, _handler)


def release_sigint(raise_held: bool = True) -> None:
    """Stop holding: raise the KeyboardInterrupt of a Ctrl-C pressed since `hold_sigint`, if any
    (unless `raise_held` is False: a script that ends before its imports were done); a later Ctrl-C
    raises where it lands."""
    global _holding
    _holding = False
    if _pressed and raise_held:
        raise KeyboardInterrupt
