"""The op table: every op a policy can draw, keyed by its name (timm's names, ``Hue`` for jitter, ``Erase`` for
random erasing, ``Ct*`` for CTAugment's own), with its batched kernel and, for the ops timm's policy strings name,
timm's level function (``LEVEL_TO_ARG``). A new op is one entry here (and a kernel in :mod:`.kernels`); a policy
then names it."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import numpy as np

from . import kernels as K

LEVEL_DENOM = 10.0  # timm's magnitude scale: levels 0..10


class Op(NamedTuple):
    """One op of one image's record: timm's op name and the arguments its level function gives."""

    name: str
    args: tuple[float, ...] = ()


Record = tuple[Op, ...]


class Level(NamedTuple):
    """timm's level function of an op, as one formula so a batch's arguments are a few array ops: ``v = level / 10
    * scale`` (``scale`` None: the translate constant in pixels), floored if ``floor``, capped at ``cap``, negated on
    the sign coin if ``signed``, then ``base + mult * v``, at least ``low``; ``arity`` 0: no argument."""

    scale: float | None = 1.0
    floor: bool = False
    cap: float = math.inf
    signed: bool = False
    base: float = 0.0
    mult: float = 1.0
    low: float = -math.inf
    arity: int = 1


NO_ARGS = Level(arity=0)


def _signed(maximum: float | None) -> Level:
    """A signed value, ``maximum`` at level 10 (the sign a coin)."""
    return Level(maximum, signed=True)


ENHANCE = Level(1.8, base=0.1)
ENHANCE_INCREASING = Level(0.9, signed=True, base=1.0, low=0.1)
POSTERIZE = Level(4.0, floor=True)
POSTERIZE_INCREASING = Level(4.0, floor=True, base=4.0, mult=-1.0)
POSTERIZE_ORIGINAL = Level(4.0, floor=True, base=4.0)
SOLARIZE = Level(256.0, floor=True, cap=256.0)
SOLARIZE_INCREASING = Level(256.0, floor=True, cap=256.0, base=256.0, mult=-1.0)
SOLARIZE_ADD = Level(110.0, floor=True, cap=128.0)


def level_table(names: tuple[str, ...], translate_const: float) -> np.ndarray:
    """The :class:`Level` of each op of ``names`` as rows of a (len(names), 8) float64 table, for
    :func:`level_values`."""
    rows = []
    for name in names:
        spec = OPS[name].level
        if spec is None:
            raise ValueError(f"unknown op {name!r}")
        scale = translate_const if spec.scale is None else spec.scale
        rows.append((scale, spec.floor, spec.cap, spec.signed, spec.base, spec.mult, spec.low, spec.arity))
    return np.asarray(rows, np.float64).reshape(len(names), 8)


def level_values(table: np.ndarray, level: np.ndarray, coin: np.ndarray) -> np.ndarray:
    """Each row's argument from its op's row of :func:`level_table`, its level (0..10) and its sign coin (True:
    negate, where the op is signed): the same float64 arithmetic as timm's level functions."""
    scale, floor, cap, signed, base, mult, low = (table[..., j] for j in range(7))
    v = level / LEVEL_DENOM * scale
    v = np.minimum(np.where(floor > 0, np.floor(v), v), cap)
    v = np.where((signed > 0) & coin, -v, v)
    return np.maximum(base + mult * v, low)


class OpSpec(NamedTuple):
    kernel: K.Kernel
    level: Level | None = None  # None: its arguments are drawn by its policy (TrivialAugment, jitter, erasing)


OPS: dict[str, OpSpec] = {
    "AutoContrast": OpSpec(K.autocontrast, NO_ARGS),
    "Equalize": OpSpec(K.equalize, NO_ARGS),
    "Invert": OpSpec(K.invert, NO_ARGS),
    "Rotate": OpSpec(K.Affine(K.rotate_matrices), _signed(30.0)),
    "ShearX": OpSpec(K.Affine(K.shear_x_matrices), _signed(0.3)),
    "ShearY": OpSpec(K.Affine(K.shear_y_matrices), _signed(0.3)),
    "TranslateX": OpSpec(K.Affine(K.translate_x_matrices), _signed(None)),
    "TranslateY": OpSpec(K.Affine(K.translate_y_matrices), _signed(None)),
    "TranslateXRel": OpSpec(K.Affine(K.translate_x_rel_matrices), _signed(0.45)),
    "TranslateYRel": OpSpec(K.Affine(K.translate_y_rel_matrices), _signed(0.45)),
    "Posterize": OpSpec(K.posterize, POSTERIZE),
    "PosterizeIncreasing": OpSpec(K.posterize, POSTERIZE_INCREASING),
    "PosterizeOriginal": OpSpec(K.posterize, POSTERIZE_ORIGINAL),
    "Solarize": OpSpec(K.solarize, SOLARIZE),
    "SolarizeIncreasing": OpSpec(K.solarize, SOLARIZE_INCREASING),
    "SolarizeAdd": OpSpec(K.solarize_add, SOLARIZE_ADD),
    "Color": OpSpec(K.color, ENHANCE),
    "ColorIncreasing": OpSpec(K.color, ENHANCE_INCREASING),
    "Contrast": OpSpec(K.contrast, ENHANCE),
    "ContrastIncreasing": OpSpec(K.contrast, ENHANCE_INCREASING),
    "Brightness": OpSpec(K.brightness, ENHANCE),
    "BrightnessIncreasing": OpSpec(K.brightness, ENHANCE_INCREASING),
    "Sharpness": OpSpec(K.sharpness, ENHANCE),
    "SharpnessIncreasing": OpSpec(K.sharpness, ENHANCE_INCREASING),
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
    """timm's ``LEVEL_TO_ARG`` for ``name`` at ``level`` (0..10), the sign coin drawn from ``rng`` (signed ops
    only, as timm)."""
    spec = OPS.get(name)
    if spec is None or spec.level is None:
        raise ValueError(f"unknown op {name!r}")
    if spec.level.arity == 0:
        return ()
    coin = spec.level.signed and rng.random() > 0.5
    return (
        float(level_values(level_table((name,), translate_const)[0], np.asarray(level, np.float64), np.asarray(coin))),
    )
