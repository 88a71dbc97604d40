"""DALI's feed, off the training thread, a whole batch at a time.

DALI decodes what it is fed; before this module the training thread read every file, judged every header and drew
every crop (11-18 ms of its CPU per 256-image batch). Now DataLoader workers do all of it per batch (:class:`Feed`):
each returns one :class:`Work` holding the batch's encoded bytes as **one** uint8 tensor (shared memory, not
pickled; zero-padded rows when the batch is all JPEG), the crop rows as one (n, 6) int64 array and the samples
Pillow had to take. The training thread feeds the two arrays as they are (``no_copy``: DALI reads them in place).

Nothing is read before training: each sample's size, EXIF orientation, pixel limit and format are judged from the
bytes the worker just read (``header_entry``), or taken from the sizes a prepared data set recorded. Files that
only Pillow decodes (formats DALI lacks, CMYK, 16-bit) are decoded by Pillow in the worker and counted as fallbacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..data.loader import start_workers
from ..data.upload import Reaper
from ..errors import DecodeError
from ..recipe import Recipe
from .image import HeaderCheck, header_entry, is_jpeg, pixel_limit_reason
from .pillow import PillowDecoder

_PAD_RATIO = 4.0  # padded rows cost at most this many times the bytes themselves
_EOI, _EOI_TAIL = b"\xff\xd9", 4096  # a whole JPEG ends with its end-of-image marker (trailing bytes allowed)


@dataclass
class Work:
    """One batch on its way through the pipeline: which samples DALI decodes, which Pillow decoded, which failed."""

    epoch: int
    indices: list[int]  # the sampler's batch, in order
    dali: list[int] = field(default_factory=list)  # positions in ``indices`` fed to DALI
    encoded: torch.Tensor | None = None  # uint8: the DALI samples' bytes (see ``Feed._encoded``), shared memory
    lengths: np.ndarray | None = None  # int64 (len(dali),): each sample's byte count
    rows: np.ndarray | None = None  # int64 (len(dali), 6 or 4): crop or eval-resize rows, one per DALI sample
    cpu: dict[int, np.ndarray] = field(default_factory=dict)  # position -> (3, S, S) decoded by Pillow
    errors: list[tuple[str, str]] = field(default_factory=list)
    fallbacks: int = 0
    scheduled: bool = False
    stamps: list[tuple[int, int] | None] = field(default_factory=list)  # next-epoch work: its files' (mtime, size)
    data: list[np.ndarray] | None = None  # set when a retry narrows the batch: the samples left, one array each

    def samples(self) -> list[np.ndarray]:
        """Each DALI sample's bytes, as views (no copy)."""
        if self.data is not None:
            return self.data
        if self.encoded is None or self.lengths is None:
            return []
        enc = self.encoded.numpy()
        if enc.ndim == 2:
            return [row[:n] for row, n in zip(enc, self.lengths.tolist(), strict=True)]
        return np.split(enc, np.cumsum(self.lengths)[:-1])

    def batch(self) -> np.ndarray | list[np.ndarray]:
        """What DALI is fed: one (n, L) array when the feed padded the batch (no per-sample work on this thread),
        else one view per sample."""
        if self.data is None and self.encoded is not None and self.encoded.dim() == 2:
            return self.encoded.numpy()
        return self.samples()


class Request(NamedTuple):
    epoch: int
    indices: list[int]
    stamp: bool  # record the files' (mtime, size) before reading (a next-epoch batch, kept only if unchanged)


def file_stamp(dataset, index: int) -> tuple[int, int] | None:
    if not dataset.reads_files:  # shards are not rewritten under a running loader
        return None
    try:
        st = os.stat(dataset.samples[index][0])
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Feed(torch.utils.data.Dataset):
    """One :class:`Request` -> its :class:`Work`, in a DataLoader worker (or in the caller with no workers)."""

    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int):
        self.dataset, self.recipe, self.train, self.seed, self.max_pixels = dataset, recipe, train, seed, max_pixels
        self.check = PillowDecoder(max_pixels)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, request: Request) -> Work:
        work = Work(request.epoch, request.indices)
        if request.stamp:
            work.stamps = [file_stamp(self.dataset, i) for i in request.indices]  # before the read
        chunks: list[bytes] = []
        rows: list[tuple[float, ...]] = []
        plans = self.recipe.plans(self.train, self.seed, [(request.epoch, i) for i in request.indices])
        read = self.dataset.read_many(request.indices)  # together: object storage serves a batch in few requests
        for pos, (i, plan, data) in enumerate(zip(request.indices, plans, read, strict=True)):
            taken = self._sample(work, pos, i, plan, data)
            if taken is not None:
                work.dali.append(pos)
                chunks.append(taken[0])
                rows.append(taken[1])
        work.lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
        work.encoded = _encoded(chunks, work.lengths) if chunks else None
        work.rows = np.asarray(rows, dtype=np.int64).reshape(len(rows), 6 if self.train else 4)
        return work

    def _sample(
        self, work: Work, pos: int, i: int, plan: Callable, data: bytes | Exception
    ) -> tuple[bytes, tuple[float, ...]] | None:
        """(bytes, row) for DALI, or None: the sample failed (in ``work.errors``) or Pillow decoded it."""
        path = self.dataset.samples[i][0]
        if isinstance(data, OSError):
            work.errors.append((path, f"cannot read the file ({data.strerror or data})"))
            return None
        if isinstance(data, Exception):  # not a bad file (object storage gone): the loader raises it
            raise data
        entry = self._judge(i, data)
        if entry.problem is not None:
            work.errors.append((path, entry.problem))
            return None
        height, width, pillow_only = entry.height, entry.width, entry.pillow_only
        if is_jpeg(data) and data.rfind(_EOI, max(0, len(data) - _EOI_TAIL)) < 0:
            try:  # DALI decodes only the crop's rows, so it may never reach a truncation; Pillow decides
                self.check.decode(data, path)
            except DecodeError as e:
                work.errors.append((path, e.reason))
                return None
        size = self.recipe.side(self.train, work.epoch)  # the epoch's (a resolution schedule's)
        if pillow_only:
            decode_on_cpu(self.check, size, work, pos, path, data, plan)
            return None
        if self.train:  # the size goes with the crop: the pipeline resizes to it, and is never rebuilt for another
            box = plan(height, width)
            return data, (box.top, box.left, box.height, box.width, int(box.flip), size)
        return data, self.recipe.eval_offsets(height, width)

    def _judge(self, i: int, data: bytes) -> HeaderCheck:
        """Upright (height, width) and whether only Pillow decodes it, or why it cannot be decoded: from the bytes
        just read, or from the sizes a prepared data set recorded (its files are JPEGs DALI takes)."""
        if not data:
            return HeaderCheck(problem="empty file")
        if self.dataset.sizes is not None:
            h, w = (int(v) for v in self.dataset.sizes[i])
            reason = pixel_limit_reason(w, h, self.max_pixels)
            return HeaderCheck(problem=reason) if reason is not None else HeaderCheck(h, w, False)
        return header_entry(data, self.max_pixels)


def _encoded(chunks: list[bytes], lengths: np.ndarray) -> torch.Tensor:
    """The batch's bytes as one tensor. All JPEGs, and padding costs under half the bytes: an (n, L) array, each row
    a file followed by zeros (JPEG decoders stop at the end-of-image marker), which DALI takes as one dense batch
    with no per-sample work on the training thread. Otherwise the files one after the other (1-D)."""
    longest = int(lengths.max())
    if all(is_jpeg(c) for c in chunks) and longest * len(chunks) <= _PAD_RATIO * lengths.sum():
        out = torch.zeros(len(chunks), longest, dtype=torch.uint8)
        rows = out.numpy()
        for k, c in enumerate(chunks):
            rows[k, : len(c)] = np.frombuffer(c, np.uint8)
        return out
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def decode_on_cpu(check: PillowDecoder, size: int, work: Work, pos: int, path: str, data: bytes, plan) -> None:
    try:
        work.cpu[pos], _ = check.crop(data, path, plan, size)
        work.fallbacks += 1
    except DecodeError as e:
        work.errors.append((path, e.reason))


class _Requests:
    """The DataLoader's sampler: the current pass's requests, set before each ``iter()`` of the loader."""

    def __init__(self) -> None:
        self.current: Iterable[Request] = ()

    def __iter__(self) -> Iterator[Request]:
        return iter(self.current)


class FeedStream:
    """:class:`Feed` in ``workers`` DataLoader processes (persistent), returning each request's work in order."""

    def __init__(self, feed: Feed, workers: int):
        self._requests = _Requests()
        extra: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 2} if workers > 0 else {}
        if workers > 0:
            extra["worker_init_fn"] = _share_by_name
        self._loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
            feed,
            batch_size=None,
            sampler=self._requests,  # requests, not indices: Feed takes them
            collate_fn=_as_is,  # type: ignore[arg-type]  # no batching: one Work per request
            num_workers=workers,
            **extra,
        )

        self._reaper = Reaper()

    def release(self, work: Work) -> None:
        """Drop a fetched work on another thread (its shared-memory buffer, see :class:`Reaper`)."""
        self._reaper.drop(work)

    def stream(self, requests: Iterable[Request]) -> Iterator[Work]:
        self._requests.current = requests
        yield from start_workers(self._loader)


def _share_by_name(worker_id: int) -> None:
    """In the feed's workers: a batch's shared-memory bytes are sent by name ("file_system"), not as a file
    descriptor. Receiving a descriptor costs the training thread a connection to the worker's resource sharer with its
    authentication handshake, every batch: about 0.7 ms of the thread's 3.6 ms per 256-batch (bench/host_budget.py).
    The strategy is the sender's choice, so it is set here only; torch_shm_manager removes what a dead process left."""
    torch.multiprocessing.set_sharing_strategy("file_system")


def _as_is(work: Work) -> Work:
    return work
