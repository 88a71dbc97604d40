"""A batch's samples from object storage in few requests, as litdata and Mosaic streaming read whole chunks rather
than one request per sample.

An object store charges per request (a round trip, and the server's own work per GET), not per byte, so
:class:`BatchReader` turns a batch's sample ranges into few, larger range reads, all in flight at once:

- **blocks, kept** (the data set's shards fit in ``Remote.memory_cache``): each sample's aligned block of
  :data:`BLOCK` bytes is read once and kept in this process (a DataLoader worker keeps its own), so an epoch costs
  about ``shard bytes / BLOCK`` requests whatever the order, and later epochs none. Also for a larger set when the
  loader's ``shuffle_window`` is ``K`` shards and ``K`` shards fit (:meth:`BatchReader.set_window`): the blocks are
  then kept least recently used first out, and as an epoch takes its shards ``K`` at a time (the
  :func:`~.sampler.window_order`), each block is read once per epoch and process, in few large requests;
- **coalesced ranges** (otherwise): the batch's samples that lie in the same shard are merged into one request
  when the gap between them is at most :data:`MAX_GAP` bytes (at most :data:`MAX_SPAN` per request). A globally
  shuffled batch of a large set is spread over many shards, so this saves little there (about a request per sample:
  :meth:`BatchReader.advice` says so, and what to change), but a sequential pass (evaluation, ``shuffle=False``)
  reads each batch in one request per shard it touches.

Either way the bytes are exactly the index's ranges: a short answer is a truncated object, and a failed request
(after :class:`~.objstore.Store`'s retries) is the error of every sample it held, naming the URL.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, cast

import numpy as np

from .objstore import Store

BLOCK = 8 << 20  # bytes per kept block
MAX_GAP = 256 << 10  # bytes read and dropped between two samples of one request, at most
MAX_SPAN = 16 << 20  # bytes per coalesced request, at most


class Span(NamedTuple):
    shard: int
    start: int
    end: int


class BatchReader:
    """Reads samples of the shards at ``urls`` (``ends[s]``: where shard ``s``'s last sample ends) by range, with
    blocks kept in memory when every shard fits ``memory_cache`` bytes (or, after :meth:`set_window`, the window's
    shards do), else by coalesced ranges."""

    def __init__(self, store: Store, urls: Sequence[str], ends: np.ndarray, memory_cache: int):
        self.store, self.urls, self.ends = store, urls, ends
        self.requests = 0  # range requests this process made (tests and the bench read it)
        self.bytes_read = 0  # and the bytes they asked for
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._budget = memory_cache
        self._held = 0
        self._pid = os.getpid()
        self.set_window(None)  # keeps_blocks: whether the set fits, until a loader says its window

    def __getstate__(self):  # a spawned worker starts with no blocks
        return {**self.__dict__, "_blocks": OrderedDict(), "_held": 0, "requests": 0, "bytes_read": 0}

    def window_bytes(self, window: int) -> int:
        """The most bytes ``window`` shards hold: the largest ones'."""
        return int(np.sort(self.ends)[::-1][:window].sum())

    def set_window(self, window: int | None) -> None:
        """The loader's ``shuffle_window`` (shards; None: a global shuffle, or none): keep blocks also when that many
        shards fit the budget, the largest ones, which is what the window order needs to read each block once."""
        self.window: int | None = window  # the loader's shuffle_window, in shards
        fits = 0 < int(self.ends.sum()) <= self._budget
        self.keeps_blocks = fits or (window is not None and 0 < self.window_bytes(window) <= self._budget)

    def advice(self, shuffled: bool) -> str | None:
        """One line when a shuffled epoch will be read by range, about a request per sample (the set does not fit
        the budget, nor does the window), saying what would keep blocks instead; None when nothing is to change."""
        if not shuffled or self.keeps_blocks:
            return None
        fit = int(np.searchsorted(np.cumsum(np.sort(self.ends)[::-1]), self._budget, side="right"))
        budget = f"Remote(memory_cache=) of {_mib(self._budget)} per process"
        fix = (
            f"shuffle_window={fit} or less (the largest {fit} shards hold {_mib(self.window_bytes(fit))}), or a larger "
            "memory_cache"
            if fit
            else f"a memory_cache of at least {_mib(int(self.ends.max()))} (the largest shard) with a shuffle_window, "
            "or smaller shards (gpupipe prepare --shard-size 64MB)"
        )
        if self.window is None:
            what = f"a global shuffle over {_mib(int(self.ends.sum()))} of shards, more than the {budget}"
        else:
            what = f"shuffle_window={self.window} spans up to {_mib(self.window_bytes(self.window))} of shards, more "
            what += f"than the {budget}"
        return f"{what}, reads about one range request per sample: use {fix}"

    def read(self, shards: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> list[bytes | Exception]:
        """Each sample's bytes (shard ``shards[k]``, ``sizes[k]`` bytes at ``starts[k]``), or why it has none."""
        if self._pid != os.getpid():  # a forked worker: the parent's blocks are not worth its memory
            self._blocks, self._held, self._pid = OrderedDict(), 0, os.getpid()
            self.requests = self.bytes_read = 0
        if self.keeps_blocks:
            return self._from_blocks(shards, starts, sizes)
        spans, where = coalesce(shards, starts, sizes)
        got = self._fetch(spans)
        out: list[bytes | Exception] = []
        for (k, at), size in zip(where, sizes, strict=True):
            data = got[k]
            out.append(data if isinstance(data, Exception) else data[at : at + size])
        return out

    def _fetch(self, spans: list[Span]) -> list[bytes | Exception]:
        if not spans:
            return []
        self.requests += len(spans)
        self.bytes_read += sum(s.end - s.start for s in spans)
        return self.store.read_many(
            [self.urls[s.shard] for s in spans], [s.start for s in spans], [s.end - s.start for s in spans]
        )

    def _from_blocks(self, shards, starts, sizes) -> list[bytes | Exception]:
        per_sample = [
            [(s, b) for b in range(start // BLOCK, max(start + size - 1, start) // BLOCK + 1)]
            for s, start, size in zip(shards, starts, sizes, strict=True)
        ]  # each sample's blocks, in order
        wanted = dict.fromkeys(key for keys in per_sample for key in keys)
        have: dict[tuple[int, int], bytes | Exception] = {}
        for key in wanted:  # .get: safe beside another thread's _keep (no lock: at worst a block read twice)
            block = self._blocks.get(key)
            if block is not None:
                have[key] = block
                self._used(key)
        missing = [key for key in wanted if key not in have]
        spans = [Span(s, b * BLOCK, min((b + 1) * BLOCK, int(self.ends[s]))) for s, b in missing]
        for key, data in zip(missing, self._fetch(spans), strict=True):
            have[key] = data
            if not isinstance(data, Exception):
                self._keep(key, data)
        out: list[bytes | Exception] = []
        for keys, start, size in zip(per_sample, starts, sizes, strict=True):
            parts = [have[k] for k in keys]
            error = next((p for p in parts if isinstance(p, Exception)), None)
            if error is not None:
                out.append(error)
                continue
            blocks = cast(list[bytes], parts)
            joined = b"".join(blocks) if len(blocks) > 1 else blocks[0]
            at = start - keys[0][1] * BLOCK
            out.append(joined[at : at + size])
        return out

    def _used(self, key: tuple[int, int]) -> None:
        """A kept block was used: it is now the last to drop."""
        try:
            self._blocks.move_to_end(key)
        except KeyError:  # another thread dropped it meanwhile
            pass

    def _keep(self, key: tuple[int, int], data: bytes) -> None:
        """Keep a block, dropping the least recently used past the budget (the set's shards fit it, or the window's
        do and the blocks dropped are those of the shards the epoch has left behind)."""
        if key in self._blocks:
            return
        self._blocks[key] = data
        self._held += len(data)
        while self._held > self._budget and len(self._blocks) > 1:
            _, old = self._blocks.popitem(last=False)
            self._held -= len(old)


def coalesce(
    shards: Sequence[int], starts: Sequence[int], sizes: Sequence[int], max_gap: int = MAX_GAP, max_span: int = MAX_SPAN
) -> tuple[list[Span], list[tuple[int, int]]]:
    """The requests for a batch's samples: samples of one shard less than ``max_gap`` bytes apart share a request of
    at most ``max_span`` bytes (one sample larger than that is its own). Returns the spans, and for each sample its
    span and where it starts in it."""
    spans: list[Span] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(starts)
    for k in sorted(range(len(starts)), key=lambda k: (shards[k], starts[k])):
        s, start, end = shards[k], starts[k], starts[k] + sizes[k]
        last = spans[-1] if spans else None
        if last is not None and last.shard == s and start - last.end <= max_gap and end - last.start <= max_span:
            spans[-1] = last = Span(s, last.start, max(last.end, end))
        else:
            spans.append(Span(s, start, end))
        where[k] = (len(spans) - 1, start - spans[-1].start)
    return spans, where


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
