"""Ctrl-C that is never lost while the scripts start.

Python turns SIGINT into KeyboardInterrupt, but a library that catches every exception while it is
imported (a bare `except:` around an optional import) can swallow it, and the script then runs on as
if nothing was pressed. The scripts install `remember_sigint` first thing, so a Ctrl-C is also
recorded, and call `raise_if_interrupted` once their imports are done.
"""

from __future__ import annotations

import signal
import threading

_pressed = False


def _handler(signum, frame):
    global _pressed
    _pressed = True
    raise KeyboardInterrupt


def remember_sigint() -> None:
    """Make Ctrl-C raise KeyboardInterrupt (even where SIGINT was inherited as ignored) and record it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _handler)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that something swallowed since remember_sigint."""
    if _pressed:
        raise KeyboardInterrupt
