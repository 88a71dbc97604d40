"""The op table: every op a policy can draw, keyed by its name (timm's names, ``Hue`` for jitter, ``Erase`` for
random erasing, ``Ct*`` for CTAugment's own), with its batched kernel and, for the ops timm's policy strings name,
timm's level function (``LEVEL_TO_ARG``). A new op is one entry here (and a kernel in :mod:`.kernels`); a policy
then names it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from . import kernels as K

LEVEL_DENOM = 10.0  # timm's magnitude scale: levels 0..10


class Op(NamedTuple):
    """One op of one image's record: timm's op name and the arguments its level function gives."""

    name: str
    args: tuple[float, ...] = ()


Record = tuple[Op, ...]

# (level 0..10, the sample's stream for the sign coin, translate_const in pixels) -> the op's arguments
LevelFn = Callable[[float, random.Random, float], tuple[float, ...]]


def _negate(v: float, rng: random.Random) -> float:
    return -v if rng.random() > 0.5 else v


def _no_args(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return ()


def _signed(maximum: float) -> LevelFn:
    """A signed value, ``maximum`` at level 10 (the sign a coin)."""

    def level_fn(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
        return (_negate(level / LEVEL_DENOM * maximum, rng),)

    return level_fn


def _translate_abs(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (_negate(level / LEVEL_DENOM * translate_const, rng),)


def _enhance(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (level / LEVEL_DENOM * 1.8 + 0.1,)


def _enhance_increasing(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (max(0.1, 1.0 + _negate(level / LEVEL_DENOM * 0.9, rng)),)


def _posterize(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(int(level / LEVEL_DENOM * 4)),)


def _posterize_increasing(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(4 - int(level / LEVEL_DENOM * 4)),)


def _posterize_original(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(int(level / LEVEL_DENOM * 4) + 4),)


def _solarize(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(min(256, int(level / LEVEL_DENOM * 256))),)


def _solarize_increasing(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(256 - min(256, int(level / LEVEL_DENOM * 256))),)


def _solarize_add(level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    return (float(min(128, int(level / LEVEL_DENOM * 110))),)


class OpSpec(NamedTuple):
    kernel: K.Kernel
    level: LevelFn | None = None  # None: its arguments are drawn by its policy (TrivialAugment, jitter, erasing)


OPS: dict[str, OpSpec] = {
    "AutoContrast": OpSpec(K.autocontrast, _no_args),
    "Equalize": OpSpec(K.equalize, _no_args),
    "Invert": OpSpec(K.invert, _no_args),
    "Rotate": OpSpec(K.Affine(K.rotate_matrices), _signed(30.0)),
    "ShearX": OpSpec(K.Affine(K.shear_x_matrices), _signed(0.3)),
    "ShearY": OpSpec(K.Affine(K.shear_y_matrices), _signed(0.3)),
    "TranslateX": OpSpec(K.Affine(K.translate_x_matrices), _translate_abs),
    "TranslateY": OpSpec(K.Affine(K.translate_y_matrices), _translate_abs),
    "TranslateXRel": OpSpec(K.Affine(K.translate_x_rel_matrices), _signed(0.45)),
    "TranslateYRel": OpSpec(K.Affine(K.translate_y_rel_matrices), _signed(0.45)),
    "Posterize": OpSpec(K.posterize, _posterize),
    "PosterizeIncreasing": OpSpec(K.posterize, _posterize_increasing),
    "PosterizeOriginal": OpSpec(K.posterize, _posterize_original),
    "Solarize": OpSpec(K.solarize, _solarize),
    "SolarizeIncreasing": OpSpec(K.solarize, _solarize_increasing),
    "SolarizeAdd": OpSpec(K.solarize_add, _solarize_add),
    "Color": OpSpec(K.color, _enhance),
    "ColorIncreasing": OpSpec(K.color, _enhance_increasing),
    "Contrast": OpSpec(K.contrast, _enhance),
    "ContrastIncreasing": OpSpec(K.contrast, _enhance_increasing),
    "Brightness": OpSpec(K.brightness, _enhance),
    "BrightnessIncreasing": OpSpec(K.brightness, _enhance_increasing),
    "Sharpness": OpSpec(K.sharpness, _enhance),
    "SharpnessIncreasing": OpSpec(K.sharpness, _enhance_increasing),
    "Hue": OpSpec(K.hue),
    "Erase": OpSpec(K.erase),
    # CTAugment's own (its level maps are in .ctaugment)
    "CtAutocontrast": OpSpec(K.ct_autocontrast),
    "CtEqualize": OpSpec(K.ct_equalize),
    "CtInvert": OpSpec(K.ct_invert),
    "CtBlur": OpSpec(K.ct_blur),
    "CtSmooth": OpSpec(K.ct_smooth),
    "CtCutout": OpSpec(K.ct_cutout),
    "CtRescaleBicubic": OpSpec(K.CtRescale("bicubic")),
    "CtRescaleBilinear": OpSpec(K.CtRescale("bilinear")),
    "CtRescaleNearest": OpSpec(K.CtRescale("nearest")),
}


def level_args(name: str, level: float, rng: random.Random, translate_const: float) -> tuple[float, ...]:
    """timm's ``LEVEL_TO_ARG`` for ``name`` at ``level`` (0..10), the sign coin drawn from ``rng``."""
    spec = OPS.get(name)
    if spec is None or spec.level is None:
        raise ValueError(f"unknown op {name!r}")
    return spec.level(level, rng, translate_const)
