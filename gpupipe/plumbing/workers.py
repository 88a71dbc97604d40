"""A DataLoader's worker processes: how each begins, starting their iteration safely, and what a process forked from
their parent (``os.fork()``) leaves of them alone."""

from __future__ import annotations

import contextlib
import gc
import glob
import multiprocessing.process
import multiprocessing.util
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .._system import lower_priority


def worker_init(worker_id: int, nicer: bool = True) -> None:
    """Every decode worker's first step (a DataLoader ``worker_init_fn``; ``functools.partial(worker_init,
    nicer=False)`` for batches that stay on the CPU). With ``nicer``, it runs nicer than the training process
    (:func:`gpupipe._system.lower_priority`): where batches go to a GPU, the training thread only launches work and
    must never wait for a core. A CPU device's training thread computes the model on every core, beside the workers,
    as equals. And it sends its batches' shared memory by name ("file_system"), not as a file descriptor: receiving a
    descriptor costs the training thread a connection to the worker's resource sharer, with its authentication
    handshake, every batch (answered by a thread of the worker). The strategy is the sender's choice, so it is set here
    only; torch_shm_manager removes what a dead worker left. It ignores SIGINT, as :func:`gpupipe._pool.begin_worker`
    does: Ctrl-C reaches the whole process group, and the training process alone decides what it means (it may save
    and stop, ``gpupipe.train``; or ignore it, started with ``nohup``: a worker that died of it ended the feed)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nicer:
        lower_priority(worker_id)
    leave_with_parent()


def leave_with_parent(poll: float = 0.5) -> None:
    """In a worker process, as it begins: it ends within about ``poll`` seconds of its parent's death, wherever it
    waits (a DataLoader worker notices only between two batches, not while it waits on a gate for the next epoch; a
    process pool's worker waits on its queue for ever). A killed training process (SIGKILL, the out-of-memory killer)
    then leaves no worker behind, and torch_shm_manager, left without clients, ends too. A thread of the worker's own
    watches ``os.getppid()``: the parent it was forked from is gone once it changes. The worker's shared-memory files
    go with it: torch names each after the process that made it (``/dev/shm/torch_<pid>_...``), and one a dead parent
    held is counted as held for ever, so torch would never remove it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        for name in glob.glob(f"/dev/shm/torch_{os.getpid()}_*"):  # nothing here is wanted any more
            with contextlib.suppress(OSError):
                os.unlink(name)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="gpupipe-parent-watch").start()


def start_workers(dataloader: torch.utils.data.DataLoader) -> Iterator:
    """``iter(dataloader)`` with this process's objects hidden from the garbage collector of the workers it forks: a
    worker then never collects this process's garbage, such as an earlier loader's iterator left in a reference
    cycle by a caught exception (its ``__del__`` would stop the parent's workers from the child: "AssertionError: can
    only test a child process", printed as "Exception ignored"). Nothing changes for this process's collector."""
    if gc.get_freeze_count():  # the program freezes objects itself: its own set, not ours to unfreeze
        it = iter(dataloader)
    else:
        gc.freeze()
        try:
            it = iter(dataloader)
        finally:
            gc.unfreeze()
    _iterations.add(it)
    return it


def end_workers(dataloader: torch.utils.data.DataLoader, it: Iterator | None) -> None:
    """``it`` (:func:`start_workers`' iteration of ``dataloader``) ends, its workers stopped now: a failure's
    traceback holds an iteration until the garbage collector frees it, which closes its queues first (each worker then
    killed after 5 s, the shared memory of its batch buffers left in /dev/shm). A DataLoader with persistent workers
    lets go of it too, so that its next ``iter()`` starts new ones."""
    if it is None:
        return
    _iterations.discard(it)
    getattr(it, "_shutdown_workers", lambda: None)()  # private: DataLoader has no public way to stop its workers
    if getattr(dataloader, "_iterator", None) is it:
        dataloader._iterator = None


# the DataLoader iterations begun here (start_workers): in a process forked from this one, none is ended
_iterations: weakref.WeakSet[Iterator] = weakref.WeakSet()


def _leave_the_parents_workers() -> None:
    """In a child of ``os.fork()``: the parent's workers and queues are the parent's. Without this, the child's exit
    ended them: torch's teardown of each inherited DataLoader iteration (stop events, then SIGTERM to each worker),
    and multiprocessing's exit function, which terminates every child process it lists (the parent's, inherited) and
    runs the parent's finalizers (a queue's close waits on a lock its feeder thread held at the fork: the child hangs).
    A child started by multiprocessing does the same as it begins (``BaseProcess._bootstrap``); one made by
    ``os.fork()`` did not."""
    for it in list(_iterations):
        it._shutdown = True  # type: ignore[attr-defined]  # torch's teardown of it (its __del__) then does nothing
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]  # a new process has no children yet
    multiprocessing.util._finalizer_registry.clear()  # type: ignore[attr-defined]  # the parent's objects' finalizers
    multiprocessing.util._run_after_forkers()  # type: ignore[attr-defined]  # inherited queues and locks reset


os.register_at_fork(after_in_child=_leave_the_parents_workers)


def put_unless_stopped(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """A producer thread's put: ``item`` once ``out`` has room; False if told to ``stop`` first (the consumer gone)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
