"""The augmentation recipe: backend-neutral, one home for its defaults and its geometry.

Every backend asks this module where to crop and what size to resize to, so the backends differ only in
how they decode and interpolate, never in which pixels they keep (the parity tests hold them to that).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeGuard, cast

import numpy as np

from ._options import CROP_MODES, PADDING_MODES, CropMode, PaddingMode
from .augment.parse import EraseMode, check_erasing, parse_auto_augment, parse_color_jitter
from .draws import STREAM_CROP, sample_keys, uniforms

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Box:
    """A crop in source pixels, then resized to ``size`` x ``size``; ``flip`` mirrors it horizontally. A box may reach
    past the image's edges (the ``"pad"`` crop): the pixels there are zeros, or the image reflected about its edge
    (``fill``, torchvision's ``padding_mode`` ``"constant"`` and ``"reflect"``)."""

    top: float
    left: float
    height: float
    width: float
    flip: bool = False
    fill: PaddingMode = "zero"

    def scaled(self, sy: float, sx: float) -> Box:
        return Box(self.top * sy, self.left * sx, self.height * sy, self.width * sx, self.flip, self.fill)


class DefaultSize(int):
    """224, the side of a recipe built without one: it then takes ``build_loader``'s ``image_size`` when that is
    given (equal to 224 in every other respect: comparisons, hashing, checkpoints)."""

    def __repr__(self) -> str:
        return int.__repr__(self)


DEFAULT_SIZE = DefaultSize(224)


@dataclass(frozen=True)
class ResolutionSchedule:
    """A train image side that changes with the epoch (progressive resizing, FFCV's ``get_resolution``): ``start``
    up to epoch ``start_epoch``, ``end`` from epoch ``end_epoch`` on, linear in between, rounded down to a multiple
    of ``step`` and kept within ``start``..``end``, so the two ends are used exactly whatever the step. Epochs count
    from 0, as ``loader.set_epoch`` does. A plain per-epoch list in ``Recipe(size=[...])`` is the other way to say
    it (its last size for the epochs after it)."""

    start: int
    end: int
    start_epoch: int = 0
    end_epoch: int = 0
    step: int = 32

    def __post_init__(self):
        if min(self.start, self.end) < 1:
            raise ValueError(f"ResolutionSchedule sizes must be >= 1, got start={self.start}, end={self.end}")
        if self.step < 1:
            raise ValueError(f"ResolutionSchedule step must be >= 1, got {self.step}")
        if not 0 <= self.start_epoch <= self.end_epoch:
            raise ValueError(
                f"ResolutionSchedule needs 0 <= start_epoch <= end_epoch, got {self.start_epoch}, {self.end_epoch}"
            )

    def at(self, epoch: int) -> int:
        """The side in ``epoch``."""
        if epoch <= self.start_epoch:
            return self.start
        if epoch >= self.end_epoch:
            return self.end
        linear = self.start + (self.end - self.start) * (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        lo, hi = sorted((self.start, self.end))
        return min(hi, max(lo, int(linear // self.step) * self.step))


Size = int | ResolutionSchedule | tuple[int, ...]


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def size_at(size: Size, epoch: int) -> int:
    """The train side of ``size`` (a side, a :class:`ResolutionSchedule` or a per-epoch tuple) in ``epoch``."""
    if isinstance(size, ResolutionSchedule):
        return size.at(epoch)
    if isinstance(size, tuple):
        return size[min(epoch, len(size) - 1)]
    return size


def is_whole(value: object) -> TypeGuard[numbers.Integral]:
    """A whole number: an int or numpy's integer, not a bool (``True`` is no size), ``"224"`` or ``224.0``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _side(name: str, value: object) -> int:
    """An image side as an int (numpy's integers too); ``"224"``, ``224.0`` or ``True`` is one line naming it."""
    if is_whole(value):
        return value if isinstance(value, DefaultSize) else int(value)
    raise ValueError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")


def _size(size: object) -> Size:
    """``Recipe(size=)``: a side, a :class:`ResolutionSchedule`, or a per-epoch list of sides (as a tuple)."""
    if isinstance(size, ResolutionSchedule):
        return size
    if isinstance(size, (Sequence, np.ndarray)) and not isinstance(size, (str, bytes)):
        sides = tuple(_side("size", s) for s in size)
        if not sides:
            raise ValueError("a per-epoch size list needs at least one size")
        return sides
    if is_whole(size):
        return _side("size", size)
    raise ValueError(
        f"size must be a whole number, a ResolutionSchedule or a per-epoch list of whole numbers, got {size!r} "
        f"({type(size).__name__})"
    )


def _channel_stats(name: str, values: object) -> tuple[float, float, float]:
    """``mean`` or ``std``: three numbers, R, G, B, on the 0-1 scale of pixels (ImageNet's mean is (0.485, 0.456,
    0.406)); a standard deviation above 0."""
    try:
        stats = tuple(float(v) for v in values)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        stats = ()
    mean = name == "mean"
    if len(stats) != 3 or not all(math.isfinite(v) and (0 <= v <= 1 if mean else v > 0) for v in stats):
        bounds = "in [0, 1]" if mean else "above 0"
        raise ValueError(f"{name} must be three numbers (R, G, B) {bounds}, on pixels scaled to 0-1; got {values!r}")
    return stats[0], stats[1], stats[2]


@dataclass(frozen=True)
class Recipe:
    """train: RandomResizedCrop(size, scale, ratio) + horizontal flip; eval: resize shorter side to
    ``round(size / crop_pct)`` + centre crop. Normalisation (mean/std) happens on the device.

    Train-time policies after the crop, per image, with timm's names and meanings (all off by default; see
    :mod:`gpupipe.augment`): ``auto_augment`` (``"rand-m9-mstd0.5-inc1"``, ``"original"``, ``"trivialaugment"``,
    ``"ctaugment-d0.99-t0.8-n2"`` with its feedback, see :mod:`gpupipe.augment.ctaugment`),
    ``color_jitter`` (0.4: brightness = contrast = saturation = 0.4), random erasing (``re_prob``, ``re_mode``
    ``"pixel"``/``"rand"``/``"const"``, up to ``re_count`` boxes).

    ``crop`` picks the train crop: ``"random-resized"`` (the above), ``"pad"`` (torchvision's ``RandomCrop(size,
    padding)``: a ``size`` x ``size`` window at a uniform offset in the image padded by ``padding`` pixels on each side,
    zeros or the image reflected, ``padding_mode``; CIFAR's recipe) or ``"resize"`` (the whole image resized to
    ``size`` x ``size``: ``Resize(size)`` of a square image). Both flip as the first does; their eval crop is the whole
    image resized to the eval side, no centre crop.

    ``size`` may change with the epoch: a :class:`ResolutionSchedule` or a per-epoch list (progressive resizing);
    a loader then delivers epoch ``e``'s batches at ``train_size(e)`` without rebuilding anything, each crop box the
    same as at any other size. Eval loaders use ``eval_size``; its default is ``size``, or a schedule's last size
    (FixRes: evaluating above the train size after RandomResizedCrop often pays; set it, e.g. ``224`` after ``192``).
    """

    size: int | ResolutionSchedule | Sequence[int] = DEFAULT_SIZE  # not given: build_loader's image_size, else 224
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
    eval_size: int | None = None
    crop: CropMode = "random-resized"
    padding: int = 4
    padding_mode: PaddingMode = "zero"

    def __post_init__(self):
        object.__setattr__(self, "size", _size(self.size))  # a per-epoch list: kept as a tuple (hashable)
        if (min(self.size) if isinstance(self.size, tuple) else self.train_size(0)) < 1:
            raise ValueError(f"image_size must be >= 1, got {self.size}")
        if self.eval_size is not None:
            object.__setattr__(self, "eval_size", _side("eval_size", self.eval_size))
            if self.eval_size < 1:
                raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")
        if not 0 <= self.flip_p <= 1:
            raise ValueError(f"flip_p must be in [0, 1], got {self.flip_p}")
        for name in ("mean", "std"):
            object.__setattr__(self, name, _channel_stats(name, getattr(self, name)))
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")
        if not 0 < self.crop_pct <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        self._check_crop()
        # the augmentation settings, checked now rather than in a decode worker
        parse_auto_augment(self.auto_augment)
        parse_color_jitter(self.color_jitter)
        check_erasing(self.re_prob, self.re_mode, self.re_count)

    @property
    def policies(self) -> list[str]:
        """The train-time policies it sets, by setting name (an eval loader applies none of them)."""
        on = {"auto_augment": self.auto_augment, "color_jitter": self.color_jitter, "re_prob": self.re_prob > 0}
        return [name for name, value in on.items() if value not in (None, False)]

    def for_eval(self) -> Recipe:
        """The recipe without its train-time policies: what an eval loader applies of it."""
        return dataclasses.replace(self, auto_augment=None, color_jitter=None, re_prob=0.0)

    def _check_crop(self) -> None:
        if self.crop not in CROP_MODES:
            raise ValueError(f"crop must be one of {', '.join(CROP_MODES)}, got {self.crop!r}")
        if self.padding < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(PADDING_MODES)}, got {self.padding_mode!r}")

    def train_size(self, epoch: int) -> int:
        """The side of epoch ``epoch``'s train images."""
        return size_at(cast(Size, self.size), epoch)

    @property
    def eval_side(self) -> int:
        """The side of eval images: ``eval_size``, else ``size`` (a schedule's or list's last size)."""
        if self.eval_size is not None:
            return self.eval_size
        if isinstance(self.size, ResolutionSchedule):
            return self.size.end
        return self.size[-1] if isinstance(self.size, tuple) else cast(int, self.size)

    def side(self, train: bool, epoch: int) -> int:
        """The side a loader delivers in ``epoch``: the train size of that epoch, or the eval side."""
        return self.train_size(epoch) if train else self.eval_side

    @property
    def resize_size(self) -> int:
        return round(self.eval_side / self.crop_pct)

    def check_fits(self, batch_size: int, train: bool, memory: int | None = None) -> None:
        """A batch at the largest side this recipe makes (a schedule's, a list's, the eval side) must fit the
        machine's memory (``memory`` bytes; default: physical memory) as uint8 pixels and their float32 copy: refused
        up front, with what it would need, rather than asked of a worker's shared memory."""
        size = self.size
        if not train:
            side, what = self.eval_side, "eval_size (--eval-size)" if self.eval_size else "image_size (--image-size)"
        elif isinstance(size, ResolutionSchedule):
            side, what = max(size.start, size.end), "the resolution schedule's side (--res-start, --res-end)"
        else:
            side, what = max(size) if isinstance(size, tuple) else cast(int, size), "image_size (--image-size)"
        memory = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        need = batch_size * side * side * 3 * (1 + 4)
        if need > memory:
            raise ValueError(
                f"{what} {side}: a batch of {batch_size} images at {side}x{side} needs {_gib(need)} of memory (uint8 "
                f"pixels and their float32 copy), more than this machine's {_gib(memory)}; take a smaller side or "
                "batch size"
            )

    def train_draws(self, seed: int, epoch: int | Sequence[int], indices) -> np.ndarray:
        """(n, DRAWS) float64: what the train crops of samples ``indices`` in ``epoch`` are made from, for the whole
        batch at once (``epoch``: one for all, or one per sample). Each sample's uniforms come from a counter-based
        generator keyed by ``(seed, epoch, index)`` (:func:`key_uniforms`), so a sample draws the same whatever
        batch, worker, rank or backend asks. Per attempt (``ATTEMPTS``, RandomResizedCrop's 10): the area fraction,
        the aspect ratio, and the uniforms of the top and left offsets; then the flip's uniform."""
        u = key_uniforms(seed, epoch, indices, DRAWS)
        u[:, 0 : 4 * ATTEMPTS : 4] = self._areas(np.ascontiguousarray(u[:, 0 : 4 * ATTEMPTS : 4]))
        u[:, 1 : 4 * ATTEMPTS : 4] = self._aspects(np.ascontiguousarray(u[:, 1 : 4 * ATTEMPTS : 4]))
        return u

    def _areas(self, u: np.ndarray) -> np.ndarray:
        """The area fractions drawn from uniforms (contiguous, so that every path takes the same SIMD loop)."""
        lo, hi = self.scale
        return lo + (hi - lo) * u

    def _aspects(self, u: np.ndarray) -> np.ndarray:
        """The aspect ratios drawn from uniforms, log-uniform (contiguous: see :meth:`_areas`)."""
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        return np.exp(log_lo + (log_hi - log_lo) * u)

    def train_box(self, height: int, width: int, drawn: list[float], side: int | None = None) -> Box:
        """torchvision ``RandomResizedCrop.get_params``' algorithm, plus the flip coin, from one row of
        :meth:`train_draws` (as a list). :meth:`train_boxes` is the same for a batch, to the bit. The ``"pad"`` and
        ``"resize"`` crops take the first attempt's top and left uniforms and the flip's (:meth:`fixed_boxes`);
        ``side``: the output side (default: epoch 0's)."""
        if self.crop != "random-resized":
            offsets, flips = np.array([drawn[2:4]]), np.array([drawn[-1]])
            row = self.fixed_boxes(np.array([height]), np.array([width]), offsets, flips, side or self.train_size(0))[0]
            return Box(row[0], row[1], row[2], row[3], bool(row[4]), self.padding_mode)
        area = height * width
        for k in range(0, 4 * ATTEMPTS, 4):
            target_area = area * drawn[k]
            w = round(math.sqrt(target_area * drawn[k + 1]))
            h = round(math.sqrt(target_area / drawn[k + 1]))
            if 0 < w <= width and 0 < h <= height:
                top, left = math.floor(drawn[k + 2] * (height - h + 1)), math.floor(drawn[k + 3] * (width - w + 1))
                return Box(top, left, h, w, drawn[-1] < self.flip_p)
        h, w = self._fallback_size(height, width)
        return Box((height - h) // 2, (width - w) // 2, h, w, drawn[-1] < self.flip_p)

    def fixed_boxes(self, heights, widths, offsets: np.ndarray, flips: np.ndarray, side: int) -> np.ndarray:
        """(n, 5) float64 ``top, left, height, width, flip`` of the ``"pad"`` or ``"resize"`` crop, from each sample's
        top and left uniforms (``offsets``, (n, 2)) and its flip's (``flips``, (n,)). ``"pad"``: torchvision
        ``RandomCrop(side, padding)``'s offset in the padded image, ``floor(u * (padded - side + 1))``, less the
        padding (so a box may start above or left of the image); ``"resize"``: the whole image."""
        height, width = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
        out = np.empty((len(height), 5), np.float64)
        if self.crop == "resize":
            out[:, 0], out[:, 1], out[:, 2], out[:, 3] = 0, 0, height, width
        else:
            self._check_pad(height, width, side)
            pad = self.padding
            out[:, 0] = np.floor(offsets[:, 0] * (height + 2 * pad - side + 1)) - pad
            out[:, 1] = np.floor(offsets[:, 1] * (width + 2 * pad - side + 1)) - pad
            out[:, 2] = out[:, 3] = side
        out[:, 4] = flips < self.flip_p
        return out

    def _check_pad(self, height: np.ndarray, width: np.ndarray, side: int) -> None:
        """The ``"pad"`` crop needs each image, padded, at least ``side`` on both sides, and reflect padding less than
        each side (torchvision's ``RandomCrop`` refuses both)."""
        small = np.minimum(height, width)
        if len(small) and small.min() + 2 * self.padding < side:
            raise ValueError(
                f"a {int(small.min())}-pixel side padded by {self.padding} is smaller than the crop {side}; take a "
                "larger padding or a smaller image_size"
            )
        if self.padding_mode == "reflect" and len(small) and small.min() <= self.padding:
            raise ValueError(f"reflect padding {self.padding} needs image sides above it, got {int(small.min())}")

    def _fallback_size(self, height: int, width: int) -> tuple[int, int]:
        """RandomResizedCrop's centre crop when no attempt fits: the whole image, clamped to the ratio range."""
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            return round(width / min(self.ratio)), width
        if in_ratio > max(self.ratio):
            return height, round(height * max(self.ratio))
        return height, width

    def train_boxes(self, heights: np.ndarray, widths: np.ndarray, drawn: np.ndarray) -> np.ndarray:
        """(n, 5) float64 ``top, left, height, width, flip``: :meth:`train_box` for a batch in a few array ops."""
        height, width = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
        out = np.empty((len(drawn), 5), np.float64)
        fits = self._fit(height, width, drawn[:, : 4 * ATTEMPTS])
        out[fits.found] = fits.boxes
        self._fall_back(out, np.flatnonzero(~fits.found), height, width)
        out[:, 4] = drawn[:, -1] < self.flip_p
        return out

    def _drawn_boxes(self, keys: np.ndarray, heights, widths) -> np.ndarray:
        """:meth:`train_boxes` of :meth:`train_draws`, to the bit, with fewer draws: the first ``_FIRST`` attempts for
        every sample (nearly all fit by then), the others only for the samples none of those fitted."""
        height, width = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
        out = np.empty((len(keys), 5), np.float64)
        todo = np.arange(len(keys))
        for first, count in ((0, _FIRST), (_FIRST, ATTEMPTS - _FIRST)):
            u = uniforms(keys[todo], STREAM_CROP, 4 * count, skip=4 * first)
            u[:, 0::4] = self._areas(np.ascontiguousarray(u[:, 0::4]))
            u[:, 1::4] = self._aspects(np.ascontiguousarray(u[:, 1::4]))
            fits = self._fit(height[todo], width[todo], u)
            out[todo[fits.found]] = fits.boxes
            todo = todo[~fits.found]
            if not len(todo):
                break
        self._fall_back(out, todo, height, width)
        out[:, 4] = uniforms(keys, STREAM_CROP, 1, skip=DRAWS - 1)[:, 0] < self.flip_p
        return out

    @staticmethod
    def _fit(height: np.ndarray, width: np.ndarray, attempts: np.ndarray) -> _Fits:
        """Each sample's first attempt that fits, from its (n, 4k) attempts (area fraction, aspect ratio, the top's
        and the left's uniforms, per attempt), as RandomResizedCrop tries them."""
        target_area = (height * width)[:, None] * attempts[:, 0::4]
        aspect = attempts[:, 1::4]
        w, h = np.round(np.sqrt(target_area * aspect)), np.round(np.sqrt(target_area / aspect))
        fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
        found = fits.any(1)
        rows, at = np.flatnonzero(found), fits.argmax(1)[found]
        h, w, height, width = h[rows, at], w[rows, at], height[rows], width[rows]
        boxes = np.empty((len(rows), 5), np.float64)
        boxes[:, 0] = np.floor(attempts[rows, 4 * at + 2] * (height - h + 1))
        boxes[:, 1] = np.floor(attempts[rows, 4 * at + 3] * (width - w + 1))
        boxes[:, 2], boxes[:, 3] = h, w
        return _Fits(found, boxes)

    def _fall_back(self, out: np.ndarray, rows: np.ndarray, height: np.ndarray, width: np.ndarray) -> None:
        """RandomResizedCrop's centre crop for the ``rows`` no attempt fitted (rare: one by one)."""
        for i, hh, ww in zip(rows.tolist(), height[rows].tolist(), width[rows].tolist(), strict=True):
            h, w = self._fallback_size(hh, ww)
            out[i, :4] = (hh - h) // 2, (ww - w) // 2, h, w

    def plan(self, train: bool, seed: int, epoch: int, index: int) -> Callable[[int, int], Box]:
        """``(height, width) -> Box`` for one sample: its train crop in this epoch (:meth:`train_draws`), or the
        eval crop. Decoders call it once they know the upright size."""
        return self.plans(train, seed, [(epoch, index)])[0]

    def plans(self, train: bool, seed: int, keys) -> list[Callable[[int, int], Box]]:
        """:meth:`plan` for each ``(epoch, index, ...)`` key of a batch, the draws made for the whole batch at once
        (a worker's batch; the boxes are the same as one sample at a time)."""
        if not train:
            return [self.eval_box] * len(keys)
        drawn = self.train_draws(seed, [key[0] for key in keys], [key[1] for key in keys]).tolist()
        sides = [self.train_size(key[0]) for key in keys]
        return [functools.partial(self.train_box, drawn=d, side=s) for d, s in zip(drawn, sides, strict=True)]

    def plan_boxes(self, train: bool, seed: int, epoch: int, indices, heights, widths) -> np.ndarray:
        """(n, 5) float64 ``top, left, height, width, flip``: :meth:`plan` for a whole batch of upright sizes."""
        if train and self.crop != "random-resized":
            keys = sample_keys(seed, epoch, indices)
            offsets, flips = uniforms(keys, STREAM_CROP, 2, skip=2), uniforms(keys, STREAM_CROP, 1, skip=DRAWS - 1)
            return self.fixed_boxes(heights, widths, offsets, flips[:, 0], self.train_size(epoch))
        if train:
            return self._drawn_boxes(sample_keys(seed, epoch, indices), heights, widths)
        sizes = zip(np.asarray(heights).tolist(), np.asarray(widths).tolist(), strict=True)
        boxes = [self.eval_box(h, w) for h, w in sizes]
        return np.array([(b.top, b.left, b.height, b.width, b.flip) for b in boxes], np.float64).reshape(-1, 5)

    def flips(self, train: bool, seed: int, epoch: int, indices) -> np.ndarray:
        """(n,) bool: the flip column of :meth:`plan_boxes` alone, for a batch whose geometry needs no draw (a set
        held resized whole): nothing drawn when no sample can be mirrored (eval, ``flip_p=0``)."""
        if not train or self.flip_p <= 0:
            return np.zeros(len(indices), bool)
        return uniforms(sample_keys(seed, epoch, indices), STREAM_CROP, 1, skip=DRAWS - 1)[:, 0] < self.flip_p

    def eval_resize(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) that torchvision ``Resize(resize_size)`` gives: shorter side exact, longer truncated
        (the ``"pad"`` and ``"resize"`` crops: the eval side, square)."""
        if self.crop != "random-resized":
            return self.eval_side, self.eval_side
        short, long_ = (height, width) if height <= width else (width, height)
        new_short, new_long = self.resize_size, int(self.resize_size * long_ / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)

    def eval_offsets(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(resized_h, resized_w, top, left) of torchvision ``Resize`` + ``CenterCrop(size)``."""
        rh, rw = self.eval_resize(height, width)
        # CenterCrop pads images smaller than the crop; resize_size >= size makes that impossible here.
        top = round((rh - self.eval_side) / 2.0)
        left = round((rw - self.eval_side) / 2.0)
        return rh, rw, top, left

    def eval_box(self, height: int, width: int) -> Box:
        """The eval crop expressed in source pixels, so one resize (with a box) does resize + crop (the ``"pad"`` and
        ``"resize"`` crops: the whole image)."""
        if self.crop != "random-resized":
            return Box(0, 0, height, width)
        rh, rw, top, left = self.eval_offsets(height, width)
        sy, sx = height / rh, width / rw
        side = self.eval_side
        return Box(top * sy, left * sx, side * sy, side * sx, False)


ATTEMPTS = 10  # RandomResizedCrop's tries before its centre-crop fallback
_FIRST = 3  # attempts drawn for every sample of a batch; the rest only for the few that none of these fitted
DRAWS = 4 * ATTEMPTS + 1  # per try: area, aspect, top, left; then the flip


class _Fits(NamedTuple):
    found: np.ndarray  # bool (n,): an attempt fitted
    boxes: np.ndarray  # (found.sum(), 5): their boxes (the flip column left for the caller)


def key_uniforms(seed: int, epoch: int | Sequence[int], indices, count: int) -> np.ndarray:
    """(n, count) float64 uniforms in [0, 1) for the crop draws of the samples ``indices`` of ``epoch``
    (:mod:`gpupipe.draws`: any subset of samples, in any batch or order, gets the same numbers)."""
    return uniforms(sample_keys(seed, epoch, indices), STREAM_CROP, count)


def dct_scale(box: Box, size: int) -> int:
    """The largest JPEG DCT reduction (1, 2, 4 or 8) that keeps the crop at least ``size`` on both sides."""
    shorter = min(box.height, box.width)
    for denom in (8, 4, 2):
        if shorter / denom >= size:
            return denom
    return 1
