"""How the ``gpupipe`` command's process ends: once its work is done and written, a Ctrl-C ends it at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_COMMAND = False  # this process runs the ``gpupipe`` command (:func:`as_command`), not a program that calls main()


def as_command() -> None:
    """This process is the ``gpupipe`` command's (``gpupipe.cli.command``)."""
    global _COMMAND
    _COMMAND = True


def ending() -> None:
    """The command's work is done and written: from here on its process only lets go of things (loaders' workers and
    threads, exit hooks), for seconds at most. A Ctrl-C now ends it at once, quietly, with 130: Python's own handler
    raised it inside a finalizer or an exit hook, which printed "Exception ignored in ... KeyboardInterrupt" and a
    traceback, or the command printed a second ending. In the ``gpupipe`` command's process only, not in a program
    that calls ``gpupipe.cli.main``."""
    if _COMMAND and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _end_now)


def _end_now(signum: int, frame: object) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a write under way on it: what it had is lost, nothing else)
            stream.flush()
    os._exit(130)
