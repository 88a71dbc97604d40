"""The augmentation recipe: backend-neutral, one home for its defaults and its geometry.

Every backend asks this module where to crop and what size to resize to, so the backends differ only in
how they decode and interpolate, never in which pixels they keep (the parity tests hold them to that).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from .augment.parse import EraseMode, check_erasing, parse_auto_augment, parse_color_jitter

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Box:
    """A crop in source pixels, then resized to ``size`` x ``size``; ``flip`` mirrors it horizontally."""

    top: float
    left: float
    height: float
    width: float
    flip: bool = False

    def scaled(self, sy: float, sx: float) -> Box:
        return Box(self.top * sy, self.left * sx, self.height * sy, self.width * sx, self.flip)


@dataclass(frozen=True)
class Recipe:
    """train: RandomResizedCrop(size, scale, ratio) + horizontal flip; eval: resize shorter side to
    ``round(size / crop_pct)`` + centre crop. Normalisation (mean/std) happens on the device.

    Train-time policies after the crop, per image, with timm's names and meanings (all off by default; see
    :mod:`gpupipe.augment`): ``auto_augment`` (``"rand-m9-mstd0.5-inc1"``, ``"original"``, ``"trivialaugment"``,
    ``"ctaugment-d0.99-t0.8-n2"`` with its feedback, see :mod:`gpupipe.augment.ctaugment`),
    ``color_jitter`` (0.4: brightness = contrast = saturation = 0.4), random erasing (``re_prob``, ``re_mode``
    ``"pixel"``/``"rand"``/``"const"``, up to ``re_count`` boxes)."""

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    crop_pct: float = 0.875
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    auto_augment: str | None = None
    color_jitter: float | tuple[float, ...] | None = None
    re_prob: float = 0.0
    re_mode: EraseMode = "pixel"
    re_count: int = 1

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")
        if not 0 < self.crop_pct <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        # the augmentation settings, checked now rather than in a decode worker
        parse_auto_augment(self.auto_augment)
        parse_color_jitter(self.color_jitter)
        check_erasing(self.re_prob, self.re_mode, self.re_count)

    @property
    def resize_size(self) -> int:
        return round(self.size / self.crop_pct)

    def train_box(self, height: int, width: int, rng: random.Random) -> Box:
        """torchvision ``RandomResizedCrop.get_params`` exactly, plus the flip coin, drawn from ``rng``."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = rng.randint(0, height - h)
                left = rng.randint(0, width - w)
                return Box(top, left, h, w, rng.random() < self.flip_p)
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, round(width / min(self.ratio))
        elif in_ratio > max(self.ratio):
            h, w = height, round(height * max(self.ratio))
        else:
            w, h = width, height
        return Box((height - h) // 2, (width - w) // 2, h, w, rng.random() < self.flip_p)

    def plan(self, train: bool, seed: int, epoch: int, index: int) -> Callable[[int, int], Box]:
        """``(height, width) -> Box`` for one sample: its train crop in this epoch (drawn from its own stream, see
        :func:`sample_rng`), or the eval crop. Decoders call it once they know the upright size."""
        if not train:
            return self.eval_box
        rng = sample_rng(seed, epoch, index)
        return lambda height, width: self.train_box(height, width, rng)

    def eval_resize(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) that torchvision ``Resize(resize_size)`` gives: shorter side exact, longer truncated."""
        short, long_ = (height, width) if height <= width else (width, height)
        new_short, new_long = self.resize_size, int(self.resize_size * long_ / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)

    def eval_offsets(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(resized_h, resized_w, top, left) of torchvision ``Resize`` + ``CenterCrop(size)``."""
        rh, rw = self.eval_resize(height, width)
        # CenterCrop pads images smaller than the crop; resize_size >= size makes that impossible here.
        top = round((rh - self.size) / 2.0)
        left = round((rw - self.size) / 2.0)
        return rh, rw, top, left

    def eval_box(self, height: int, width: int) -> Box:
        """The eval crop expressed in source pixels, so one resize (with a box) does resize + crop."""
        rh, rw, top, left = self.eval_offsets(height, width)
        sy, sx = height / rh, width / rw
        return Box(top * sy, left * sx, self.size * sy, self.size * sx, False)


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The random stream of one sample in one epoch: independent of worker, rank and batch, so a resumed
    or re-sharded run draws the same crops."""
    return random.Random(f"{seed}/{epoch}/{index}")


def dct_scale(box: Box, size: int) -> int:
    """The largest JPEG DCT reduction (1, 2, 4 or 8) that keeps the crop at least ``size`` on both sides."""
    shorter = min(box.height, box.width)
    for denom in (8, 4, 2):
        if shorter / denom >= size:
            return denom
    return 1
