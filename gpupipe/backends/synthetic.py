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
        # made once per side (one, unless the recipe's size follows a schedule): the point is to cost nothing per
        # step. Drawn on the CPU (the same images on every device, and the meta device has no generator), copied once.
        # (a schedule's later sides: one copy when the side first changes, never per step)
        self._images: dict[int, torch.Tensor] = {}
        self._labels = torch.tensor(parts.dataset.targets, dtype=torch.int64)
        self._made(self.recipe.side(self.train, 0))

    def _made(self, size: int) -> torch.Tensor:
        if size not in self._images:
            g = torch.Generator().manual_seed(self.seed)
            shape = (self.sampler.batch_size, 3, size, size)
            self._images[size] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(self.stage.device)
        return self._images[size]

    def _made_by(self) -> str:
        return "no workers, random pixels made once"  # it decodes nothing: num_workers starts no process

    def _shut(self) -> None:
        """close(): no process or thread to stop; the batches it made on the device are let go."""
        self._images = {}

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        images = self._made(self.recipe.side(self.train, epoch))
        for idx in self.sampler.batches(epoch, start_batch):
            index = torch.tensor(idx, dtype=torch.int64)
            keys = torch.stack([torch.full_like(index, epoch), index], 1)  # the device stage augments from these
            # labels stay on the host: the device stage sends them in its one non-blocking pack per batch (indexing
            # device labels with a host index would be a blocking copy every step)
            yield Batch(images[: len(idx)], self._labels[index], "NCHW", keys=keys)


SPEC = BackendSpec(
    "synthetic",
    "random uint8 batches made on the device, no I/O: the compute ceiling",
    ("cpu", "cuda"),
    lambda: None,
    SyntheticLoader,
)
