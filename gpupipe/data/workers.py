"""Starting a DataLoader's worker processes safely."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch


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
