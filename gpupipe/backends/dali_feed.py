"""DALI's feed on shards and object storage: :class:`Request`\\ s in the order of a plan that runs across epochs
(:mod:`.dali_stream`), each made into its :class:`~.gpu_feed.Work` in a DataLoader worker by the feed every batched GPU
decoder shares (:class:`~.gpu_feed.Feed`), behind a :class:`Gate` that holds a later epoch's batches until its pass
begins."""

from __future__ import annotations

import multiprocessing
import time
from typing import NamedTuple

import torch

from .._files import file_stamp
from .gpu_feed import Feed, Work


class Request(NamedTuple):
    epoch: int
    indices: list[int]
    number: int = 0  # which batch of its epoch
    ahead: bool = False  # one of an epoch's first batches, read before its pass begins: its files are stamped
    wait: bool = False  # read only once the loader delivers ``epoch`` (see :class:`Gate`)


class Gate:
    """The epoch the loader delivers, in shared memory, read by the feed's workers: a batch of a later epoch (past
    its first ones) is read only once its pass has begun, so a file the user changes between two passes is read as
    it is then, as by every other backend. Only an epoch's first batches are read before (DALI decodes them while
    the last pass ends); their files are stamped and checked when the pass begins. :meth:`open` lets every wait
    through (the feed is stopping)."""

    OPEN = 1 << 62

    def __init__(self) -> None:
        self._value = multiprocessing.Value("q", 0, lock=False)

    def set(self, epoch: int) -> None:
        self._value.value = epoch

    def open(self) -> None:
        self._value.value = self.OPEN

    @property
    def epoch(self) -> int:
        """The epoch the loader delivers."""
        return self._value.value

    def wait(self, epoch: int) -> None:
        pause = 0.0005
        while self._value.value < epoch:  # a poll that backs off to 10 ms: a worker left waiting costs no CPU
            time.sleep(pause)
            pause = min(2 * pause, 0.01)


class DaliFeed(Feed, torch.utils.data.Dataset):
    """One :class:`Request` -> its :class:`~.gpu_feed.Work`, in a DataLoader worker (or in the caller with no
    workers): once the gate lets it, its files stamped first when it is read ahead of its pass."""

    decoder = "dali"

    def __init__(self, dataset, recipe, train: bool, seed: int, max_pixels: int, pixels: bool = False):
        super().__init__(dataset, recipe, train, seed, max_pixels, pixels)
        self.gate = Gate()

    def __getitem__(self, request: Request) -> Work:
        if request.wait:
            self.gate.wait(request.epoch)
        stamps = None
        if request.ahead and self.dataset.reads_files:  # shards are not rewritten under a running loader
            stamps = [file_stamp(self.dataset.samples[i][0]) for i in request.indices]  # before the read
        work = self.work(request.epoch, request.indices, request.number)
        work.stamps = stamps
        return work
