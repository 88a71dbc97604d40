"""A batch's columns as few, large kernel calls: the ops of one position are grouped by family (every geometric op is
one affine warp with a matrix per image; every pointwise op and blend with a scalar or the grey image is one
``point`` call whose stages run only where an image of the group takes them), each family once over all the images
of the batch that draw one of its ops, each image with its own parameters, worked out on the host and sent in the
batch's one copy. Each image gets exactly the arithmetic its op's own kernel (:mod:`.kernels`) would apply (the
identity parameters of the other stages change no value), so one image and a batch give the same pixels."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..plumbing.host_pack import HostPack, Slot
from . import kernels as K
from .ops import OPS
from .plan import Column

# pointwise ops and blends: one role each (a stage of the point kernel)
POSTERIZE, SOLARIZE, INVERT, SOLARIZE_ADD, AUTOCONTRAST, BRIGHTNESS, CONTRAST, COLOR, SHARPNESS = range(9)
_POINT = {
    "AutoContrast": AUTOCONTRAST,
    "Invert": INVERT,
    "Posterize": POSTERIZE,
    "PosterizeIncreasing": POSTERIZE,
    "PosterizeOriginal": POSTERIZE,
    "Solarize": SOLARIZE,
    "SolarizeIncreasing": SOLARIZE,
    "SolarizeAdd": SOLARIZE_ADD,
    "Brightness": BRIGHTNESS,
    "BrightnessIncreasing": BRIGHTNESS,
    "Contrast": CONTRAST,
    "ContrastIncreasing": CONTRAST,
    "Color": COLOR,
    "ColorIncreasing": COLOR,
    "Sharpness": SHARPNESS,
    "SharpnessIncreasing": SHARPNESS,
}
ROTATE, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y, TRANSLATE_X_REL, TRANSLATE_Y_REL = range(7)
_AFFINE = {
    "Rotate": ROTATE,
    "ShearX": SHEAR_X,
    "ShearY": SHEAR_Y,
    "TranslateX": TRANSLATE_X,
    "TranslateY": TRANSLATE_Y,
    "TranslateXRel": TRANSLATE_X_REL,
    "TranslateYRel": TRANSLATE_Y_REL,
}


class Step(NamedTuple):
    """One kernel call of a batch: its family (or op), its (n, k) parameters, which images (None: all) and the
    roles present (the point kernel's stages to run)."""

    name: str
    params: tuple[Slot, ...]
    rows: Slot | None
    roles: frozenset[int]


Params = tuple[tuple[np.ndarray, torch.dtype], ...]  # a family's parameters: arrays and their device dtypes


def _point_params(role: np.ndarray, a: np.ndarray, hw: tuple[int, int]) -> Params:
    """(n, 5) uint8: posterize mask, solarize threshold, 255 where solarized above it, add below 128, not
    autocontrast; (n, 4) float32: blend factor, contrast on, colour on, sharpness on; the identity where an image's
    role is another."""
    bits = np.clip(8 - a.astype(np.int64), 0, 8)
    u = np.empty((len(role), 5), np.uint8)
    u[:, 0] = np.where(role == POSTERIZE, (0xFF << bits) & 0xFF, 255)
    u[:, 1] = np.where(role == SOLARIZE, np.minimum(a, 255), 0)
    u[:, 2] = 255 * ((role == INVERT) | ((role == SOLARIZE) & (a <= 255)))  # 255 - x is x ^ 255 on uint8
    u[:, 3] = np.where(role == SOLARIZE_ADD, a, 0)
    u[:, 4] = role != AUTOCONTRAST
    f = np.empty((len(role), 4), np.float32)
    f[:, 0] = np.where(role >= BRIGHTNESS, a, 1.0)
    f[:, 1] = role == CONTRAST
    f[:, 2] = role == COLOR
    f[:, 3] = role == SHARPNESS
    return (u, torch.uint8), (f, torch.float32)


def _affine_params(role: np.ndarray, a: np.ndarray, hw: tuple[int, int]) -> Params:
    """(n, 6) float32: each image's inverse map (PIL's convention, as :mod:`.kernels`' matrices) taking an output
    pixel's centre to ``grid_sample``'s normalized coordinates."""
    h, w = hw
    r = np.where(role == ROTATE, a * (-np.pi / 180), 0.0)
    cos, sin = np.cos(r), np.sin(r)  # 1 and 0 for the other ops
    cx, cy = w / 2, h / 2
    m = np.empty((len(role), 6), np.float64)
    m[:, 0], m[:, 4] = cos, cos
    m[:, 1] = sin + np.where(role == SHEAR_X, a, 0.0)
    m[:, 3] = -sin + np.where(role == SHEAR_Y, a, 0.0)
    m[:, 2] = cx - cos * cx - sin * cy + np.where(role == TRANSLATE_X, a, np.where(role == TRANSLATE_X_REL, a * w, 0.0))
    m[:, 5] = cy + sin * cx - cos * cy + np.where(role == TRANSLATE_Y, a, np.where(role == TRANSLATE_Y_REL, a * h, 0.0))
    m[:, :3] *= 2.0 / w
    m[:, 3:] *= 2.0 / h
    m[:, 2] -= 1.0
    m[:, 5] -= 1.0
    return ((m.astype(np.float32), torch.float32),)


def point(x: torch.Tensor, p: Sequence[torch.Tensor], roles: frozenset[int], ctx: K.KernelContext) -> torch.Tensor:
    """Each image's pointwise op or blend (parameters from :func:`_point_params`), as :mod:`.kernels` computes it."""
    n = len(x)
    u = p[0].view(n, 5, 1, 1, 1).unbind(1)
    f = p[1].view(n, 4, 1, 1, 1).unbind(1)
    if POSTERIZE in roles:
        x = x & u[0]
    if roles & {SOLARIZE, INVERT}:
        x = torch.where(x >= u[1], x ^ u[2], x)
    if SOLARIZE_ADD in roles:
        x = torch.where(x < 128, x + u[3], x)
    if AUTOCONTRAST in roles:
        image = x.float()
        minimum = image.amin(dim=(-2, -1), keepdim=True)
        maximum = image.amax(dim=(-2, -1), keepdim=True)
        keep = (maximum == minimum).logical_or_(u[4].view(torch.bool))  # flat, or not this image's op: as it is
        inv_scale = (maximum - minimum).mul_(1.0 / 255).masked_fill_(keep, 1.0)
        x = image.sub_(minimum.masked_fill_(keep, 0.0)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)
    if roles & {BRIGHTNESS, CONTRAST, COLOR, SHARPNESS}:
        x = _blend(x, f, roles, ctx)
    return x


def _blend(x: torch.Tensor, f: Sequence[torch.Tensor], roles: frozenset[int], ctx: K.KernelContext) -> torch.Tensor:
    """``x * f + other * (1 - f)``: other = 0 (brightness), the grey mean (contrast), the grey image (colour), the
    smoothed image (sharpness); the other terms times 0 add nothing."""
    factor, is_contrast, is_color, is_sharp = f
    terms = []
    grey = K._gray(x) if roles & {CONTRAST, COLOR} else None
    if grey is not None and CONTRAST in roles:
        terms.append(grey.mean(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64).float().mul_(is_contrast))
    if grey is not None and COLOR in roles:
        terms.append(grey.mul_(is_color))
    if SHARPNESS in roles:
        terms.append(K._sharp_degenerate(x, ctx.constant(x.device, "smooth")).mul_(is_sharp))
    out = x.float().mul(factor)
    if terms:
        other = terms[-1]
        for term in terms[-2::-1]:
            other = other.add_(term)
        out = out.add_(other * (1.0 - factor))
    return out.clamp_(0, 255).to(torch.uint8)


def affine(x: torch.Tensor, p: Sequence[torch.Tensor], roles: frozenset[int], ctx: K.KernelContext) -> torch.Tensor:
    """Each image's geometric op as one warp (its matrix from :func:`_affine_params`)."""
    return K.warp_normalized(x, p[0], ctx)


FamilyKernel = Callable[[torch.Tensor, Sequence[torch.Tensor], frozenset[int], K.KernelContext], torch.Tensor]
_FAMILIES: dict[
    str, tuple[dict[str, int], Callable[[np.ndarray, np.ndarray, tuple[int, int]], Params], FamilyKernel]
] = {
    "point": (_POINT, _point_params, point),
    "affine": (_AFFINE, _affine_params, affine),
}
_FAMILY_OF = {name: family for family, (roles, _, _) in _FAMILIES.items() for name in roles}


def prepare(columns: Sequence[Column], pack: HostPack, hw: tuple[int, int]) -> list[Step]:
    """The kernel calls of a batch's columns on (H, W) images ``hw``, their parameters queued in ``pack``: per
    column, one call per family (or op outside the families) any image draws, over just those images."""
    steps = []
    for col in columns:
        present = np.bincount(col.code[col.code >= 0], minlength=len(col.names))
        groups: dict[str, list[int]] = {}
        for c in np.flatnonzero(present).tolist():
            groups.setdefault(_FAMILY_OF.get(col.names[c], col.names[c]), []).append(c)
        group_of = np.full(len(col.names) + 1, -1, np.int64)  # code -1 (none) reads the last entry
        for g, codes in enumerate(groups.values()):
            group_of[codes] = g
        group = group_of[col.code]
        for g, (name, codes) in enumerate(groups.items()):
            steps.append(_step(col, name, codes, group == g, pack, hw))
    return steps


def _step(col: Column, name: str, codes: list[int], mask: np.ndarray, pack: HostPack, hw: tuple[int, int]) -> Step:
    rows = None if mask.all() else np.flatnonzero(mask)
    code = col.code if rows is None else col.code[rows]
    args = col.args if rows is None else col.args[rows]
    row_slot = None if rows is None else pack.add(rows, torch.int64)
    family = _FAMILIES.get(name)
    if family is None:
        own = args[:, : col.arity[codes[0]]]
        if name == "Erase":
            return Step(name, (pack.add(K.erase_params(own), torch.int64),), row_slot, frozenset())
        return Step(name, (pack.add(own),), row_slot, frozenset())
    role_of, params, _ = family
    role = _roles(name, col.names)[code]
    a = args[:, 0] if args.shape[1] else np.zeros(len(code))
    slots = tuple(pack.add(v, dtype) for v, dtype in params(role, a, hw))
    return Step(name, slots, row_slot, frozenset(role_of[col.names[c]] for c in codes))


@functools.lru_cache(maxsize=256)
def _roles(family: str, names: tuple[str, ...]) -> np.ndarray:
    """The role in ``family`` of each op of ``names`` (-1: another family's)."""
    role_of = _FAMILIES[family][0]
    return np.asarray([role_of.get(n, -1) for n in names], np.int64)


def run(images: torch.Tensor, steps: Sequence[Step], pack: HostPack, ctx: K.KernelContext) -> torch.Tensor:
    """The steps of :func:`prepare` on ``images`` once ``pack`` was sent to their device: no copy, no sync."""
    images = images.clone()
    for step in steps:
        params = tuple(pack.get(slot) for slot in step.params)
        if step.rows is None:
            images = _call(step, images, params, ctx)
        else:
            sel = pack.get(step.rows)
            images.index_copy_(0, sel, _call(step, images.index_select(0, sel), params, ctx))
    return images


def _call(step: Step, x: torch.Tensor, params: tuple[torch.Tensor, ...], ctx: K.KernelContext) -> torch.Tensor:
    family = _FAMILIES.get(step.name)
    if family is not None:
        return family[2](x, params, step.roles, ctx)
    return OPS[step.name].kernel(x, params[0], ctx)
