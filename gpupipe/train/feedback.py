"""``gpupipe train --aa ctaugment``: FixMatch's feedback loop. After every micro-batch the model (eval mode, no
gradient) scores one probe batch of the training data, augmented with uniformly drawn, recorded CTAugment ops, and
the train loader's weights move toward each probe image's score (FixMatch's ``1 - 0.5 * |softmax - onehot|_1``),
one micro-batch later: the scores stay on the GPU until the next step, by when their copy to the host has finished,
so the host never waits for the GPU (under DDP the ranks' records go in one collective of a fixed size, no wait for
their counts). The weights, the update still waiting and the snapshots the next batches draw from are in the train
loader's state, hence in checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..augment import CTAugment, proximity
from ..data.loader import Loader
from ..recipe import Recipe
from .precision import Precision


def probe_recipe(recipe: Recipe) -> Recipe:
    """The train recipe with its CTAugment string in probe form (the same decay, threshold and ops per image)."""
    aa = recipe.auto_augment or ""
    return dataclasses.replace(recipe, auto_augment=aa if aa.lower().endswith("-probe") else f"{aa}-probe")


class CTFeedback:
    """The probe loader over the training data (one probe batch per micro-batch, the same position as the train
    loader's, so a resumed run probes the same images) and the update of the train loader's weights."""

    def __init__(self, train_loader: Loader, make_probe: Callable[[Recipe], Loader]):
        ctaugment = train_loader.ctaugment
        if ctaugment is None:
            raise ValueError("CTFeedback needs a train loader whose recipe has auto_augment='ctaugment...'")
        self.ctaugment: CTAugment = ctaugment
        self.probe = make_probe(probe_recipe(train_loader.recipe))
        if len(self.probe) < len(train_loader):
            raise ValueError(f"the probe loader has {len(self.probe)} batches, fewer than the train loader's")
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def start_epoch(self, epoch: int, first: int) -> None:
        self.probe.load_state_dict({"epoch": epoch, "batch": first})
        self.probe.set_epoch(epoch)
        self._batches = iter(self.probe)

    def step(self, model: nn.Module, precision: Precision) -> None:
        """Score the next probe batch with ``model`` (the bare one: under DDP every rank scores its own probe batch,
        and ``update`` gathers all ranks' records) and update the weights."""
        assert self._batches is not None  # start_epoch comes first
        images, labels = next(self._batches)
        was_training = model.training
        model.eval()  # FixMatch scores probes with training=False: BatchNorm's running statistics
        with torch.no_grad(), precision.autocast():
            probs = model(images).float().softmax(1)
        model.train(was_training)
        # deferred: applied at the next step, when the scores have reached the host without the host waiting for them
        scores = proximity(probs, labels)
        self.ctaugment.update(self.probe.records, scores, defer=True, capacity=self.probe.batch_size)
