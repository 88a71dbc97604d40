"""The loader every backend returns: sampler order in, full (images, labels) batches on the device out,
with one policy for bad files (raise in the main process, or skip, refill and report)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import DecodeError, GpupipeError
from ..recipe import Recipe
from .device import DeviceStage, normalise
from .sampler import ShardSampler
from .scan import ImageList


@dataclass
class Batch:
    """What a backend's source yields: the good samples' uint8 images and labels, and the failures."""

    images: torch.Tensor  # uint8, (n,H,W,3) "NHWC" or (n,3,H,W) "NCHW"
    labels: torch.Tensor  # int64 (n,)
    layout: str = "NHWC"
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    fallbacks: int = 0  # samples a slower decoder had to take

    def pin_memory(self) -> Batch:  # DataLoader's pin thread calls this
        self.images, self.labels = self.images.pin_memory(), self.labels.pin_memory()
        return self


class Loader:
    """Iterable of ``(images, labels)``; ``len()``, ``set_epoch()``, ``skipped``, ``state_dict()``.

    Subclasses provide ``_source(epoch, start_batch)``: an iterator of :class:`Batch` following
    ``self.sampler.batches(epoch, start_batch)``.
    """

    backend: str = ""

    def __init__(self, dataset: ImageList, sampler: ShardSampler, stage: DeviceStage, recipe: Recipe, on_error: str):
        self.dataset, self.sampler, self.stage, self.recipe = dataset, sampler, stage, recipe
        self.on_error = on_error
        self.train = sampler.shuffle
        self.skipped: list[tuple[str, str]] = []
        self.fallbacks = 0
        self._position = 0
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
        batches = self._with_policy(self._source(epoch, start), sizes)
        for images, labels in self.stage.iterate(batches):
            self._position += 1
            yield images, labels
        self.sampler.set_epoch(epoch + 1)  # a full pass: the next one reshuffles unless told otherwise
        self._position, self._unfinished = 0, False

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        raise NotImplementedError

    def _with_policy(self, source: Iterator[Batch], sizes: list[int]) -> Iterator[Batch]:
        """Pass good batches through untouched; with skipped samples, fill each batch from the next ones and pad
        the epoch's end from its first samples, so every rank still takes exactly ``len(self)`` steps."""
        carry: Batch | None = None
        pool: Batch | None = None  # the first good samples, to pad the end with
        out = 0
        for b in source:
            self.fallbacks += b.fallbacks
            if b.errors:
                if self.on_error == "raise":
                    path, reason = b.errors[0]
                    raise DecodeError(path, self.backend, reason)
                self.skipped.extend(b.errors)
            if pool is None and len(b.labels):
                pool = b
            if carry is None and not b.errors and out < len(sizes) and len(b.labels) == sizes[out]:
                out += 1
                yield b  # the common case: no copy
                continue
            carry = b if carry is None else _cat(carry, b)
            while out < len(sizes) and len(carry.labels) >= sizes[out]:
                head, carry = _split(carry, sizes[out])
                out += 1
                yield head
        while out < len(sizes):
            if pool is None:
                raise GpupipeError(f"no sample of this epoch could be decoded ({len(self.skipped)} skipped)")
            carry = pool if carry is None else _cat(carry, pool)
            if len(carry.labels) >= sizes[out]:
                head, carry = _split(carry, sizes[out])
                out += 1
                yield head


def _cat(a: Batch, b: Batch) -> Batch:
    return Batch(torch.cat([a.images, b.images]), torch.cat([a.labels, b.labels]), a.layout)


def _split(b: Batch, n: int) -> tuple[Batch, Batch]:
    return Batch(b.images[:n], b.labels[:n], b.layout), Batch(b.images[n:], b.labels[n:], b.layout)


class _SampleDataset(torch.utils.data.Dataset):
    """One sample per ``(epoch, index)`` key: read, decode, crop, resize. Errors come back as data, so the main
    process raises them (with the file named) instead of a worker's traceback."""

    def __init__(self, dataset: ImageList, decoder, recipe: Recipe, train: bool, seed: int):
        self.dataset, self.decoder, self.recipe, self.train, self.seed = dataset, decoder, recipe, train, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        path, label = self.dataset.samples[index]
        try:
            data = self.dataset.read(index)
            plan = self.recipe.plan(self.train, self.seed, epoch, index)
            image, fell_back = self.decoder.crop(data, path, plan, self.recipe.size)
            return path, label, image, None, fell_back
        except DecodeError as e:
            return path, label, None, e.reason, False
        except OSError as e:
            return path, label, None, f"cannot read the file ({e.strerror or e})", False
        except Exception as e:  # anything else a decoder raises still names the file in the main process
            return path, label, None, f"{type(e).__name__}: {e}", False


class _Collate:
    """Stack the good samples into one uint8 batch; with ``normalize`` (mean, 1/std), also normalise it here, in the
    worker, for batches that stay on a CPU whose cores the workers all take."""

    def __init__(self, size: int, normalize: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.size, self.normalize = size, normalize

    def __call__(self, items) -> Batch:
        good = [it for it in items if it[2] is not None]
        images = torch.empty((len(good), 3, self.size, self.size), dtype=torch.uint8)
        if good:
            np.stack([it[2] for it in good], out=images.numpy())  # one copy, into the batch
        if self.normalize is not None:
            images = normalise(images, *self.normalize)
        labels = torch.tensor([it[1] for it in good], dtype=torch.int64)
        errors = [(it[0], it[3]) for it in items if it[2] is None]
        return Batch(images, labels, "NCHW", errors, sum(it[4] for it in items))


class CpuLoader(Loader):
    """Pillow, pillow-simd and TurboJPEG: decode and augment in DataLoader workers, uint8 to the device."""

    def __init__(self, dataset, sampler, stage, recipe, on_error, *, decoder, seed: int, dataloader_kwargs: dict):
        super().__init__(dataset, sampler, stage, recipe, on_error)
        self.backend = decoder.name
        self.decoder = decoder
        self._data = _SampleDataset(dataset, decoder, recipe, self.train, seed)
        self._kwargs = dataloader_kwargs
        self._dataloader: torch.utils.data.DataLoader | None = None

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        if self._dataloader is None:  # made once: persistent workers outlive epochs
            self._dataloader = torch.utils.data.DataLoader(
                self._data, batch_sampler=self.sampler, collate_fn=self._collate(), **self._kwargs
            )
        self.sampler.set_epoch(epoch, start_batch)
        return iter(self._dataloader)

    def _collate(self) -> _Collate:
        """Batches for the CPU are normalised by the main process while it has a core to itself (it is otherwise
        idle), and by the workers, in parallel, once they take every core."""
        from ..api import usable_cores

        workers = self._kwargs.get("num_workers", 0)
        in_workers = self.stage.device.type == "cpu" and self.stage.normalize and workers >= usable_cores()
        return _Collate(self.recipe.size, (self.stage.mean, self.stage.inv_std) if in_workers else None)
