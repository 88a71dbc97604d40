"""A batch's columns as few, large kernel calls: the ops of one position are grouped by family (every geometric op is
one affine warp with a matrix per image; every pointwise op and blend with a scalar or the grey image is one
``point`` call whose stages run only where an image of the group takes them), each family once over all the images
of the batch that draw one of its ops, each image with its own parameters, worked out on the host and sent in the
batch's one copy. Each image gets exactly the arithmetic its op's own kernel (:mod:`.kernels`) would apply (the
identity parameters of the other stages change no value), so one image and a batch give the same pixels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..data.upload import HostPack, Slot
from . import kernels as K
from .ops import OPS
from .plan import Column

# pointwise ops and blends: one role each (a stage of the point kernel)
POSTERIZE, SOLARIZE, INVERT, SOLARIZE_ADD, AUTOCONTRAST, BRIGHTNESS, CONTRAST, COLOR = range(8)
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
    params: Slot | None
    rows: Slot | None
    roles: frozenset[int]


def _point_params(role: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(n, 8): posterize mask, solarize threshold, 255 where solarized above it, add below 128 (the four as uint8),
    autocontrast on, blend factor, contrast on, colour on; the identity where an image's role is another."""
    bits = np.clip(8 - a.astype(np.int64), 0, 8)
    p = np.empty((len(role), 8), np.float64)
    p[:, 0] = np.where(role == POSTERIZE, (0xFF << bits) & 0xFF, 255)
    p[:, 1] = np.where(role == SOLARIZE, np.minimum(a, 255), 0)
    p[:, 2] = 255 * ((role == INVERT) | ((role == SOLARIZE) & (a <= 255)))  # 255 - x is x ^ 255 on uint8
    p[:, 3] = np.where(role == SOLARIZE_ADD, a, 0)
    p[:, 4] = role == AUTOCONTRAST
    p[:, 5] = np.where(role >= BRIGHTNESS, a, 1.0)
    p[:, 6] = role == CONTRAST
    p[:, 7] = role == COLOR
    return p


def _affine_params(role: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(n, 18): each of the six entries of an image's inverse map as (constant, times width, times height)."""
    r = np.where(role == ROTATE, a * (-np.pi / 180), 0.0)
    cos, sin = np.cos(r), np.sin(r)  # 1 and 0 for the other ops
    p = np.zeros((len(role), 6, 3), np.float64)
    p[:, 0, 0], p[:, 4, 0] = cos, cos
    p[:, 1, 0] = sin + np.where(role == SHEAR_X, a, 0.0)
    p[:, 3, 0] = -sin + np.where(role == SHEAR_Y, a, 0.0)
    p[:, 2, 0] = np.where(role == TRANSLATE_X, a, 0.0)
    p[:, 5, 0] = np.where(role == TRANSLATE_Y, a, 0.0)
    p[:, 2, 1] = 0.5 - 0.5 * cos + np.where(role == TRANSLATE_X_REL, a, 0.0)  # rotation about the centre
    p[:, 2, 2] = -0.5 * sin
    p[:, 5, 1] = 0.5 * sin
    p[:, 5, 2] = 0.5 - 0.5 * cos + np.where(role == TRANSLATE_Y_REL, a, 0.0)
    return p.reshape(len(role), 18)


def point(x: torch.Tensor, p: torch.Tensor, roles: frozenset[int], ctx: K.KernelContext) -> torch.Tensor:
    """Each image's pointwise op or blend (parameters from :func:`_point_params`), as :mod:`.kernels` computes it."""
    n = len(x)
    u = p[:, :4].to(torch.uint8).view(n, 4, 1, 1, 1).unbind(1)
    f = p[:, 4:].to(torch.float32).view(n, 4, 1, 1, 1).unbind(1)
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
        keep = (maximum == minimum) | (f[0] == 0)
        inv_scale = torch.where(keep, 1.0, (maximum - minimum).mul_(1.0 / 255))
        x = image.sub_(torch.where(keep, 0.0, minimum)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)
    if roles & {BRIGHTNESS, CONTRAST, COLOR}:
        x = _blend(x, f[1:], roles)
    return x


def _blend(x: torch.Tensor, f: Sequence[torch.Tensor], roles: frozenset[int]) -> torch.Tensor:
    """``x * f + other * (1 - f)``: other = 0 (brightness), the grey mean (contrast), the grey image (colour)."""
    factor, is_contrast, is_color = f
    other = None
    grey = K._gray(x) if roles & {CONTRAST, COLOR} else None
    if grey is not None and CONTRAST in roles:
        other = grey.mean(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64).float().mul_(is_contrast)
    if grey is not None and COLOR in roles:
        other = grey.mul_(is_color) if other is None else grey.mul_(is_color).add_(other)
    out = x.float().mul(factor)
    out = out if other is None else out.add_(other * (1.0 - factor))
    return out.clamp_(0, 255).to(torch.uint8)


def affine(x: torch.Tensor, p: torch.Tensor, roles: frozenset[int], ctx: K.KernelContext) -> torch.Tensor:
    """Each image's geometric op as one warp (parameters from :func:`_affine_params`)."""
    c = p.view(-1, 6, 3)
    mats = c[:, :, 0] + c[:, :, 1] * x.shape[-1] + c[:, :, 2] * x.shape[-2]
    return K.warp(x, mats, ctx.constant(x.device, "fill"), ctx.interpolation)


FamilyKernel = Callable[[torch.Tensor, torch.Tensor, frozenset[int], K.KernelContext], torch.Tensor]
_FAMILIES: dict[str, tuple[dict[str, int], Callable[[np.ndarray, np.ndarray], np.ndarray], FamilyKernel]] = {
    "point": (_POINT, _point_params, point),
    "affine": (_AFFINE, _affine_params, affine),
}
_FAMILY_OF = {name: family for family, (roles, _, _) in _FAMILIES.items() for name in roles}


def prepare(columns: Sequence[Column], pack: HostPack) -> list[Step]:
    """The kernel calls of a batch's columns, their parameters queued in ``pack``: per column, one call per family
    (or op outside the families) any image draws, over just those images."""
    steps = []
    for col in columns:
        present = np.bincount(col.code[col.code >= 0], minlength=len(col.names))
        groups: dict[str, list[int]] = {}
        for c in np.flatnonzero(present).tolist():
            groups.setdefault(_FAMILY_OF.get(col.names[c], col.names[c]), []).append(c)
        for name, codes in groups.items():
            steps.append(_step(col, name, codes, pack))
    return steps


def _step(col: Column, name: str, codes: list[int], pack: HostPack) -> Step:
    mask = np.isin(col.code, codes) if len(codes) > 1 else col.code == codes[0]
    rows = None if mask.all() else np.flatnonzero(mask)
    code = col.code if rows is None else col.code[rows]
    args = col.args if rows is None else col.args[rows]
    row_slot = None if rows is None else pack.add(rows, torch.int64)
    family = _FAMILIES.get(name)
    if family is None:
        width = col.arity[codes[0]]
        return Step(name, pack.add(args[:, :width]) if width else None, row_slot, frozenset())
    role_of, params, _ = family
    role = np.asarray([role_of.get(n, -1) for n in col.names], np.int64)[code]
    a = args[:, 0] if args.shape[1] else np.zeros(len(code))
    return Step(name, pack.add(params(role, a)), row_slot, frozenset(role_of[col.names[c]] for c in codes))


def run(images: torch.Tensor, steps: Sequence[Step], pack: HostPack, ctx: K.KernelContext) -> torch.Tensor:
    """The steps of :func:`prepare` on ``images`` once ``pack`` was sent to their device: no copy, no sync."""
    images = images.clone()
    for step in steps:
        params = None if step.params is None else pack.get(step.params)
        family = _FAMILIES.get(step.name)
        if step.rows is None:
            images = _call(family, step, images, params, ctx)
        else:
            sel = pack.get(step.rows)
            images.index_copy_(0, sel, _call(family, step, images.index_select(0, sel), params, ctx))
    return images


def _call(family, step: Step, x: torch.Tensor, params: torch.Tensor | None, ctx: K.KernelContext) -> torch.Tensor:
    if family is not None:
        assert params is not None
        return family[2](x, params, step.roles, ctx)
    return OPS[step.name].kernel(x, params if params is not None else x.new_zeros((len(x), 0), dtype=torch.float64), ctx)
