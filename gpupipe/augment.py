"""Per-image augmentation after the crop: RandAugment, AutoAugment, TrivialAugment, colour jitter, random erasing.

Three steps, so every backend and device gives the same pixels for the same sample:

1. :meth:`Policy.draw` turns a sample key ``(seed, epoch, index)`` into a small record, the ops to apply with their
   arguments, drawn from the sample's own stream ``random.Random(f"{seed}/{epoch}/{index}/aug")`` (a second stream:
   the crop's stream, :func:`gpupipe.recipe.sample_rng`, is untouched, so the plain recipe keeps its pixels).
2. :meth:`Policy.apply` applies the records of a (N,3,H,W) uint8 batch on its device, image by image in meaning but
   batched in work: images are grouped by (position in their record, op), one call per group, each image with its
   own arguments. The decode workers call it with N=1, the GPU device stage with the whole batch; the kernels are
   elementwise or exact per image, so both give the same pixels.
3. :class:`SampleAugment` adds the user's ``transforms=`` (per image by default, or batch-wise) and is what the
   loader and the device stage hold.

Semantics: the strings mean what timm's ``rand_augment_transform`` / ``auto_augment_transform`` make of them (the
same op lists, level functions, ``m``, ``n``, ``p``, ``mstd``, ``mmax``, ``inc``; ``fill`` = the recipe mean, as
timm's ``create_transform``), ``"trivialaugment"`` is torchvision's ``TrivialAugmentWide`` (31 bins, fill 0,
nearest), ``color_jitter`` is torchvision's ``ColorJitter`` as timm builds it (one float: brightness = contrast =
saturation). The pixel maths are torchvision v2's tensor kernels (``autocontrast``, ``equalize``, ``invert`` are
called as they are; the blends take one factor per image), not PIL's: geometric ops sample bilinearly (timm picks
bilinear or bicubic at random), contrast blends with the mean of the uint8 grayscale.

Random erasing runs here, on uint8 before normalisation (timm erases normalised floats): ``const`` fills with the
recipe mean (0 after normalisation, as timm), ``rand``/``pixel`` with normal noise of the normalised space, i.e.
``mean + std * N(0, 1)`` per channel on the 0-255 scale, clamped to [0, 255] and rounded. The noise is a hash of
(sample, channel, row, column) looked up in a normal quantile table, so it is the same on any device and batch.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
from torchvision.transforms.v2 import functional as F

_LEVEL_DENOM = 10.0
_RAND_TRANSFORMS = (
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
_RAND_INCREASING_TRANSFORMS = (
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
# AutoAugment's ImageNet policy (Cubuk et al. 2018, as timm's 'original'): 25 sub-policies of (op, prob, magnitude)
_AA_ORIGINAL = (
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
# torchvision TrivialAugmentWide: op -> (magnitude of bin i out of 31, signed)
_TA_BINS = 31
_TA_OPS: dict[str, tuple[Callable[[int], float], bool]] = {
    "Identity": (lambda i: 0.0, False),
    "ShearX": (lambda i: 0.99 * i / 30, True),
    "ShearY": (lambda i: 0.99 * i / 30, True),
    "TranslateX": (lambda i: 32.0 * i / 30, True),
    "TranslateY": (lambda i: 32.0 * i / 30, True),
    "Rotate": (lambda i: 135.0 * i / 30, True),
    "Brightness": (lambda i: 0.99 * i / 30, True),
    "Color": (lambda i: 0.99 * i / 30, True),
    "Contrast": (lambda i: 0.99 * i / 30, True),
    "Sharpness": (lambda i: 0.99 * i / 30, True),
    "Posterize": (lambda i: float(8 - round(i / 5)), False),
    "Solarize": (lambda i: 255.0 * (30 - i) / 30, False),
    "AutoContrast": (lambda i: 0.0, False),
    "Equalize": (lambda i: 0.0, False),
}


class Op(NamedTuple):
    """One op of one image's record: timm's op name and the arguments its level function gives."""

    name: str
    args: tuple[float, ...] = ()


Record = tuple[Op, ...]


def _negate(v: float, rng: random.Random) -> float:
    return -v if rng.random() > 0.5 else v


# timm's LEVEL_TO_ARG, grouped by form: no argument; a signed value up to a maximum at level 10 (TranslateX/Y's
# maximum is the image's translate_const); an enhancement factor; a bit count or a threshold.
_NO_ARGS = ("AutoContrast", "Equalize", "Invert")
_SIGNED_MAX = {"Rotate": 30.0, "ShearX": 0.3, "ShearY": 0.3, "TranslateXRel": 0.45, "TranslateYRel": 0.45}
_ENHANCE = ("Color", "Contrast", "Brightness", "Sharpness")


def _level_args(name: str, level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    """timm's ``LEVEL_TO_ARG`` for ``name`` at ``level`` (0..10), the sign coin drawn from ``rng``."""
    base = name.removesuffix("Increasing").removesuffix("Original")
    increasing = name.endswith("Increasing")
    frac = level / _LEVEL_DENOM
    if base in _NO_ARGS:
        return ()
    if base in ("TranslateX", "TranslateY"):
        return (_negate(frac * translate_const, rng),)
    if base in _SIGNED_MAX:
        return (_negate(frac * _SIGNED_MAX[base], rng),)
    if base in _ENHANCE:
        if increasing:
            return (max(0.1, 1.0 + _negate(frac * 0.9, rng)),)
        return (frac * 1.8 + 0.1,)
    return (_bits_or_threshold(name, base, frac, increasing),)


def _bits_or_threshold(name: str, base: str, frac: float, increasing: bool) -> float:
    """Posterize's bits, Solarize's and SolarizeAdd's thresholds (no sign coin)."""
    if base == "Posterize":
        bits = int(frac * 4)
        return float(4 - bits if increasing else bits + 4 if name.endswith("Original") else bits)
    if base == "Solarize":
        thresh = min(256, int(frac * 256))
        return float(256 - thresh if increasing else thresh)
    if base == "SolarizeAdd":
        return float(min(128, int(frac * 110)))
    raise ValueError(f"unknown op {name!r}")


class _Magnitude(NamedTuple):
    std: float = 0.0  # 0: fixed, inf: uniform in [0, m]
    max: float | None = None

    def draw(self, m: float, rng: random.Random) -> float:
        if self.std == math.inf:
            m = rng.uniform(0, m)
        elif self.std > 0:
            m = rng.gauss(m, self.std)
        return max(0.0, min(m, self.max or _LEVEL_DENOM))


def _split_config(config: str) -> tuple[str, dict[str, str]]:
    head, *sections = config.split("-")
    out = {}
    for s in sections:
        parts = re.split(r"(\d.*)", s)
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return head, out


class Policy:
    """The recipe's random ops after the crop, compiled once: :meth:`draw` a record per sample, :meth:`apply` it."""

    def __init__(self, recipe):
        self.size = recipe.size
        self.mean255 = tuple(m * 255 for m in recipe.mean)
        self.std255 = tuple(s * 255 for s in recipe.std)
        self.fill = tuple(float(min(255, round(m))) for m in self.mean255)  # timm's img_mean
        self.interpolation = "bilinear"  # timm picks bilinear or bicubic at random; grid_sample has both
        self._aa: Callable[[random.Random], list[Op]] | None = None
        aa = recipe.auto_augment
        if aa is not None:
            aa = aa.lower()
            if aa.split("-")[0] == "rand":
                self._aa = self._rand_augment(aa)
            elif aa in ("trivialaugment", "trivialaugmentwide", "ta_wide"):
                self._aa = self._trivial_augment
                self.fill, self.interpolation = (0.0, 0.0, 0.0), "nearest"  # torchvision's defaults
            elif aa.split("-")[0] in ("original", "originalr"):
                self._aa = self._auto_augment(aa)
            else:
                raise ValueError(
                    f"auto_augment must be 'rand-...' (timm's RandAugment string), 'original', "
                    f"'originalr' or 'trivialaugment', got {recipe.auto_augment!r}"
                )
        cj = recipe.color_jitter
        self.jitter: tuple[float, float, float, float] | None = None
        if cj is not None:
            cj = (float(cj),) * 3 if isinstance(cj, (int, float)) else tuple(float(c) for c in cj)
            if len(cj) not in (3, 4) or min(cj) < 0:
                raise ValueError(f"color_jitter must be a float or 3 or 4 non-negative floats, got {cj}")
            self.jitter = (*cj, 0.0)[:4] if len(cj) == 3 else cj
        if not 0 <= recipe.re_prob <= 1:
            raise ValueError(f"re_prob must be in [0, 1], got {recipe.re_prob}")
        if recipe.re_mode not in ("const", "rand", "pixel"):
            raise ValueError(f"re_mode must be 'const', 'rand' or 'pixel', got {recipe.re_mode!r}")
        if recipe.re_count < 1:
            raise ValueError(f"re_count must be >= 1, got {recipe.re_count}")
        self.re_prob, self.re_mode, self.re_count = recipe.re_prob, recipe.re_mode, recipe.re_count
        self._tables: dict[torch.device, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self._aa is not None or self.jitter is not None or self.re_prob > 0

    # ---- drawing: a record per sample, from its own stream -------------------------------------------------------
    def draw(self, seed: int, epoch: int, index: int) -> Record:
        rng = random.Random(f"{seed}/{epoch}/{index}/aug")
        ops: list[Op] = []
        if self._aa is not None:
            ops += self._aa(rng)
        if self.jitter is not None:
            ops += self._color_jitter(rng)
        if self.re_prob > 0:
            ops += self._erase(rng)
        return tuple(ops)

    def _rand_augment(self, config: str) -> Callable[[random.Random], list[Op]]:
        _, kv = _split_config(config)
        unknown = set(kv) - {"m", "n", "p", "mstd", "mmax", "inc"}
        if unknown:
            raise ValueError(
                f"unsupported RandAugment section(s) {sorted(unknown)} in {config!r}; "
                "supported: m, n, p, mstd, mmax, inc"
            )
        self._m, self._n, self._p = int(kv.get("m", 10)), int(kv.get("n", 2)), float(kv.get("p", 0.5))
        mstd = float(kv.get("mstd", 0))
        self._mag = _Magnitude(math.inf if mstd > 100 else mstd, int(kv["mmax"]) if "mmax" in kv else None)
        self._names = _RAND_INCREASING_TRANSFORMS if bool(int(kv.get("inc", 0))) else _RAND_TRANSFORMS
        return self._draw_rand  # a bound method, not a closure: the policy pickles into spawned workers

    def _draw_rand(self, rng: random.Random) -> list[Op]:
        names, ops = self._names, []
        for name in [names[rng.randrange(len(names))] for _ in range(self._n)]:  # with replacement, as timm
            if self._p < 1.0 and rng.random() > self._p:
                continue
            ops.append(Op(name, _level_args(name, self._mag.draw(self._m, rng), rng, int(self.size * 0.45))))
        return ops

    def _auto_augment(self, config: str) -> Callable[[random.Random], list[Op]]:
        head, kv = _split_config(config)
        if set(kv) - {"mstd"}:
            raise ValueError(f"unsupported AutoAugment section(s) in {config!r}; supported: mstd")
        self._mag = _Magnitude(float(kv.get("mstd", 0)))
        self._table = (
            _AA_ORIGINAL
            if head == "original"
            else tuple(
                tuple((n.replace("PosterizeOriginal", "PosterizeIncreasing"), p, m) for n, p, m in sub)
                for sub in _AA_ORIGINAL
            )
        )
        return self._draw_auto

    def _draw_auto(self, rng: random.Random) -> list[Op]:
        ops = []
        for name, prob, m in self._table[rng.randrange(len(self._table))]:
            if prob < 1.0 and rng.random() > prob:
                continue
            ops.append(Op(name, _level_args(name, self._mag.draw(m, rng), rng, int(self.size * 0.45))))
        return ops

    @staticmethod
    def _trivial_augment(rng: random.Random) -> list[Op]:
        name = list(_TA_OPS)[rng.randrange(len(_TA_OPS))]
        level, signed = _TA_OPS[name]
        magnitude = level(rng.randrange(_TA_BINS))
        if signed and rng.randrange(2):
            magnitude = -magnitude
        if name == "Identity":
            return []
        if name in ("AutoContrast", "Equalize"):
            return [Op(name)]
        if name in ("Brightness", "Color", "Contrast", "Sharpness"):
            return [Op(name, (1.0 + magnitude,))]
        if name in ("TranslateX", "TranslateY"):
            return [Op(name, (float(int(magnitude)),))]
        return [Op(name, (magnitude,))]

    def _color_jitter(self, rng: random.Random) -> list[Op]:
        """torchvision ``ColorJitter``: the four adjustments in a random order, each factor drawn uniformly."""
        assert self.jitter is not None  # drawn only when jitter is on
        b, c, s, h = self.jitter
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

    def _erase(self, rng: random.Random) -> list[Op]:
        """timm ``RandomErasing._erase`` (area 0.02-1/3 split over the count, log aspect 0.3-3.3, 10 attempts)."""
        if rng.random() > self.re_prob:
            return []
        size, ops = self.size, []
        count = 1 if self.re_count == 1 else rng.randint(1, self.re_count)
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

    # ---- applying: batched over images, each with its own arguments ------------------------------------------------
    def apply(self, images: torch.Tensor, records: Sequence[Record]) -> torch.Tensor:
        """(N,3,H,W) uint8 on any device, one record per image -> augmented uint8 (a new tensor)."""
        images = images.clone()
        for k in range(max((len(r) for r in records), default=0)):
            groups: dict[str, list[int]] = {}
            for i, r in enumerate(records):
                if k < len(r):
                    groups.setdefault(r[k].name, []).append(i)
            for name, rows in groups.items():
                args = torch.tensor([records[i][k].args for i in rows], dtype=torch.float64).reshape(len(rows), -1)
                if len(rows) == len(images):
                    images = self._kernel(name)(images, args)
                else:
                    sel = torch.tensor(rows, device=images.device)
                    images[sel] = self._kernel(name)(images[sel], args)
        return images

    def _kernel(self, name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        base = name.removesuffix("Increasing").removesuffix("Original")
        if base in _AFFINE:
            return lambda x, a: _affine(x, _AFFINE[base](a, x.shape[-2], x.shape[-1]), self.fill, self.interpolation)
        if base == "Erase":
            return self._apply_erase
        return _KERNELS[base]

    def _apply_erase(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Only the rows and columns the group's boxes span are computed: on CUDA for the whole group at once, on the
        CPU box by box (the values depend on absolute positions only, so both agree)."""
        if not x.is_cuda and len(x) > 1:
            for i in range(len(x)):
                x[i : i + 1] = self._apply_erase(x[i : i + 1], a[i : i + 1])
            return x
        dev = x.device
        top, left, h, w = (a[:, i].long() for i in range(4))
        y0, y1 = int(top.min()), int((top + h).max())
        x0, x1 = int(left.min()), int((left + w).max())
        rows = torch.arange(y0, y1, device=dev).view(1, 1, -1, 1)
        cols = torch.arange(x0, x1, device=dev).view(1, 1, 1, -1)
        t, l_, b, r = ((v.to(dev).view(-1, 1, 1, 1)) for v in (top, left, top + h, left + w))
        inside = (rows >= t) & (rows < b) & (cols >= l_) & (cols < r)
        chan = torch.arange(3, device=dev).view(1, 3, 1, 1)
        if self.re_mode == "const":
            fill = torch.tensor([round(m) for m in self.mean255], dtype=torch.uint8, device=dev).view(1, 3, 1, 1)
        else:
            seed = _hash32(a[:, 4].long().to(dev)).view(-1, 1, 1, 1)
            pos = chan if self.re_mode == "rand" else (chan * x.shape[-2] + rows) * x.shape[-1] + cols
            fill = self._noise_table(dev).view(-1)[chan * 65536 + (_hash32(pos ^ seed) & 0xFFFF)]
        region = x[:, :, y0:y1, x0:x1]
        x[:, :, y0:y1, x0:x1] = torch.where(inside, fill, region)
        return x

    def _noise_table(self, device: torch.device) -> torch.Tensor:
        """(3, 65536) uint8: ``mean + std * z`` at 65,536 evenly spaced normal quantiles, per channel."""
        if device not in self._tables:
            z = torch.special.ndtri((torch.arange(65536, dtype=torch.float64) + 0.5) / 65536)
            mean, std = torch.tensor(self.mean255).view(3, 1), torch.tensor(self.std255).view(3, 1)
            self._tables[device] = (mean + std * z).round().clamp(0, 255).to(torch.uint8).to(device)
        return self._tables[device]


_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) on int64 tensors; multipliers < 2**31 keep products in int64."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _blend(x: torch.Tensor, other: torch.Tensor | float, factor: torch.Tensor) -> torch.Tensor:
    """torchvision v2 ``_blend`` with one factor per image."""
    f = factor[:, :1].to(device=x.device, dtype=torch.float32).view(-1, 1, 1, 1)
    out = x.float().mul(f)
    out = out.add_(other * (1.0 - f)) if isinstance(other, torch.Tensor) else out
    return out.clamp_(0, 255).to(torch.uint8)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return F.rgb_to_grayscale(x).float()  # v2's uint8 grayscale: floored


def _sharp_degenerate(x: torch.Tensor) -> torch.Tensor:
    """v2 ``adjust_sharpness``'s smoothed image (3x3 kernel, 5 in the centre, /13, borders kept), in exact integers."""
    xi = x.to(torch.int16)  # at most 13 * 255 * 2 + 13: no overflow
    s = xi[..., 1:-1, 1:-1] * 4
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            s = s + xi[..., dy : dy + x.shape[-2] - 2, dx : dx + x.shape[-1] - 2]
    out = xi.clone()
    out[..., 1:-1, 1:-1] = torch.div(2 * s + 13, 26, rounding_mode="floor")  # round(s / 13): no ties with 13
    return out.float()


def _per_image_u8(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.to(device=x.device, dtype=torch.uint8).view(-1, 1, 1, 1)


def _solarize(x: torch.Tensor, thresh: torch.Tensor) -> torch.Tensor:
    """Invert pixels >= thresh (0..256; 256: none), comparing in uint8 rather than promoting the image."""
    invert = (x >= _per_image_u8(thresh.clamp(max=255), x)) & (thresh <= 255).to(x.device).view(-1, 1, 1, 1)
    return torch.where(invert, 255 - x, x)


def _per_image(fn: Callable[[torch.Tensor, float], torch.Tensor]):
    return lambda x, a: torch.stack([fn(img, float(v)) for img, v in zip(x, a[:, 0].tolist(), strict=True)])


_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "AutoContrast": lambda x, a: F.autocontrast(x),
    "Equalize": lambda x, a: F.equalize(x),
    "Invert": lambda x, a: F.invert(x),
    "Posterize": lambda x, a: x & ((0xFF << (8 - a[:, 0].long())) & 0xFF).to(x.device, torch.uint8).view(-1, 1, 1, 1),
    "Solarize": lambda x, a: _solarize(x, a[:, 0]),
    # x < 128 and add <= 128: the uint8 sum cannot wrap where it is kept
    "SolarizeAdd": lambda x, a: torch.where(x < 128, x + _per_image_u8(a[:, 0], x), x),
    "Brightness": lambda x, a: _blend(x, 0.0, a),
    "Color": lambda x, a: _blend(x, _gray(x), a),
    "Contrast": lambda x, a: _blend(x, _gray(x).mean(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64).float(), a),
    "Sharpness": lambda x, a: _blend(x, _sharp_degenerate(x), a),
    "Hue": _per_image(F.adjust_hue),  # timm's jitter never sets hue; the rare user who does pays a loop
}


def _rotate(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    """PIL ``Image.rotate`` about the centre: (a, b, c, d, e, f) maps output (x, y) to input (ax+by+c, dx+ey+f)."""
    out: list[tuple[float, ...]] = []
    for deg in a[:, 0].tolist():
        r = -math.radians(deg)
        cos, sin = math.cos(r), math.sin(r)
        cx, cy = w / 2, h / 2
        out.append((cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy))
    return out


_AFFINE: dict[str, Callable[[torch.Tensor, int, int], list[tuple[float, ...]]]] = {
    "Rotate": _rotate,
    "ShearX": lambda a, h, w: [(1, v, 0, 0, 1, 0) for v in a[:, 0].tolist()],
    "ShearY": lambda a, h, w: [(1, 0, 0, v, 1, 0) for v in a[:, 0].tolist()],
    "TranslateX": lambda a, h, w: [(1, 0, v, 0, 1, 0) for v in a[:, 0].tolist()],
    "TranslateY": lambda a, h, w: [(1, 0, 0, 0, 1, v) for v in a[:, 0].tolist()],
    "TranslateXRel": lambda a, h, w: [(1, 0, v * w, 0, 1, 0) for v in a[:, 0].tolist()],
    "TranslateYRel": lambda a, h, w: [(1, 0, 0, 0, 1, v * h) for v in a[:, 0].tolist()],
}


def _affine(x: torch.Tensor, mats: list[tuple[float, ...]], fill: tuple[float, ...], mode: str) -> torch.Tensor:
    """One affine warp per image (PIL's inverse-map convention), ``grid_sample`` as v2's ``affine`` does, with the
    grid built by elementwise ops (no matmul), so one image and a batch get the same coordinates."""
    n, _, h, w = x.shape
    m = torch.tensor(mats, dtype=torch.float32, device=x.device).view(n, 6, 1, 1)
    ys = (torch.arange(h, device=x.device, dtype=torch.float32) + 0.5).view(1, h, 1)
    xs = (torch.arange(w, device=x.device, dtype=torch.float32) + 0.5).view(1, 1, w)
    gx = (m[:, 0] * xs + m[:, 1] * ys + m[:, 2]) * (2.0 / w) - 1.0
    gy = (m[:, 3] * xs + m[:, 4] * ys + m[:, 5]) * (2.0 / h) - 1.0
    grid = torch.stack([gx, gy], dim=-1)
    # sampling (image - fill) with zero padding, then adding fill back, blends the fill in where the source runs out
    # (v2's extra mask channel, without the fourth channel)
    fill_t = torch.tensor(fill, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    out = torch.nn.functional.grid_sample(
        x.float() - fill_t, grid, mode=mode, padding_mode="zeros", align_corners=False
    )
    return out.add_(fill_t).round_().clamp_(0, 255).to(torch.uint8)


TransformsMode = Literal["image", "batch"]


def as_transform(transforms) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``transforms=`` as one callable: a list or tuple becomes a v2 ``Compose``; a callable is used as it is."""
    if transforms is None:
        return None
    if callable(transforms):
        return transforms
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

    def one(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        """One (3,H,W) uint8 image: the policy and the per-image transforms (the decode workers' call)."""
        if self.policy is not None:
            image = self.policy.apply(image[None], [self.policy.draw(self.seed, epoch, index)])[0]
        if self.per_image is not None:
            image = self._user(image, epoch, index)
        return image

    def batch(self, images: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        """A (N,3,H,W) uint8 device batch: with ``keys`` ((N,2) (epoch, index) pairs), the per-sample part, batched;
        then the batch-wise transforms."""
        if keys is not None and (self.policy is not None or self.per_image is not None):
            pairs = keys.tolist()
            if self.policy is not None:
                images = self.policy.apply(images, [self.policy.draw(self.seed, e, i) for e, i in pairs])
            if self.per_image is not None:
                images = torch.stack([self._user(img, e, i) for img, (e, i) in zip(images, pairs, strict=True)])
        if self.batch_transforms is not None:
            images = self.batch_transforms(images)
        return images

    def _user(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: CUDA's is the training's
            torch.default_generator.manual_seed(_hash_key(self.seed, epoch, index))
            assert self.per_image is not None  # called only when there are per-image transforms
            return self.per_image(image)


def _hash_key(seed: int, epoch: int, index: int) -> int:
    return random.Random(f"{seed}/{epoch}/{index}/transforms").getrandbits(63)
