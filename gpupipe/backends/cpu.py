"""The CPU decoders' backend (``pillow``, ``pillow-simd``, ``turbojpeg``, or any registered :class:`Decoder`): decode,
crop and augment one image at a time in DataLoader workers, collate uint8 batches, deliver them to any device.
:func:`cpu_decoder_spec` makes a whole backend spec from one decoder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from .._system import usable_cores
from ..data.device import normalize
from ..data.loader import DATALOADER_SETTINGS, Batch, Loader, LoaderParts
from ..data.scan import ImageList
from ..errors import DecodeError
from ..recipe import Recipe
from .image import chw_tensor
from .registry import BackendSpec, Decoder


class Sample(NamedTuple):
    """One sample as a decode worker hands it to the collate: the image, or why there is none."""

    path: str
    label: int
    image: np.ndarray | None  # (3, S, S) uint8
    error: str | None = None
    fell_back: bool = False
    key: tuple[int, int] = (0, 0)  # (epoch, index): the device stage augments from it when the worker did not


class _SampleDataset(torch.utils.data.Dataset):
    """One sample per ``(epoch, index)`` key: read, decode, crop, resize. Errors come back as data, so the main
    process raises them (with the file named) instead of a worker's traceback."""

    def __init__(self, dataset: ImageList, decoder: Decoder, recipe: Recipe, train: bool, seed: int, augment=None):
        self.dataset, self.decoder, self.recipe, self.train, self.seed = dataset, decoder, recipe, train, seed
        self.augment = augment  # a SampleAugment to run here, in the worker (CPU device), or None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Sample:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Sample]:
        """A batch (the DataLoader's fetcher calls this): its bytes read together, concurrently where the storage
        can (object storage: one round trip's latency for the batch), then each sample made."""
        data = self.dataset.read_many([index for _, index in keys])
        return [self._sample(key, d) for key, d in zip(keys, data, strict=True)]

    def _sample(self, key: tuple[int, int], data: bytes | Exception) -> Sample:
        epoch, index = key
        path, label = self.dataset.samples[index]
        try:
            if isinstance(data, Exception):
                raise data
            plan = self.recipe.plan(self.train, self.seed, epoch, index)
            image, fell_back = self.decoder.crop(data, path, plan, self.recipe.size)
            if self.augment is not None:
                image = self.augment.one(torch.from_numpy(image), epoch, index).numpy()
            return Sample(path, label, image, fell_back=fell_back, key=key)
        except DecodeError as e:
            return Sample(path, label, None, e.reason, key=key)
        except OSError as e:
            return Sample(path, label, None, f"cannot read the file ({e.strerror or e})", key=key)
        except Exception as e:  # anything else a decoder raises still names the file in the main process
            return Sample(path, label, None, f"{type(e).__name__}: {e}", key=key)


class _Collate:
    """Stack the good samples into one uint8 batch; with ``normalize`` (mean, 1/std), also normalize it here, in the
    worker, for batches that stay on a CPU whose cores the workers all take."""

    def __init__(self, size: int, normalize: tuple[torch.Tensor, torch.Tensor] | None = None, keys: bool = False):
        self.size, self.normalize, self.keys = size, normalize, keys

    def __call__(self, items: list[Sample]) -> Batch:
        good = [it for it in items if it.image is not None]
        images = torch.empty((len(good), 3, self.size, self.size), dtype=torch.uint8)
        if good:
            np.stack([it.image for it in good if it.image is not None], out=images.numpy())  # one copy, into the batch
        if self.normalize is not None:
            images = normalize(images, *self.normalize)
        labels = torch.tensor([it.label for it in good], dtype=torch.int64)
        errors = [(it.path, it.error or "") for it in items if it.image is None]
        keys = torch.tensor([it.key for it in good], dtype=torch.int64).view(-1, 2) if self.keys else None
        return Batch(images, labels, "NCHW", errors, sum(it.fell_back for it in items), keys)


class CpuLoader(Loader):
    """Pillow, pillow-simd and TurboJPEG: decode and augment in DataLoader workers, uint8 to the device."""

    def __init__(self, parts: LoaderParts, decoder: Decoder):
        super().__init__(parts)
        self.backend = decoder.name
        self.decoder = decoder
        # on a CPU device the workers augment, in parallel; on CUDA the device stage does, batched on the GPU
        in_worker = parts.stage.augment if parts.stage.device.type == "cpu" else None
        self._data = _SampleDataset(parts.dataset, decoder, parts.recipe, self.train, parts.seed, in_worker)
        self._dataloader: torch.utils.data.DataLoader | None = None

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        if self._dataloader is None:  # made once: persistent workers outlive epochs
            self._dataloader = torch.utils.data.DataLoader(
                self._data,
                batch_sampler=self.sampler,
                collate_fn=self._collate(),
                **self.parts.dataloader.kwargs(self.parts.workers),
            )
        self.sampler.set_epoch(epoch, start_batch)
        return iter(self._dataloader)

    def _collate(self) -> _Collate:
        """Batches for the CPU are normalized by the main process while it has a core to itself (it is otherwise
        idle), and by the workers, in parallel, once they take every core."""
        workers = self.parts.workers
        augment = self.stage.augment
        in_workers = (
            self.stage.device.type == "cpu"
            and self.stage.normalize
            and workers >= usable_cores()
            and (augment is None or augment.batch_transforms is None)
        )  # those see uint8 on the device
        return _Collate(
            self.recipe.size,
            (self.stage.mean, self.stage.inv_std) if in_workers else None,
            keys=augment is not None and self._data.augment is None,
        )


def cpu_decoder_spec(
    name: str, summary: str, make_decoder: Callable[[int | None, bool], Decoder], unavailable: Callable[[], str | None]
) -> BackendSpec:
    """The spec of a backend that decodes one image at a time on the CPU (``decode``/``decode_for_crop``/``crop``):
    DataLoader workers run it, and batches go to any device."""

    def make_loader(parts: LoaderParts) -> Loader:
        return CpuLoader(parts, make_decoder(parts.max_pixels, True))

    def read(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:

        return chw_tensor(make_decoder(max_pixels, True).decode(data, path)).to(device)

    return BackendSpec(
        name, summary, ("cpu", "cuda"), unavailable, make_loader, read, make_decoder, DATALOADER_SETTINGS
    )
