"""Random batches made on the device, no I/O and no decode: the compute ceiling a real backend is measured against."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..data.loader import Batch, Loader, LoaderParts
from .registry import BackendSpec


class SyntheticLoader(Loader):
    backend = "synthetic"

    def __init__(self, parts: LoaderParts):
        super().__init__(parts)
        self._images: dict[int, torch.Tensor] = {}  # per side (one, unless the recipe's size follows a schedule)
        self._labels = torch.tensor(parts.dataset.targets, dtype=torch.int64)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        device, size = self.stage.device, self.recipe.side(self.train, epoch)
        if size not in self._images:  # made once per size: the point is to cost nothing per step
            g = torch.Generator(device=device).manual_seed(self.seed)
            shape = (self.sampler.batch_size, 3, size, size)
            self._images[size] = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
        images, labels = self._images[size], self._labels.to(device)
        for idx in self.sampler.batches(epoch, start_batch):
            keys = torch.tensor([(epoch, i) for i in idx], dtype=torch.int64)  # the device stage augments from these
            yield Batch(images[: len(idx)], labels[torch.tensor(idx, device=device)], "NCHW", keys=keys)


SPEC = BackendSpec(
    "synthetic",
    "random uint8 batches made on the device, no I/O: the compute ceiling",
    ("cpu", "cuda"),
    lambda: None,
    SyntheticLoader,
)
