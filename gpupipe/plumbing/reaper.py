"""Buffers a batch held (shared memory a worker mapped, pinned memory) dropped on a thread of their own, so that
unmapping them costs the thread that let them go nothing."""

from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Any


class Reaper:
    """Drops objects on a thread of its own: freeing a batch's shared-memory buffer costs the thread that frees it
    the unmapping (bench/README.md: figures behind the code), time the training thread need not spend.

    One thread per process, shared by every loader, and ended at interpreter exit (``atexit``: what is still queued
    is dropped, then the thread is joined). A daemon thread still running C++ code when the interpreter finalizes
    is ended by ``pthread_exit`` on its way back into Python, which aborts the process ("terminate called without
    an active exception") after a run that went well."""

    _lock = threading.Lock()
    _spent: queue.SimpleQueue[Any] | None = None
    _thread: threading.Thread | None = None

    def drop(self, obj: Any) -> None:
        cls = type(self)
        with cls._lock:
            if cls._thread is None or cls._spent is None:
                cls._spent = queue.SimpleQueue()
                cls._thread = threading.Thread(target=_reap, args=(cls._spent,), daemon=True, name="gpupipe-reaper")
                cls._thread.start()
            cls._spent.put(obj)

    @classmethod
    def stop(cls) -> None:
        """Drop what is queued and end the thread (at exit; a later :meth:`drop` starts a new one)."""
        with cls._lock:
            thread, spent, cls._thread, cls._spent = cls._thread, cls._spent, None, None
        if thread is not None and spent is not None:
            spent.put(_STOP)
            thread.join(timeout=10)

    @classmethod
    def _forget(cls) -> None:  # in a forked child: the parent's thread is not there
        cls._lock, cls._thread, cls._spent = threading.Lock(), None, None


_STOP = object()


def _reap(spent: queue.SimpleQueue[Any]) -> None:
    while spent.get() is not _STOP:  # each object is dropped here
        pass


atexit.register(Reaper.stop)
os.register_at_fork(after_in_child=Reaper._forget)
