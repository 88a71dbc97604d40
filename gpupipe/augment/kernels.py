"""The batched pixel kernels: each takes a (N,3,H,W) uint8 batch, one row of arguments per image (an (N, k) float64
tensor) and the policy's :class:`KernelContext`, and returns the batch with each image changed by its own
arguments. The maths are torchvision v2's tensor kernels (the blends take one factor per image); every kernel is
elementwise or exact per image, so one image and a batch give the same pixels on any device."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torchvision.transforms.v2 import functional as F

from .parse import EraseMode

Matrices = Callable[[torch.Tensor, int, int], list[tuple[float, ...]]]


class KernelContext:
    """What kernels need beyond their arguments: the fill and interpolation of geometric ops, and random erasing's
    mode with the recipe's mean and std on the 0-255 scale (its noise tables are made once per device)."""

    def __init__(
        self,
        fill: tuple[float, ...],
        interpolation: str,
        mean255: tuple[float, ...],
        std255: tuple[float, ...],
        erase_mode: EraseMode,
    ):
        self.fill = fill
        self.interpolation = interpolation
        self.mean255 = mean255
        self.std255 = std255
        self.erase_mode = erase_mode
        self._tables: dict[torch.device, torch.Tensor] = {}

    def noise_table(self, device: torch.device) -> torch.Tensor:
        """(3, 65536) uint8: ``mean + std * z`` at 65,536 evenly spaced normal quantiles, per channel."""
        if device not in self._tables:
            z = torch.special.ndtri((torch.arange(65536, dtype=torch.float64) + 0.5) / 65536)
            mean, std = torch.tensor(self.mean255).view(3, 1), torch.tensor(self.std255).view(3, 1)
            self._tables[device] = (mean + std * z).round().clamp(0, 255).to(torch.uint8).to(device)
        return self._tables[device]


Kernel = Callable[[torch.Tensor, torch.Tensor, KernelContext], torch.Tensor]

_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
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


def autocontrast(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return F.autocontrast(x)


def equalize(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return F.equalize(x)


def invert(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return F.invert(x)


def posterize(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """Keep the top ``a`` bits."""
    return x & ((0xFF << (8 - a[:, 0].long())) & 0xFF).to(x.device, torch.uint8).view(-1, 1, 1, 1)


def solarize(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """Invert pixels >= thresh (0..256; 256: none), comparing in uint8 rather than promoting the image."""
    thresh = a[:, 0]
    invert = (x >= _per_image_u8(thresh.clamp(max=255), x)) & (thresh <= 255).to(x.device).view(-1, 1, 1, 1)
    return torch.where(invert, 255 - x, x)


def solarize_add(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    # x < 128 and add <= 128: the uint8 sum cannot wrap where it is kept
    return torch.where(x < 128, x + _per_image_u8(a[:, 0], x), x)


def brightness(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return _blend(x, 0.0, a)


def color(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return _blend(x, _gray(x), a)


def contrast(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return _blend(x, _gray(x).mean(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64).float(), a)


def sharpness(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return _blend(x, _sharp_degenerate(x), a)


def hue(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """timm's jitter never sets hue; the rare user who does pays a loop."""
    return torch.stack([F.adjust_hue(img, float(v)) for img, v in zip(x, a[:, 0].tolist(), strict=True)])


# ---- geometric ops: one affine matrix per image --------------------------------------------------------------------
def rotate_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    """PIL ``Image.rotate`` about the centre: (a, b, c, d, e, f) maps output (x, y) to input (ax+by+c, dx+ey+f)."""
    out: list[tuple[float, ...]] = []
    for deg in a[:, 0].tolist():
        r = -math.radians(deg)
        cos, sin = math.cos(r), math.sin(r)
        cx, cy = w / 2, h / 2
        out.append((cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy))
    return out


def shear_x_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, v, 0, 0, 1, 0) for v in a[:, 0].tolist()]


def shear_y_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, 0, 0, v, 1, 0) for v in a[:, 0].tolist()]


def translate_x_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, 0, v, 0, 1, 0) for v in a[:, 0].tolist()]


def translate_y_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, 0, 0, 0, 1, v) for v in a[:, 0].tolist()]


def translate_x_rel_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, 0, v * w, 0, 1, 0) for v in a[:, 0].tolist()]


def translate_y_rel_matrices(a: torch.Tensor, h: int, w: int) -> list[tuple[float, ...]]:
    return [(1, 0, 0, 0, 1, v * h) for v in a[:, 0].tolist()]


class Affine:
    """The kernel of a geometric op: its matrices per image, warped with the context's fill and interpolation."""

    def __init__(self, matrices: Matrices):
        self.matrices = matrices

    def __call__(self, x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
        return warp(x, self.matrices(a, x.shape[-2], x.shape[-1]), ctx.fill, ctx.interpolation)


def warp(x: torch.Tensor, mats: list[tuple[float, ...]], fill: tuple[float, ...], mode: str) -> torch.Tensor:
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


# ---- random erasing --------------------------------------------------------------------------------------------------
def erase(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """Boxes (top, left, h, w, noise seed) filled per the context's mode. Only the rows and columns the group's boxes
    span are computed: on CUDA for the whole group at once, on the CPU box by box (the values depend on absolute
    positions only, so both agree)."""
    if not x.is_cuda and len(x) > 1:
        for i in range(len(x)):
            x[i : i + 1] = erase(x[i : i + 1], a[i : i + 1], ctx)
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
    if ctx.erase_mode == "const":
        fill = torch.tensor([round(m) for m in ctx.mean255], dtype=torch.uint8, device=dev).view(1, 3, 1, 1)
    else:
        seed = hash32(a[:, 4].long().to(dev)).view(-1, 1, 1, 1)
        pos = chan if ctx.erase_mode == "rand" else (chan * x.shape[-2] + rows) * x.shape[-1] + cols
        fill = ctx.noise_table(dev).view(-1)[chan * 65536 + (hash32(pos ^ seed) & 0xFFFF)]
    region = x[:, :, y0:y1, x0:x1]
    x[:, :, y0:y1, x0:x1] = torch.where(inside, fill, region)
    return x
