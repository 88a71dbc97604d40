"""One class per policy (RandAugment, AutoAugment, TrivialAugment, colour jitter, random erasing): RandAugment and
erasing draw a whole batch at once from the samples' counter-based keys, the others one image at a time from the
sample's own stream; and :class:`Policy`, the recipe's policies together: a batch's ops as columns
(:meth:`Policy.plan`; one sample's record: :meth:`Policy.draw`), applied batched (:meth:`Policy.apply_plan`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from ..draws import STREAM_AUTO_AUGMENT, STREAM_ERASING, sample_keys, uniforms
from ..plumbing.host_pack import HostPack
from . import fused
from .adaptive import Adaptive
from .ctaugment import CTAdaptive, CTAugment, CTWeights
from .fused import Step
from .kernels import KernelContext
from .ops import LEVEL_DENOM, Op, Record, level_args, level_table, level_values
from .parse import (
    AutoAugmentConfig,
    AutoAugmentSetting,
    CTAugmentConfig,
    RandAugmentConfig,
    check_erasing,
    parse_auto_augment,
    parse_color_jitter,
)
from .plan import Column, from_records, normals, records

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


class RecordDrawer(Protocol):
    """A drawer that draws one sample's ops at a time from the sample's ``random.Random``."""

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

    def draw_many(self, m: float, u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
        """:meth:`draw` for an array of samples from two uniforms each (the normal by Box-Muller)."""
        if self.std == math.inf:
            v = u1 * m
        elif self.std > 0:
            v = m + self.std * normals(u1, u2)
        else:
            v = np.full(u1.shape, float(m))
        return np.clip(v, 0.0, self.max or LEVEL_DENOM)


class RandAugment:
    """timm's ``rand_augment_transform``: ``n`` ops drawn with replacement, each kept with probability ``p``."""

    def __init__(self, config: RandAugmentConfig, size: int):
        self.m, self.n, self.p = config.m, config.n, config.p
        self.magnitude = Magnitude(math.inf if config.mstd > 100 else config.mstd, config.mmax)
        self.names = RAND_INCREASING_TRANSFORMS if config.increasing else RAND_TRANSFORMS
        self.translate_const = int(size * 0.45)
        self.table = level_table(self.names, self.translate_const)
        self.arity = tuple(int(a) for a in self.table[:, 7])
        self._tables = {size: self.table}  # per image side: the translations scale with it

    def columns(self, keys: np.ndarray, size: int | None = None) -> list[Column]:
        """The batch's ``n`` op positions: op (with replacement, as timm), kept with probability ``p``, magnitude
        and sign coin, five uniforms per position from each sample's own stream; ``size``: the images' side, when not
        the one it was made for (an epoch of a resolution schedule)."""
        if size is not None and size not in self._tables:
            self._tables[size] = level_table(self.names, int(size * 0.45))
        table = self.table if size is None else self._tables[size]
        u = uniforms(keys, STREAM_AUTO_AUGMENT, 5 * self.n).reshape(len(keys), self.n, 5)
        choice = np.minimum((u[..., 0] * len(self.names)).astype(np.int64), len(self.names) - 1)
        kept = u[..., 1] <= self.p if self.p < 1.0 else np.ones(choice.shape, bool)
        level = self.magnitude.draw_many(self.m, u[..., 2], u[..., 3])
        args = level_values(table[choice], level, u[..., 4] > 0.5)
        code = np.where(kept, choice, -1)
        return [Column(self.names, self.arity, code[:, k], args[:, k, None]) for k in range(self.n)]


class AutoAugment:
    """timm's ``auto_augment_transform`` with the ImageNet policy: one sub-policy per image."""

    def __init__(self, config: AutoAugmentConfig, size: int):
        self.magnitude = Magnitude(config.mstd)
        self.table = AA_ORIGINAL if config.variant == "original" else AA_ORIGINALR
        self.translate_const = int(size * 0.45)

    def draw(self, rng: random.Random, size: int | None = None) -> list[Op]:
        ops = []
        translate = self.translate_const if size is None else int(size * 0.45)
        for name, prob, m in self.table[rng.randrange(len(self.table))]:
            if prob < 1.0 and rng.random() > prob:
                continue
            ops.append(Op(name, level_args(name, self.magnitude.draw(m, rng), rng, translate)))
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

    def columns(self, keys: np.ndarray, size: int | None = None) -> list[Column]:
        """``count`` positions of boxes (top, left, h, w, noise seed) in images of side ``size`` (default: the one it
        was made for); -1 where a sample erases nothing there (not drawn, fewer boxes, or no attempt fitted)."""
        n, size, count = len(keys), size or self.size, self.count
        u = uniforms(keys, STREAM_ERASING, 2 + count * 23)
        on = u[:, 0] <= self.prob
        boxes = np.ones(n, np.int64) if count == 1 else 1 + np.minimum((u[:, 1] * count).astype(np.int64), count - 1)
        columns, everyone = [], np.arange(n)
        for j in range(count):
            b = u[:, 2 + 23 * j : 2 + 23 * (j + 1)]
            target = (0.02 + (1 / 3 - 0.02) * b[:, :10]) * (size * size) / boxes[:, None]
            aspect = np.exp(_LOG_LOW + (_LOG_HIGH - _LOG_LOW) * b[:, 10:20])
            h, w = np.rint(np.sqrt(target * aspect)), np.rint(np.sqrt(target / aspect))
            fits = (w < size) & (h < size)
            first = fits.argmax(1)
            h, w = h[everyone, first], w[everyone, first]
            top, left = np.floor(b[:, 20] * (size - h + 1)), np.floor(b[:, 21] * (size - w + 1))
            args = np.stack([top, left, h, w, np.floor(b[:, 22] * 2**31)], 1)
            code = np.where(on & (j < boxes) & fits.any(1), 0, -1)
            columns.append(Column(("Erase",), (5,), code, args))
        return columns


_LOG_LOW, _LOG_HIGH = math.log(0.3), math.log(1 / 0.3)


Drawer = RecordDrawer | RandAugment | RandomErasing  # the latter two: a whole batch at once (``columns``)


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
        self.size: int = recipe.train_size(0)  # the first epoch's; ``plan`` takes another epoch's side
        setting = parse_auto_augment(recipe.auto_augment)
        jitter = parse_color_jitter(recipe.color_jitter)
        erase_mode = check_erasing(recipe.re_prob, recipe.re_mode, recipe.re_count)
        self.auto_augment = _auto_augment(setting, self.size)
        self.jitter = ColorJitter(jitter) if jitter is not None else None
        self.erasing = RandomErasing(recipe.re_prob, recipe.re_count, self.size) if recipe.re_prob > 0 else None
        self.drawers: tuple[Drawer, ...] = tuple(
            d for d in (self.auto_augment, self.jitter, self.erasing) if d is not None
        )
        # CTAugment: the weights it draws from, updated by its feedback (None for the other policies); as an adaptive
        # policy, what loaders take of it (gpupipe.augment.adaptive)
        self.ctaugment = self.auto_augment if isinstance(self.auto_augment, CTAugment) else None
        self.adaptive: Adaptive | None = CTAdaptive(self.ctaugment) if self.ctaugment is not None else None
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

    def plan(
        self, seed: int, epochs, indices, weights: CTWeights | None = None, size: int | None = None
    ) -> list[Column]:
        """The ops of the samples ``(seed, epochs[i], indices[i])`` as columns. RandAugment and erasing draw the
        whole batch at once from each sample's counter-based streams; the other drawers from the sample's own
        ``random.Random(f"{seed}/{epoch}/{index}/aug")`` (``weights``: CTAugment's snapshot the batch draws
        from). ``size``: the images' side, when not the first epoch's (translations, erasing and cutout boxes scale
        with it)."""
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        columns: list[Column] = []
        rngs: list[random.Random] | None = None
        keys: np.ndarray | None = None
        for drawer in self.drawers:
            if isinstance(drawer, (RandAugment, RandomErasing)):
                keys = sample_keys(seed, epochs, indices) if keys is None else keys
                columns += drawer.columns(keys, size)
                continue
            if rngs is None:
                rngs = [
                    random.Random(f"{seed}/{e}/{i}/aug") for e, i in zip(epochs.tolist(), indices.tolist(), strict=True)
                ]
            if isinstance(drawer, CTAugment):
                columns += from_records([tuple(drawer.draw(rng, weights, size)) for rng in rngs])
            elif isinstance(drawer, AutoAugment):
                columns += from_records([tuple(drawer.draw(rng, size)) for rng in rngs])
            else:
                columns += from_records([tuple(drawer.draw(rng)) for rng in rngs])
        return columns

    def draw(self, seed: int, epoch: int, index: int, weights: CTWeights | None = None) -> Record:
        """The record of sample ``(seed, epoch, index)``: its ops in order, as :meth:`plan` draws them."""
        return records(self.plan(seed, [epoch], [index], weights), 1)[0]

    def apply(self, images: torch.Tensor, recs: Sequence[Record]) -> torch.Tensor:
        """(N,3,H,W) uint8 on any device, one record per image -> augmented uint8 (a new tensor)."""
        return self.apply_plan(images, from_records(recs))

    def apply_plan(self, images: torch.Tensor, columns: Sequence[Column]) -> torch.Tensor:
        """:meth:`apply` for the batch's columns (:meth:`plan`)."""
        pack = HostPack()
        steps = self.prepare(columns, pack, images.shape[-2:])
        pack.send(images.device)
        return self.run(images, steps, pack)

    def prepare(self, columns: Sequence[Column], pack: HostPack, hw: Sequence[int] | None = None) -> list[Step]:
        """The batch's kernel calls on (H, W) images ``hw`` (default: the recipe's size), their parameters queued in
        ``pack`` (sent with the batch's one copy): per position, one call per family of ops (:mod:`.fused`), over the
        images that draw one."""
        h, w = hw if hw is not None else (self.size, self.size)
        return fused.prepare(columns, pack, (int(h), int(w)))

    def run(self, images: torch.Tensor, steps: Sequence[Step], pack: HostPack) -> torch.Tensor:
        """The steps of :meth:`prepare` on ``images``, once ``pack`` was sent to their device: no copy, no sync."""
        return fused.run(images, steps, pack, self.context)
