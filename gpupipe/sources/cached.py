"""A data set's reads through the node's shard cache (:mod:`.cache`): whether a loader's order can use it
(:func:`plan`), the shards each process keeps pinned (:class:`CachedShards`), and the read ahead (:class:`ReadAhead`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from .cache import Pinned, ShardCache, Store, size_text


class Plan(NamedTuple):
    """How a loader reads through the cache: whether at all, how many shards a process keeps pinned, how many it
    reads ahead, and why not (a warning) when a shuffled epoch cannot use it."""

    cached: bool
    keep: int = 16
    ahead: int = 2
    why: str | None = None


def plan(sizes: Sequence[int], limit: int, shuffled: bool, window: int | None, local_ranks: int = 1) -> Plan:
    """A set that fits ``limit`` is cached whole; a ``shuffle_window`` of ``K`` shards needs its ``K`` largest
    shards to fit (refused otherwise, with the numbers), and is read ahead only when two groups per local rank fit
    (else the next group would evict the groups in use, fetched again: each is fetched when needed instead); a
    sequential pass needs two shards (the current and the next); a global shuffle of a set larger than the limit is
    read by range (each batch's samples), with a warning."""
    total, largest = sum(sizes), sorted(sizes, reverse=True)
    if total <= limit:
        return Plan(True, keep=16, ahead=window or 2)
    if window is not None:
        need = sum(largest[:window])
        if need > limit:
            raise ValueError(
                f"cache_limit={size_text(limit)} (--cache-limit) holds fewer than shuffle_window={window} "
                f"(--shuffle-window) shards (the largest {window} hold {size_text(need)}); allow at least "
                f"{size_text(2 * need)} (a group and the next, read ahead) or take a smaller shuffle_window"
            )
        return Plan(True, keep=2 * window, ahead=window if 2 * need * local_ranks <= limit else 0)
    if not shuffled:
        return Plan(sum(largest[:2]) <= limit, keep=2, ahead=2)
    fit = int(np.searchsorted(np.cumsum(largest), limit / 2, side="right"))
    return Plan(
        False,
        why=f"a global shuffle over {size_text(total)} of shards, more than cache_limit={size_text(limit)}, reads "
        f"about one range request per sample: use shuffle_window={max(fit, 1)} or less (a group and the next fit), "
        "or a larger cache_limit",
    )


class CachedShards:
    """A data set's shards through a :class:`ShardCache`. A process keeps pinned (and mapped) the shards of the batch
    it read last (:meth:`release`), at most ``keep`` shards, so the shards the epoch has left behind can be evicted."""

    def __init__(
        self, store: Store, cache: ShardCache, urls: Sequence[str], sizes: Sequence[int], etags: Sequence[str]
    ):
        self.store, self.cache, self.urls = store, cache, list(urls)
        self.sizes, self.etags = [int(s) for s in sizes], list(etags)
        self.keep = 8
        self._pinned: OrderedDict[int, Pinned] = OrderedDict()
        self._busy: dict[int, int] = {}  # shard -> reads under way (another thread's): never unpinned meanwhile
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self):  # a spawned worker pins its own
        return {**self.__dict__, "_pinned": OrderedDict(), "_busy": {}, "_lock": None, "_pid": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def read(self, s: int, start: int, size: int) -> bytes:
        pinned = self._pinned_shard(s)
        try:
            return pinned.read(start, size)
        finally:
            with self._lock:
                self._busy[s] -= 1

    @contextlib.contextmanager
    def using(self, s: int) -> Iterator[Pinned]:
        """Shard ``s`` pinned, and kept pinned while the caller reads it (as :meth:`read` does for a slice)."""
        pinned = self._pinned_shard(s)
        try:
            yield pinned
        finally:
            with self._lock:
                self._busy[s] -= 1

    def fetch(self, s: int) -> None:
        self.cache.ensure(self.store, self.urls[s], self.sizes[s], self.etags[s])

    def release(self, keep: set[int]) -> None:
        """Unpin every shard but those in ``keep`` (the batch just read) and those another thread is reading."""
        self._after_fork()
        with self._lock:
            for s in [s for s in self._pinned if s not in keep and not self._busy.get(s)]:
                self._pinned.pop(s).close()

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # a forked worker: the parent's pins are its parent's to release
            for p in self._pinned.values():
                p.close(unlock=False)
            self._pinned, self._busy, self._lock, self._pid = OrderedDict(), {}, threading.Lock(), os.getpid()

    def _pinned_shard(self, s: int) -> Pinned:
        self._after_fork()
        with self._lock:
            found = self._pinned.get(s)
            if found is not None:
                self._pinned.move_to_end(s)
                self._busy[s] = self._busy.get(s, 0) + 1
                return found
        pinned = self.cache.pin(self.store, self.urls[s], self.sizes[s], self.etags[s])
        with self._lock:
            if s in self._pinned:  # another thread pinned it meanwhile
                pinned.close()
                pinned = self._pinned[s]
            self._pinned[s] = pinned
            self._busy[s] = self._busy.get(s, 0) + 1
            for old in [k for k in self._pinned if not self._busy.get(k)][: max(0, len(self._pinned) - self.keep)]:
                self._pinned.pop(old).close()
        return pinned


class ReadAhead:
    """A thread of the process that iterates the loader (one per rank): it follows the loader's position and
    fetches, in the order the epoch first needs them, the next ``ahead`` shards past those the delivered batches
    have reached, so that the workers find them on the disk. It ends with the sampler."""

    POLL = 0.05  # seconds between looks at the position

    def __init__(self, shards: CachedShards, sampler, shard_of: np.ndarray, ahead: int):
        self.shards, self.shard_of, self.ahead = shards, shard_of, ahead
        self._sampler = weakref.ref(sampler)
        self.error: Exception | None = None  # the last fetch's failure (a worker meets and reports its own)
        self.epoch, self.done = -1, 0  # the epoch followed, and how many of its shards (in plan order) are fetched
        threading.Thread(target=self._run, name="gpupipe-read-ahead", daemon=True).start()

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shards in the order this rank first needs them, and the batch that first needs each."""
        sampler = self._sampler()
        if sampler is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = np.asarray(sampler.rank_indices(epoch), np.int64)
        shards = self.shard_of[order]
        _, first = np.unique(shards, return_index=True)
        first = np.sort(first)
        return shards[first].astype(np.int64), first // sampler.batch_size

    def _run(self) -> None:
        order = first = np.zeros(0, np.int64)
        while (sampler := self._sampler()) is not None:
            position = sampler.position
            del sampler  # held only while looking: the loader's end ends this thread
            if position.epoch != self.epoch:
                self.epoch, self.done = position.epoch, 0
                order, first = self.plan(self.epoch)
            reached = int(np.searchsorted(first, position.batch, side="right"))  # shards the delivered batches used
            if self.done < min(reached + self.ahead, len(order)):
                try:
                    self.shards.fetch(int(order[self.done]))
                except Exception as e:  # the worker that needs the shard fetches it itself and reports the error
                    self.error = e
                self.done += 1
                continue
            time.sleep(self.POLL)
