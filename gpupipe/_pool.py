"""Work over a data set's samples in worker processes, results in order, surviving a worker that dies.

``multiprocessing.Pool`` replaces a killed worker but loses its task, so ``imap`` waits for ever; a
``ProcessPoolExecutor`` notices (``BrokenProcessPool``). Here a dead worker (killed, out of memory) costs a new pool
and the unfinished samples are done again; one that keeps dying on the same samples is one line naming them.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from ._names import escape
from .errors import GpupipeError
from .plumbing.workers import leave_with_parent

T = TypeVar("T")
RESTARTS = 3  # new pools after dead workers, per call, before giving up
CHUNK = 4  # samples per task: fewer round trips, and a short list to redo when a worker dies


def _run_range(fn: Callable[[int], Any], start: int, stop: int) -> list:
    return [fn(i) for i in range(start, stop)]


def begin_worker(initializer: Callable[..., None], *initargs: Any) -> None:
    """A worker's first step: it ends with its parent (a killed run leaves none behind) and ignores SIGINT (Ctrl-C
    reaches the whole process group, and the main process alone stops the work: its ``KeyboardInterrupt`` ends the
    pool, so a worker prints no traceback of its own), then the caller's own."""
    leave_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    initializer(*initargs)


def ordered_map(
    fn: Callable[[int], T],
    indices: range,
    workers: int,
    *,
    initializer: Callable[..., None],
    initargs: tuple = (),
    name: Callable[[int], str] | None = None,
    what: str = "a worker",
) -> Iterator[T]:
    """``fn(i)`` for each ``i`` of ``indices`` (a step-1 range), in order, computed by ``workers`` processes set up
    by ``initializer(*initargs)``. ``fn`` must be a module-level function. ``name(i)`` names sample ``i`` in the
    error raised when workers keep dying on it."""
    chunks = deque(range(indices.start, indices.stop, CHUNK))
    pending: deque[tuple[int, int, Future]] = deque()
    ctx = multiprocessing.get_context()
    start = (initializer, *initargs)
    pool = ProcessPoolExecutor(workers, ctx, initializer=begin_worker, initargs=start)
    restarts = 0
    try:
        while chunks or pending:
            try:
                while chunks and len(pending) < 4 * workers:  # a bounded window: memory stays flat on any data set
                    a = chunks[0]
                    b = min(a + CHUNK, indices.stop)
                    pending.append((a, b, pool.submit(_run_range, fn, a, b)))  # raises once a worker has died
                    chunks.popleft()
                results = pending[0][2].result()
            except BrokenProcessPool:
                restarts += 1
                if restarts > RESTARTS:
                    a = pending[0][0] if pending else chunks[0]
                    raise GpupipeError(_died(what, a, min(a + CHUNK, indices.stop), name, restarts - 1)) from None
                pool.shutdown(wait=True, cancel_futures=True)
                pool = ProcessPoolExecutor(workers, ctx, initializer=begin_worker, initargs=start)
                chunks.extendleft(reversed([p[0] for p in pending]))  # redo every unfinished chunk, in order
                pending.clear()
                continue
            pending.popleft()
            yield from results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _died(what: str, a: int, b: int, name: Callable[[int], str] | None, restarts: int) -> str:
    first = f" ({escape(name(a))}{' ...' if b - a > 1 else ''})" if name is not None else ""
    return (
        f"{what} died (killed, or out of memory) on samples {a}..{b - 1}{first}, again after {restarts} new "
        "worker pools; run with --workers 1 to find the file, or free memory"
    )
