"""A DataLoader's worker processes: how each begins, and starting their iteration safely."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch

from .._system import lower_priority


def worker_init(worker_id: int) -> None:
    """Every decode worker's first step (a DataLoader ``worker_init_fn``): it runs nicer than the training process
    (:func:`gpupipe._system.lower_priority`), and sends its batches' shared memory by name ("file_system"), not as a
    file descriptor: receiving a descriptor costs the training thread a connection to the worker's resource sharer,
    with its authentication handshake, every batch (answered by a thread of a worker that now yields its core). The
    strategy is the sender's choice, so it is set here only; torch_shm_manager removes what a dead worker left."""
    torch.multiprocessing.set_sharing_strategy("file_system")
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
