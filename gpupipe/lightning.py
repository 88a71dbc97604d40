"""A LightningDataModule of gpupipe loaders: ``gpupipe.lightning.DataModule(train, val, backend=..., **options)``.

Imported only when used (``import gpupipe`` never imports Lightning). Nothing here is needed for Lightning to use a
gpupipe loader: any ``LightningDataModule`` whose ``train_dataloader()`` returns ``build_loader(...)`` works the same
way, because the loader speaks the protocol Lightning looks for. Lightning checkpoints ``state_dict()`` of the train
loader, loads it back with ``load_state_dict()`` on ``fit(ckpt_path=...)``, and calls ``loader.sampler.set_epoch(e)``;
the loader's :class:`~gpupipe.data.position.Position` gives the same answer whatever order those calls come in.
This module only fills in what is easy to get wrong: each rank's shard from the trainer (``rank``, ``world_size``),
batches delivered on the trainer's device, and a validation loader labelled with the training set's classes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning as L

from .api import build_loader
from .data.loader import Loader

Source = str | os.PathLike | Sequence[str | os.PathLike]


class DataModule(L.LightningDataModule):
    """Train (and optionally validation) loaders from ``build_loader``, one shard per rank of the trainer.

    ``options`` are ``build_loader``'s keyword arguments (``batch_size``, ``image_size``, ``num_workers``, ``seed``,
    ``recipe``...), shared by both loaders; ``device`` defaults to the trainer's device.
    """

    def __init__(self, train: Source, val: Source | None = None, backend: str = "pillow", **options: Any):
        super().__init__()
        for fixed in ("train", "rank", "world_size"):
            if fixed in options:
                raise ValueError(f"DataModule sets {fixed!r} itself (from the trainer); leave it out of the options")
        self.train_source, self.val_source, self.backend, self.options = train, val, backend, options
        self._classes: dict[str, int] | None = None

    def _loader(self, source: Source, train: bool, **extra: Any) -> Loader:
        trainer = self.trainer
        options = dict(self.options)
        if trainer is not None:
            options.setdefault("device", trainer.strategy.root_device)
            options.update(rank=trainer.global_rank, world_size=trainer.world_size)
        if not train and options.get("recipe") is not None:
            options["recipe"] = options["recipe"].for_eval()  # the shared recipe's policies are the train loader's
        return build_loader(source, self.backend, train=train, **options, **extra)

    def train_dataloader(self) -> Loader:
        loader = self._loader(self.train_source, train=True)
        self._classes = loader.dataset.class_to_idx
        return loader

    def val_dataloader(self) -> Loader | list:
        if self.val_source is None:
            return []  # Lightning's "no validation"
        if self._classes is None:  # validate() alone: the classes still come from the training set
            self._classes = self._loader(self.train_source, train=True).dataset.class_to_idx
        return self._loader(self.val_source, train=False, class_to_idx=self._classes)
