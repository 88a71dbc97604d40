"""The per-sample driver: what the decode workers and the device stage call on each sample after its crop (the
recipe's :class:`~.policies.Policy`, then the user's ``transforms=``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

from ..errors import TransformError
from ..plumbing.host_pack import HostPack
from .ctaugment import CTWeights
from .policies import Policy, Step

TransformsMode = Literal["image", "batch"]


class BatchJob(NamedTuple):
    """What :meth:`SampleAugment.prepare` planned for a batch: its (epoch, index) pairs and the policy's steps."""

    pairs: np.ndarray  # (N, 2) int64
    steps: list[Step] | None


def as_transform(transforms) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``transforms=`` as one callable: a list or tuple becomes a v2 ``Compose``; a callable is used as it is."""
    if transforms is None:
        return None
    if callable(transforms):
        return transforms
    if not isinstance(transforms, (list, tuple)) or not all(callable(t) for t in transforms):
        raise ValueError(f"transforms must be a callable, a list or tuple of them or a Compose; got {transforms!r:.80}")
    from torchvision.transforms import v2

    return v2.Compose(list(transforms))


class SampleAugment:
    """What runs on each sample after its crop, on uint8: the recipe's policy (train loaders), then the user's
    ``transforms``. Per image (the default) the user's transforms run with torch's CPU generator seeded from the
    sample key, so their draws are per image and reproducible; ``transforms_mode="batch"`` calls them once per
    device batch (one draw for the whole batch, cheaper)."""

    def __init__(self, policy: Policy | None, seed: int, transforms=None, transforms_mode: TransformsMode = "image"):
        if transforms_mode not in ("image", "batch"):
            raise ValueError(f"transforms_mode must be 'image' or 'batch', got {transforms_mode!r}")
        self.policy = policy if policy is not None and policy.active else None
        self.seed = seed
        self.transforms = as_transform(transforms)
        self.per_image = self.transforms if transforms_mode == "image" else None
        self.batch_transforms = self.transforms if transforms_mode == "batch" else None

    @property
    def active(self) -> bool:
        return self.policy is not None or self.transforms is not None

    def one(self, image: torch.Tensor, epoch: int, index: int, weights: CTWeights | None = None) -> torch.Tensor:
        """One (3,H,W) uint8 image: the policy and the per-image transforms (the decode workers' call); ``weights``:
        CTAugment's snapshot for the sample's batch."""
        if self.policy is not None:
            columns = self.policy.plan(self.seed, [epoch], [index], weights, image.shape[-1])  # the epoch's side
            image = self.policy.apply_plan(image[None], columns)[0]
        if self.per_image is not None:
            image = self._user(image, epoch, index)
        return image

    def batch(self, images: torch.Tensor, keys: torch.Tensor | None, weights: CTWeights | None = None) -> torch.Tensor:
        """A (N,3,H,W) uint8 device batch: with ``keys`` ((N,2) (epoch, index) pairs on the CPU), the per-sample part,
        batched (``weights``: CTAugment's snapshot for the batch); then the batch-wise transforms. (The device stage
        calls :meth:`prepare` and :meth:`run` instead, to send the arguments with the labels in one copy.)"""
        pack = HostPack()
        job = self.prepare(keys, pack, weights, images.shape[-2:])
        pack.send(images.device)
        return self.run(images, job, pack)

    def prepare(
        self,
        keys: torch.Tensor | None,
        pack: HostPack,
        weights: CTWeights | None = None,
        hw: Sequence[int] | None = None,
    ) -> BatchJob | None:
        """Draw the ops of the samples ``keys`` names (CTAugment's from ``weights``, the batch's snapshot) for
        (H, W) images ``hw`` (default: the recipe's size) and queue their arguments in ``pack``; None: nothing per
        sample to do."""
        if keys is None or (self.policy is None and self.per_image is None):
            return None
        pairs = keys.numpy()
        steps = None
        if self.policy is not None:
            size = None if hw is None else int(hw[-1])  # square: the epoch's side (a resolution schedule's)
            steps = self.policy.prepare(self.policy.plan(self.seed, pairs[:, 0], pairs[:, 1], weights, size), pack, hw)
        return BatchJob(pairs, steps)

    def run(self, images: torch.Tensor, job: BatchJob | None, pack: HostPack | None) -> torch.Tensor:
        """The per-sample part :meth:`prepare` planned (``pack`` sent to the images' device), then the batch-wise
        transforms."""
        if job is not None:
            if job.steps is not None and self.policy is not None and pack is not None:
                images = self.policy.run(images, job.steps, pack)
            if self.per_image is not None:
                pairs = job.pairs.tolist()
                images = torch.stack([self._user(img, e, i) for img, (e, i) in zip(images, pairs, strict=True)])
        if self.batch_transforms is not None:
            try:
                out = self.batch_transforms(images)
            except Exception as e:
                raise _transform_error("a batch", self.batch_transforms, e) from e
            images = _checked(out, images, "a batch", self.batch_transforms)
        return images

    def to_device(self, device: torch.device) -> None:
        """The policy's constants on ``device``, made now rather than in the first batch."""
        if self.policy is not None:
            self.policy.context.to_device(device)

    def _user(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: CUDA's is the training's
            torch.default_generator.manual_seed(_hash_key(self.seed, epoch, index))
            assert self.per_image is not None  # called only when there are per-image transforms
            where = f"sample {index} (epoch {epoch})"
            try:
                out = self.per_image(image)
            except Exception as e:
                raise _transform_error(where, self.per_image, e) from e
        return _checked(out, image, where, self.per_image)


def _checked(out: object, given: torch.Tensor, where: str, transform: Callable) -> torch.Tensor:
    """The user's transform's output, when it is what the loader goes on with: a uint8 tensor of the input's shape
    (the loader converts and normalises, and stacks the images into batches of the recipe's size); a
    :class:`TransformError` naming what it returned and the fix otherwise, on every backend alike."""
    if not isinstance(out, torch.Tensor):
        why = f"returned {type(out).__name__}, not a uint8 tensor"
    elif out.dtype != torch.uint8:
        why = (
            f"returned {out.dtype} images, not uint8: the loader converts to float32 and normalises itself "
            "(normalize=True), so leave ToDtype and Normalize out of transforms="
        )
    elif out.shape != given.shape:
        why = (
            f"returned shape {tuple(out.shape)} for {tuple(given.shape)}: transforms must keep the shape (set the "
            "size with image_size= or the recipe)"
        )
    else:
        return out
    raise TransformError(where, _name(transform), why)


def _transform_error(where: str, transform: Callable, e: Exception) -> TransformError:
    """``e`` from the user's ``transform`` as a :class:`TransformError` naming the member of a ``Compose`` that
    raised (found in the traceback), else the transform."""
    members = [t for t in getattr(transform, "transforms", []) if t is not None]
    culprit: object = transform
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if any(owner is m for m in members):
            culprit = owner
        tb = tb.tb_next
    return TransformError(where, _name(culprit), f"{type(e).__name__}: {e}")


def _name(transform: object) -> str:
    name = repr(transform)
    return name if len(name) <= 80 else type(transform).__name__


def _hash_key(seed: int, epoch: int, index: int) -> int:
    return random.Random(f"{seed}/{epoch}/{index}/transforms").getrandbits(63)
