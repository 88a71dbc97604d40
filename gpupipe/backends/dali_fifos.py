"""The paths a dali pipeline reads, watched for fifos while the loader waits on it. A file replaced by a fifo after its
check (one of the next epoch's first batches, scheduled before their pass checked them, or a file swapped in the
instant between a check and DALI's read) holds DALI's file reader in ``open`` until a writer comes: for ever. The
loader then waited for ever on the batch, or on the pipeline's shut-down (after another batch failed, at ``close()``,
when the loader was collected, at the process's exit).

So each pipeline's :class:`InFlight` keeps the path rows of its scheduled batches, and every wait on the pipeline (a
batch, or its shut-down: :class:`.dali_graph.Driver`) is told. While one lasts longer than :data:`AFTER`, one thread a
process opens for writing, and closes at once, every fifo among those paths, twice a second until the wait ends: a
reader waiting in ``open`` goes on and reads the end, DALI fails on the batch, and the loader's recovery reports the
file as Pillow does ("not a regular file: a fifo"). A fifo nobody reads is left as it is (``ENXIO``).

The same record holds, until a batch is fetched or its pipeline shut down, what must outlive DALI's reads of the
inputs it takes in place (``no_copy``): the work whose feed worker's buffer holds a batch's bytes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque

import numpy as np

from .._files import special_kind

AFTER = 1.0  # seconds a wait on DALI lasts before the paths in flight are looked at (a batch takes far less)
_EVERY = 0.5  # how often they are looked at then

_log = logging.getLogger(__name__)
_waiting: dict[int, InFlight] = {}  # the waits under way, by id of their InFlight
_watcher: list[threading.Thread] = []  # this process's watch thread, started with the first paths in flight
_starting = threading.RLock()


class InFlight:
    """A pipeline's scheduled batches, oldest first, each one's path rows (``None`` for a batch fed bytes or pixels)
    and what holds the inputs DALI reads in place (a work, whose feed worker's buffer goes back to the worker, to be
    written again, once the work is dropped), and the wait on the pipeline under way. Both are let go here, on the
    thread that fetches their batch, or once the pipeline is shut down: never while DALI may still read them (DALI
    itself copies the rows as they are fed: a Python object it held would be let go in its threads, where that takes
    the GIL)."""

    def __init__(self) -> None:
        self.batches: deque[tuple[np.ndarray | None, object]] = deque()
        self.since = 0.0  # when the wait under way began (0: none)
        self.files = False  # whether any batch was fed paths (only then is a wait watched)
        self.shut = False  # the pipeline was shut down

    def add(self, rows: np.ndarray | None, hold: object = None) -> None:
        self.batches.append((rows, hold))
        if rows is not None and not self.files:
            self.files = True
            _watching()  # now, not with a first wait: at exit no thread may start (Python 3.12)

    def wait(self) -> None:
        """A wait on the pipeline begins (its oldest batch, or its shut-down)."""
        if not self.files:
            return
        self.since = time.monotonic()
        _waiting[id(self)] = self
        if not _watcher:  # (not started with the first paths: no thread could start then)
            _watching()

    def done(self, batches: int = 1) -> None:
        """The wait has ended, and with it ``batches`` of the oldest (-1: all)."""
        self.since = 0.0
        _waiting.pop(id(self), None)
        if batches < 0:
            self.batches.clear()
        elif self.batches:
            self.batches.popleft()

    def look(self, now: float) -> None:
        since = self.since
        if since and now - since > AFTER:
            # (a tuple of a deque is made under the GIL: never a half-changed one)
            open_fifos(tuple(rows for rows, _ in tuple(self.batches)))


def _watching() -> None:
    """This process's watch thread, started unless it runs (a forked child starts its own)."""
    with _starting:
        if _watcher and _watcher[0].is_alive():
            return
        thread = threading.Thread(target=_watch, daemon=True, name="gpupipe-dali-fifo-watch")
        try:
            thread.start()
        except RuntimeError:  # the interpreter is exiting, or no thread can start: a later wait tries again
            return
        _watcher[:] = [thread]


def on_watch_thread() -> bool:
    """Whether the caller runs on this process's watch thread (where the collector may run a finalizer: one that waits
    on a pipeline must not wait there, the watch that ends such a wait waiting with it)."""
    return bool(_watcher) and threading.current_thread() is _watcher[0]


def _watch() -> None:
    """Twice a second, each wait under way looked at (nothing to do while there is none: a wait is an entry in a
    dict, no lock or event, so a finalizer may begin one on any thread)."""
    while True:
        time.sleep(_EVERY)
        now = time.monotonic()
        for flight in list(_waiting.values()):
            try:
                flight.look(now)
            except Exception:  # (never the end of the watch: the next look tries again)
                _log.debug("looking at the paths in flight failed", exc_info=True)


def _forked() -> None:
    """A forked child has none of its parent's threads, nor its waits: it starts its own watch when it needs one (with
    a new lock: the parent's may have been held at the fork)."""
    global _starting
    _watcher.clear()
    _waiting.clear()
    _starting = threading.RLock()


os.register_at_fork(after_in_child=_forked)


def open_fifos(batches: tuple[np.ndarray | None, ...]) -> None:
    """Each path of ``batches`` (path rows: a path's bytes, then NULs) that is now a fifo opened for writing and
    closed: a reader waiting in ``open`` for a writer goes on, and reads the end."""
    for rows in batches:
        for row in rows if rows is not None else ():
            path = row.tobytes().split(b"\0", 1)[0]
            if special_kind(path) == "a fifo":
                with contextlib.suppress(OSError):  # (no reader: ENXIO; gone since)
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
