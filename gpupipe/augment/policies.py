"""One class per policy, each drawing the ops of one image from the sample's own stream (RandAugment, AutoAugment,
TrivialAugment, colour jitter, random erasing), and :class:`Policy`, the recipe's policies together: a record per
sample (:meth:`Policy.draw`), applied batched (:meth:`Policy.apply`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from ..data.upload import HostPack, Slot
from .ctaugment import CTAugment, CTWeights
from .kernels import KernelContext
from .ops import LEVEL_DENOM, OPS, Op, Record, level_args
from .parse import (
    AutoAugmentConfig,
    AutoAugmentSetting,
    CTAugmentConfig,
    RandAugmentConfig,
    check_erasing,
    parse_auto_augment,
    parse_color_jitter,
)

RAND_TRANSFORMS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
RAND_INCREASING_TRANSFORMS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
SubPolicy = tuple[tuple[str, float, int], ...]  # (op, probability, magnitude) pairs
# AutoAugment's ImageNet policy (Cubuk et al. 2018, as timm's 'original'): 25 sub-policies of (op, prob, magnitude)
AA_ORIGINAL: tuple[SubPolicy, ...] = (
    (("PosterizeOriginal", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
    (("PosterizeOriginal", 0.6, 7), ("PosterizeOriginal", 0.6, 6)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, 4), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, 7)),
    (("PosterizeOriginal", 0.8, 5), ("Equalize", 1.0, 2)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, 8), ("PosterizeOriginal", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, 2)),
    (("Equalize", 0.0, 7), ("Equalize", 0.8, 8)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, 8)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, 9)),
    (("Color", 0.4, 0), ("Equalize", 0.6, 3)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
)
# timm's 'originalr': the same with Posterize's increasing level
AA_ORIGINALR: tuple[SubPolicy, ...] = tuple(
    tuple(("PosterizeIncreasing" if n == "PosterizeOriginal" else n, p, m) for n, p, m in sub) for sub in AA_ORIGINAL
)


class Drawer(Protocol):
    def draw(self, rng: random.Random) -> list[Op]: ...


class Magnitude(NamedTuple):
    std: float = 0.0  # 0: fixed, inf: uniform in [0, m]
    max: float | None = None

    def draw(self, m: float, rng: random.Random) -> float:
        if self.std == math.inf:
            m = rng.uniform(0, m)
        elif self.std > 0:
            m = rng.gauss(m, self.std)
        return max(0.0, min(m, self.max or LEVEL_DENOM))


class RandAugment:
    """timm's ``rand_augment_transform``: ``n`` ops drawn with replacement, each kept with probability ``p``."""

    def __init__(self, config: RandAugmentConfig, size: int):
        self.m, self.n, self.p = config.m, config.n, config.p
        self.magnitude = Magnitude(math.inf if config.mstd > 100 else config.mstd, config.mmax)
        self.names = RAND_INCREASING_TRANSFORMS if config.increasing else RAND_TRANSFORMS
        self.translate_const = int(size * 0.45)

    def draw(self, rng: random.Random) -> list[Op]:
        names, ops = self.names, []
        for name in [names[rng.randrange(len(names))] for _ in range(self.n)]:  # with replacement, as timm
            if self.p < 1.0 and rng.random() > self.p:
                continue
            ops.append(Op(name, level_args(name, self.magnitude.draw(self.m, rng), rng, self.translate_const)))
        return ops


class AutoAugment:
    """timm's ``auto_augment_transform`` with the ImageNet policy: one sub-policy per image."""

    def __init__(self, config: AutoAugmentConfig, size: int):
        self.magnitude = Magnitude(config.mstd)
        self.table = AA_ORIGINAL if config.variant == "original" else AA_ORIGINALR
        self.translate_const = int(size * 0.45)

    def draw(self, rng: random.Random) -> list[Op]:
        ops = []
        for name, prob, m in self.table[rng.randrange(len(self.table))]:
            if prob < 1.0 and rng.random() > prob:
                continue
            ops.append(Op(name, level_args(name, self.magnitude.draw(m, rng), rng, self.translate_const)))
        return ops


def _as_is(m: float) -> tuple[float, ...]:
    return (m,)


def _factor(m: float) -> tuple[float, ...]:
    return (1.0 + m,)


def _whole_pixels(m: float) -> tuple[float, ...]:
    return (float(int(m)),)


def _none(m: float) -> tuple[float, ...]:
    return ()


class _Bins(NamedTuple):
    magnitude: Callable[[int], float]  # bin i of 31 -> magnitude
    signed: bool
    args: Callable[[float], tuple[float, ...]] | None  # magnitude -> the op's arguments; None: no op


class TrivialAugment:
    """torchvision's ``TrivialAugmentWide``: one op, one of 31 magnitude bins, fill 0, nearest."""

    BINS: ClassVar[int] = 31
    OPS: ClassVar[dict[str, _Bins]] = {
        "Identity": _Bins(lambda i: 0.0, False, None),
        "ShearX": _Bins(lambda i: 0.99 * i / 30, True, _as_is),
        "ShearY": _Bins(lambda i: 0.99 * i / 30, True, _as_is),
        "TranslateX": _Bins(lambda i: 32.0 * i / 30, True, _whole_pixels),
        "TranslateY": _Bins(lambda i: 32.0 * i / 30, True, _whole_pixels),
        "Rotate": _Bins(lambda i: 135.0 * i / 30, True, _as_is),
        "Brightness": _Bins(lambda i: 0.99 * i / 30, True, _factor),
        "Color": _Bins(lambda i: 0.99 * i / 30, True, _factor),
        "Contrast": _Bins(lambda i: 0.99 * i / 30, True, _factor),
        "Sharpness": _Bins(lambda i: 0.99 * i / 30, True, _factor),
        "Posterize": _Bins(lambda i: float(8 - round(i / 5)), False, _as_is),
        "Solarize": _Bins(lambda i: 255.0 * (30 - i) / 30, False, _as_is),
        "AutoContrast": _Bins(lambda i: 0.0, False, _none),
        "Equalize": _Bins(lambda i: 0.0, False, _none),
    }

    def draw(self, rng: random.Random) -> list[Op]:
        name = list(self.OPS)[rng.randrange(len(self.OPS))]
        bins = self.OPS[name]
        magnitude = bins.magnitude(rng.randrange(self.BINS))
        if bins.signed and rng.randrange(2):
            magnitude = -magnitude
        return [] if bins.args is None else [Op(name, bins.args(magnitude))]


class ColorJitter:
    """torchvision ``ColorJitter``: the four adjustments in a random order, each factor drawn uniformly."""

    def __init__(self, factors: tuple[float, float, float, float]):
        self.factors = factors  # brightness, contrast, saturation, hue

    def draw(self, rng: random.Random) -> list[Op]:
        b, c, s, h = self.factors
        order = [0, 1, 2, 3]
        rng.shuffle(order)
        ops = []
        for i in order:
            if i == 3 and h > 0:
                ops.append(Op("Hue", (rng.uniform(-h, h),)))
            elif i < 3 and (b, c, s)[i] > 0:
                f = (b, c, s)[i]
                ops.append(Op(("Brightness", "Contrast", "Color")[i], (rng.uniform(max(0.0, 1 - f), 1 + f),)))
        return ops


class RandomErasing:
    """timm ``RandomErasing._erase`` (area 0.02-1/3 split over the count, log aspect 0.3-3.3, 10 attempts)."""

    def __init__(self, prob: float, count: int, size: int):
        self.prob, self.count, self.size = prob, count, size

    def draw(self, rng: random.Random) -> list[Op]:
        if rng.random() > self.prob:
            return []
        size, ops = self.size, []
        count = 1 if self.count == 1 else rng.randint(1, self.count)
        for _ in range(count):
            for _attempt in range(10):
                target = rng.uniform(0.02, 1 / 3) * size * size / count
                aspect = math.exp(rng.uniform(math.log(0.3), math.log(1 / 0.3)))
                h, w = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
                if w < size and h < size:
                    top, left = rng.randint(0, size - h), rng.randint(0, size - w)
                    ops.append(Op("Erase", (top, left, h, w, rng.getrandbits(31))))
                    break
        return ops


def _auto_augment(setting: AutoAugmentSetting | None, size: int) -> Drawer | None:
    if isinstance(setting, RandAugmentConfig):
        return RandAugment(setting, size)
    if isinstance(setting, AutoAugmentConfig):
        return AutoAugment(setting, size)
    if isinstance(setting, CTAugmentConfig):
        return CTAugment.from_config(setting, size)
    return None if setting is None else TrivialAugment()


class Policy:
    """The recipe's random ops after the crop, compiled once: :meth:`draw` a record per sample, :meth:`apply` it.
    The recipe (a :class:`gpupipe.Recipe`) gives ``size``, ``mean``, ``std``, ``auto_augment``, ``color_jitter`` and
    ``re_prob``/``re_mode``/``re_count``."""

    def __init__(self, recipe):
        self.size: int = recipe.size
        setting = parse_auto_augment(recipe.auto_augment)
        jitter = parse_color_jitter(recipe.color_jitter)
        erase_mode = check_erasing(recipe.re_prob, recipe.re_mode, recipe.re_count)
        self.auto_augment = _auto_augment(setting, recipe.size)
        self.jitter = ColorJitter(jitter) if jitter is not None else None
        self.erasing = RandomErasing(recipe.re_prob, recipe.re_count, recipe.size) if recipe.re_prob > 0 else None
        self.drawers: tuple[Drawer, ...] = tuple(
            d for d in (self.auto_augment, self.jitter, self.erasing) if d is not None
        )
        # CTAugment: the weights it draws from, updated by its feedback (None for the other policies)
        self.ctaugment = self.auto_augment if isinstance(self.auto_augment, CTAugment) else None
        mean255 = tuple(m * 255 for m in recipe.mean)
        if isinstance(self.auto_augment, (TrivialAugment, CTAugment)):  # torchvision's defaults; FixMatch's PIL's
            fill: tuple[float, ...] = (0.0, 0.0, 0.0)
            interpolation = "nearest"
        else:  # timm's img_mean; timm picks bilinear or bicubic at random, grid_sample has both
            fill, interpolation = tuple(float(min(255, round(m))) for m in mean255), "bilinear"
        self.context = KernelContext(fill, interpolation, mean255, tuple(s * 255 for s in recipe.std), erase_mode)

    @property
    def active(self) -> bool:
        return bool(self.drawers)

    def draw(self, seed: int, epoch: int, index: int, weights: CTWeights | None = None) -> Record:
        """The record of sample ``(seed, epoch, index)``, from its own stream; ``weights``: the snapshot of
        CTAugment's rates the sample's batch draws from (default: the current ones)."""
        rng = random.Random(f"{seed}/{epoch}/{index}/aug")
        ops: list[Op] = []
        for drawer in self.drawers:
            ops += drawer.draw(rng, weights) if isinstance(drawer, CTAugment) else drawer.draw(rng)
        return tuple(ops)

    def apply(self, images: torch.Tensor, records: Sequence[Record]) -> torch.Tensor:
        """(N,3,H,W) uint8 on any device, one record per image -> augmented uint8 (a new tensor)."""
        pack = HostPack()
        steps = self.prepare(records, pack)
        pack.send(images.device)
        return self.run(images, steps, pack)

    def prepare(self, records: Sequence[Record], pack: HostPack) -> list[Step]:
        """The batch's kernel calls, their arguments queued in ``pack`` (sent with the batch's one copy). Images are
        grouped by (position in their record, op): one kernel call per group, each image with its own arguments."""
        steps = []
        for k in range(max((len(r) for r in records), default=0)):
            groups: dict[str, list[int]] = {}
            for i, r in enumerate(records):
                if k < len(r):
                    groups.setdefault(r[k].name, []).append(i)
            for name, rows in groups.items():
                width = len(records[rows[0]][k].args)
                args = pack.add(np.asarray([records[i][k].args for i in rows], np.float64).reshape(len(rows), width))
                whole = len(rows) == len(records)
                steps.append(Step(name, args, None if whole else pack.add(rows, torch.int64)))
        return steps

    def run(self, images: torch.Tensor, steps: Sequence[Step], pack: HostPack) -> torch.Tensor:
        """The steps of :meth:`prepare` on ``images``, once ``pack`` was sent to their device: no copy, no sync."""
        images = images.clone()
        for step in steps:
            kernel, args = OPS[step.name].kernel, pack.get(step.args)
            if step.rows is None:
                images = kernel(images, args, self.context)
            else:
                sel = pack.get(step.rows)
                images[sel] = kernel(images[sel], args, self.context)
        return images


class Step(NamedTuple):
    """One kernel call of a batch: the op, its (n, k) arguments and, when not every image takes it, which images."""

    name: str
    args: Slot
    rows: Slot | None
