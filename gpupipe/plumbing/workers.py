"""A DataLoader's worker processes: how each begins, and starting their iteration safely."""

from __future__ import annotations

import gc
import queue
import threading
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
    only; torch_shm_manager removes what a dead worker left."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    if nicer:
        lower_priority(worker_id)


def start_workers(dataloader: torch.utils.data.DataLoader) -> Iterator:
    """``iter(dataloader)`` with this process's objects hidden from the garbage collector of the workers it forks: a
    worker then never collects this process's garbage, such as an earlier loader's iterator left in a reference
    cycle by a caught exception (its ``__del__`` would stop the parent's workers from the child: "AssertionError: can
    only test a child process", printed as "Exception ignored"). Nothing changes for this process's collector."""
    if gc.get_freeze_count():  # the program freezes objects itself: its own set, not ours to unfreeze
        return iter(dataloader)
    gc.freeze()
    try:
        return iter(dataloader)
    finally:
        gc.unfreeze()


def put_unless_stopped(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """A producer thread's put: ``item`` once ``out`` has room; False if told to ``stop`` first (the consumer gone)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
