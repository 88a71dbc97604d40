"""The loader every backend returns: sampler order in, full (images, labels) batches on the device out,
with one policy for bad files (raise in the main process, or skip, refill and report)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..errors import DecodeError, GpupipeError, StorageError
from ..recipe import Recipe
from .device import DeviceStage, Layout
from .sampler import ShardSampler
from .scan import ImageList

OnError = Literal["raise", "skip"]
DATALOADER_SETTINGS = ("pin_memory", "prefetch_factor", "persistent_workers")


@dataclass
class Batch:
    """What a backend's source yields: the good samples' uint8 images and labels, and the failures."""

    images: torch.Tensor  # uint8, (n,H,W,3) "NHWC" or (n,3,H,W) "NCHW"
    labels: torch.Tensor  # int64 (n,)
    layout: Layout = "NHWC"
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    fallbacks: int = 0  # samples a slower decoder had to take
    # int64 (n, 2) on the CPU: each sample's (epoch, index), when its per-sample augmentation (the recipe's policy,
    # per-image transforms) is still to do; the device stage does it from these keys. None: done (or none to do).
    keys: torch.Tensor | None = None

    def pin_memory(self) -> Batch:  # DataLoader's pin thread calls this
        self.images, self.labels = self.images.pin_memory(), self.labels.pin_memory()
        return self


@dataclass(frozen=True)
class DataLoaderSettings:
    """The ``torch.utils.data.DataLoader`` settings of a backend that decodes in DataLoader workers (the CPU decoders,
    nvjpeg's reads); ``build_loader`` refuses them, set explicitly, for a backend that does not use them."""

    pin_memory: bool = False
    prefetch_factor: int = 4  # batches per worker in flight (DataLoader's own default is 2)
    persistent_workers: bool = True  # workers outlive epochs

    def kwargs(self, num_workers: int) -> dict[str, Any]:
        """The DataLoader's keyword arguments for ``num_workers`` (0: the main process, which takes no prefetch)."""
        if num_workers == 0:
            return {"num_workers": 0, "pin_memory": self.pin_memory}
        return {
            "num_workers": num_workers,
            "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers,
        }


@dataclass(frozen=True)
class LoaderParts:
    """What ``build_loader`` prepares for every backend: the data, the order, the device stage, the recipe and the
    policies. A backend's ``make_loader`` takes this one record."""

    dataset: ImageList
    sampler: ShardSampler
    stage: DeviceStage
    recipe: Recipe
    on_error: OnError
    seed: int
    workers: int  # decode workers (DataLoader processes or DALI threads); 0 decodes in the main process
    max_pixels: int | None
    dataloader: DataLoaderSettings = field(default_factory=DataLoaderSettings)


def empty_batch(size: int, device: torch.device | str = "cpu", errors: list[tuple[str, str]] | None = None) -> Batch:
    """A batch with no sample (only failures); its images on ``device``, so it concatenates with that device's
    batches (labels stay on the CPU in every batch: the device stage moves them)."""
    return Batch(
        torch.empty(0, 3, size, size, dtype=torch.uint8, device=device),
        torch.empty(0, dtype=torch.int64),
        "NCHW",
        errors or [],
    )


class Loader:
    """Iterable of ``(images, labels)``; ``len()``, ``set_epoch()``, ``skipped``, ``state_dict()``.

    Subclasses provide ``_source(epoch, start_batch)``: an iterator of :class:`Batch` following
    ``self.sampler.batches(epoch, start_batch)``.
    """

    backend: str = ""

    def __init__(self, parts: LoaderParts):
        self.parts = parts
        self.dataset, self.sampler, self.stage, self.recipe = parts.dataset, parts.sampler, parts.stage, parts.recipe
        self.on_error, self.seed = parts.on_error, parts.seed
        self.train = parts.sampler.shuffle
        self.skipped: list[tuple[str, str]] = []
        self.fallbacks = 0
        self._position = 0
        self._pass = 0  # counts passes: an iterator whose pass is no longer the latest stops (see __iter__)
        self._resume_at: tuple[int, int] | None = None  # a loaded (epoch, batch) that set_epoch(epoch) keeps
        self._unfinished = False  # a pass was started and not run to its end

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def device(self) -> torch.device:
        return self.stage.device

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle. Iteration moves on by itself (after a full pass, or when a pass was left
        unfinished); ``set_epoch(e)`` for the epoch just loaded by ``load_state_dict`` keeps the loaded position."""
        keep = self._resume_at[1] if self._resume_at and self._resume_at[0] == epoch else 0
        self.sampler.set_epoch(epoch, keep)
        self._position, self._unfinished = keep, False

    def state_dict(self) -> dict:
        """Where the loader is: resume with ``load_state_dict`` to continue mid-epoch with the same order. After a
        full pass it points at the start of the next epoch."""
        return {"epoch": self.sampler.epoch, "batch": self._position}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_epoch(int(state["epoch"]), int(state["batch"]))
        self._position = int(state["batch"])
        self._resume_at, self._unfinished = (int(state["epoch"]), int(state["batch"])), False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._unfinished:  # the last pass was cut short (a step cap, a break): do not replay its first batches
            self.sampler.set_epoch(self.sampler.epoch + 1)
        epoch, start = self.sampler.epoch, self.sampler.start_batch
        self.skipped, self.fallbacks, self._position = [], 0, start
        self._resume_at, self._unfinished = None, True
        sizes = [len(b) for b in self.sampler.batches(epoch, start)]
        self._pass += 1
        this_pass = self._pass
        batches = self._with_policy(self._source(epoch, start), sizes)
        for images, labels in self.stage.iterate(batches):
            self._position += 1
            yield images, labels
            if self._pass != this_pass:  # a newer pass took over the workers or the pipeline: stop, never mix
                raise GpupipeError(
                    "this loader was iterated again while this iterator was unfinished; only the "
                    "newest iterator of a loader delivers batches"
                )
        self.sampler.set_epoch(epoch + 1)  # a full pass: the next one reshuffles unless told otherwise
        self._position, self._unfinished = 0, False

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        raise NotImplementedError

    def _with_policy(self, source: Iterator[Batch], sizes: list[int]) -> Iterator[Batch]:
        """The error policy on the backend's batches: raise the first failure in the main process, or record it
        and fill each batch from the next samples. Train pads the epoch's end from its first samples, so every rank
        still takes exactly ``len(self)`` steps; eval delivers each good sample once (its last batch may be short,
        and it may have fewer batches)."""
        return _rebatch(self._checked(source), sizes, pad=self.train)

    def _checked(self, source: Iterator[Batch]) -> Iterator[Batch]:
        for b in source:
            self.fallbacks += b.fallbacks
            if b.errors:
                _raise_storage_errors(b.errors)  # the store failing is no bad sample: never skipped
                if self.on_error == "raise":
                    path, reason = b.errors[0]
                    raise DecodeError(path, self.backend, reason)
                self.skipped.extend(b.errors)
            yield b


def _raise_storage_errors(errors: list[tuple[str, str]]) -> None:
    """A worker reports a :class:`StorageError` as ``"StorageError: <message>"`` (see ``_SampleDataset``): raise
    it here, in the main process, whatever ``on_error`` says."""
    prefix = f"{StorageError.__name__}: "
    for _, reason in errors:
        if reason.startswith(prefix):
            raise StorageError(reason[len(prefix) :])


def _rebatch(batches: Iterator[Batch], sizes: list[int], pad: bool) -> Iterator[Batch]:
    """Batches of exactly ``sizes`` from batches that may have lost samples; full batches pass untouched (no copy).
    With ``pad``, the end is filled from the first good samples; without, the remainder is the last batch."""
    carry: Batch | None = None
    pool: Batch | None = None  # the first good samples, to pad the end with
    out = 0
    for b in batches:
        if pool is None and len(b.labels):
            pool = b
        if carry is None and out < len(sizes) and len(b.labels) == sizes[out]:
            out += 1
            yield b  # the common case
            continue
        carry = b if carry is None else _cat(carry, b)
        while out < len(sizes) and len(carry.labels) >= sizes[out]:
            head, carry = _split(carry, sizes[out])
            out += 1
            yield head
    if not pad:
        if carry is not None and len(carry.labels):
            yield carry
        return
    for size in sizes[out:]:
        if pool is None:
            raise GpupipeError("no sample of this epoch could be decoded: every file was skipped")
        while carry is None or len(carry.labels) < size:
            carry = pool if carry is None else _cat(carry, pool)
        head, carry = _split(carry, size)
        yield head


def _cat(a: Batch, b: Batch) -> Batch:
    if len(a.labels) == 0 or len(b.labels) == 0:  # a batch of failures only: nothing to join (nor its layout)
        a = b if len(a.labels) == 0 else a
        return Batch(a.images, a.labels, a.layout, keys=a.keys)
    keys = None if a.keys is None or b.keys is None else torch.cat([a.keys, b.keys])
    return Batch(torch.cat([a.images, b.images]), torch.cat([a.labels, b.labels]), a.layout, keys=keys)


def _split(b: Batch, n: int) -> tuple[Batch, Batch]:
    k = (None, None) if b.keys is None else (b.keys[:n], b.keys[n:])
    return (
        Batch(b.images[:n], b.labels[:n], b.layout, keys=k[0]),
        Batch(b.images[n:], b.labels[n:], b.layout, keys=k[1]),
    )
