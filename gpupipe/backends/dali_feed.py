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

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .._files import Stamp, file_stamp
from ..errors import DecodeError
from ..recipe import Recipe
from .image import HeaderCheck, ends_whole, header_entry, is_jpeg, pixel_limit_reason
from .pillow import PillowDecoder

_PAD_RATIO = 4.0  # padded rows cost at most this many times the bytes themselves


@dataclass
class Work:
    """One batch on its way through the pipeline: which samples DALI decodes, which Pillow decoded, which failed."""

    epoch: int
    indices: list[int]  # the sampler's batch, in order
    number: int = 0  # which batch of its epoch (the loader's count)
    dali: list[int] = field(default_factory=list)  # positions in ``indices`` fed to DALI
    encoded: torch.Tensor | None = None  # uint8: the DALI samples' bytes (see ``Feed._encoded``), shared memory
    lengths: np.ndarray | None = None  # int64 (len(dali),): each sample's byte count
    rows: np.ndarray | None = None  # int64 (len(dali), 6 or 4): crop or eval-resize rows, one per DALI sample
    cpu: dict[int, np.ndarray] = field(default_factory=dict)  # position -> (3, S, S) decoded by Pillow
    errors: list[tuple[str, str]] = field(default_factory=list)
    fallbacks: int = 0
    scheduled: bool = False
    stamps: list[Stamp] = field(default_factory=list)  # read before its pass began: its files as they were then
    index: np.ndarray | None = None  # int64 (len(indices),): ``indices`` as an array, made in the worker
    labels: np.ndarray | None = None  # int64 (len(indices),): their labels, made in the worker
    data: list[np.ndarray] | None = None  # set when a retry narrows the batch: the samples left, one array each
    listed: Any = None  # the samples as one DALI TensorListCPU, made on the feed's thread (see ``prepare``)
    # set where DALI reads the files itself (:mod:`.dali_files`), instead of ``encoded``: uint8 (len(dali), L), each
    # DALI sample's path, then what follows it in the path table (its length is the last column of ``rows``)
    paths: np.ndarray | None = None

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

    def narrow(self, chosen: list[int]) -> None:
        """Left with its DALI samples at ``chosen`` (positions in ``self.dali``), for a retry after DALI failed."""
        assert self.rows is not None  # a work DALI failed on had rows
        if self.paths is not None:
            self.paths = self.paths[chosen]
        else:
            views = self.samples()
            self.data = [views[k] for k in chosen]
        self.dali, self.rows = [self.dali[k] for k in chosen], self.rows[chosen]

    def batch(self) -> Any:
        """What DALI is fed: one (n, L) array when the feed padded the batch, else the samples as the TensorListCPU
        :meth:`prepare` made (no per-sample work on the training thread either way), else one view per sample."""
        if self.data is None and self.encoded is not None and self.encoded.dim() == 2:
            return self.encoded.numpy()
        if self.data is None and self.listed is not None:
            return self.listed
        return self.samples()

    def prepare(self) -> None:
        """On the feed's thread: the samples of a batch the feed could not pad as one DALI TensorListCPU (a copy),
        which DALI takes as it is. Given as a list, DALI converts each sample on the thread that feeds it: about
        3 ms a 256-batch, more than the rest of the training thread's part (bench/host_budget.py)."""
        if self.encoded is not None and self.encoded.dim() == 1 and self.data is None:
            from nvidia.dali.tensors import TensorListCPU  # defer: this module is imported without DALI too

            self.listed = TensorListCPU(self.samples(), "")


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


class Feed(torch.utils.data.Dataset):
    """One :class:`Request` -> its :class:`Work`, in a DataLoader worker (or in the caller with no workers)."""

    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int):
        self.dataset, self.recipe, self.train, self.seed, self.max_pixels = dataset, recipe, train, seed, max_pixels
        self.gate = Gate()
        self.check = PillowDecoder(max_pixels)
        self._targets: np.ndarray | None = None  # the labels as one array, made on first use (in each worker)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, request: Request) -> Work:
        if request.wait:
            self.gate.wait(request.epoch)
        work = Work(request.epoch, request.indices, request.number)
        if request.ahead and self.dataset.reads_files:  # shards are not rewritten under a running loader
            work.stamps = [file_stamp(self.dataset.samples[i][0]) for i in request.indices]  # before the read
        if self._targets is None:
            self._targets = np.asarray(self.dataset.targets, dtype=np.int64)
        work.index = np.asarray(request.indices, dtype=np.int64)
        work.labels = self._targets[work.index]  # here, not on the training thread
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
        if is_jpeg(data) and not ends_whole(data):
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
