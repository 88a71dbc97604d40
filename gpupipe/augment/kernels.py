"""The batched pixel kernels: each takes a (N,3,H,W) uint8 batch, one row of arguments per image (an (N, k) float64
tensor **on the batch's device**, from the batch's one host-to-device copy) and the policy's :class:`KernelContext`,
and returns the batch with each image changed by its own arguments. The maths are torchvision v2's tensor kernels
(the blends take one factor per image); every kernel is elementwise or exact per image, so one image and a batch give
the same pixels on any device. No kernel reads a value back to the host or copies to the device (on CUDA either
would make the host wait for the GPU): the ops' own geometric matrices are computed on the device (the fused
calls of :mod:`.fused` work theirs out on the host and send them with the batch), constants are made once per device
(:meth:`KernelContext.to_device`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

from .parse import EraseMode

Matrices = Callable[[torch.Tensor, int, int], torch.Tensor]


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
        self._constants: dict[tuple[torch.device, str], torch.Tensor] = {}

    def to_device(self, device: torch.device) -> None:
        """Make the constants on ``device`` now (the device stage calls this at build), not in a batch."""
        for name in ("fill", "erase_fill", "noise", "smooth"):
            self.constant(device, name)

    def constant(self, device: torch.device, name: str) -> torch.Tensor:
        """``fill`` (1,3,1,1) float32, ``erase_fill`` (1,3,1,1) uint8 (the mean), ``smooth`` sharpness's kernel
        (:func:`smooth_weight`), ``noise`` (3, 65536) uint8:
        ``mean + std * z`` at 65,536 evenly spaced normal quantiles, per channel. Made on the CPU, copied once."""
        key = (device, name)
        if key not in self._constants:
            if name == "fill":
                value = torch.tensor(self.fill, dtype=torch.float32).view(1, 3, 1, 1)
            elif name == "erase_fill":
                value = torch.tensor([round(m) for m in self.mean255], dtype=torch.uint8).view(1, 3, 1, 1)
            elif name == "smooth":
                value = smooth_weight(torch.device("cpu"))
            else:
                z = torch.special.ndtri((torch.arange(65536, dtype=torch.float64) + 0.5) / 65536)
                mean, std = torch.tensor(self.mean255).view(3, 1), torch.tensor(self.std255).view(3, 1)
                value = (mean + std * z).round().clamp(0, 255).to(torch.uint8)
            self._constants[key] = value.to(device)
        return self._constants[key]

    def centres(self, device: torch.device, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pixel centres' x (1,1,W) and y (1,H,1) as float32 on ``device``, made there once per size."""
        xs, ys = (device, f"centres-x{w}"), (device, f"centres-y{h}")
        if xs not in self._constants:
            self._constants[xs] = torch.arange(w, device=device, dtype=torch.float32).add_(0.5).view(1, 1, w)
        if ys not in self._constants:
            self._constants[ys] = torch.arange(h, device=device, dtype=torch.float32).add_(0.5).view(1, h, 1)
        return self._constants[xs], self._constants[ys]

    def positions(self, device: torch.device, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row (1,1,H,1) and column (1,1,1,W) indices and each value's position ``(c * H + row) * W + col``
        (1,3,H,W), int64 on ``device``, made there once per size (random erasing's)."""
        keys = [(device, f"erase-{name}{h}x{w}") for name in ("rows", "cols", "pos")]
        if keys[0] not in self._constants:
            rows = torch.arange(h, device=device).view(1, 1, h, 1)
            cols = torch.arange(w, device=device).view(1, 1, 1, w)
            pos = (torch.arange(3, device=device).view(1, 3, 1, 1) * h + rows) * w + cols
            self._constants.update(zip(keys, (rows, cols, pos), strict=True))
        rows, cols, pos = (self._constants[k] for k in keys)
        return rows, cols, pos

    def noise_table(self, device: torch.device) -> torch.Tensor:
        return self.constant(device, "noise")


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


def smooth_weight(device: torch.device) -> torch.Tensor:
    """The 3x3 smoothing kernel of sharpness, one per channel: (3, 1, 3, 3) float32, 5 in the centre."""
    weight = torch.ones((3, 1, 3, 3), device=device)
    weight[:, :, 1, 1] = 5.0
    return weight


def _sharp_degenerate(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """v2 ``adjust_sharpness``'s smoothed image (3x3 kernel, 5 in the centre, /13, borders kept) as one convolution:
    every product and sum is an integer below 2**24 (and the inputs exact in TF32; autocast is turned off for it),
    so float32 gives them exactly, and ``floor((2s + 13) / 26)`` rounds ``s / 13`` (no ties with 13)."""
    xf = x.float()
    h, w = x.shape[-2:]
    if h < 3 or w < 3:
        return xf
    weight = smooth_weight(x.device) if weight is None else weight
    kind = x.device.type
    with torch.autocast(kind, enabled=False) if kind in ("cuda", "cpu") else contextlib.nullcontext():
        s = torch.nn.functional.conv2d(xf, weight, groups=3)  # in float32 even under the caller's autocast
    out = xf.clone()
    out[..., 1:-1, 1:-1] = s.mul_(2).add_(13).div_(26).floor_()
    return out


def _per_image_u8(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.to(device=x.device, dtype=torch.uint8).view(-1, 1, 1, 1)


def autocontrast(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    return _autocontrast(x)


def _autocontrast(x: torch.Tensor) -> torch.Tensor:
    """v2 ``autocontrast`` with the same arithmetic, its two boolean-mask assignments (a host sync each on CUDA) as
    ``where``."""
    image = x.float()
    minimum = image.amin(dim=(-2, -1), keepdim=True)
    maximum = image.amax(dim=(-2, -1), keepdim=True)
    flat = maximum == minimum
    inv_scale = torch.where(flat, 1.0, (maximum - minimum).mul_(1.0 / 255))
    return image.sub_(torch.where(flat, 0.0, minimum)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


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
    """v2 ``adjust_hue`` with one factor per image (its own HSV round trip; a factor of 0 keeps the image)."""
    from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv  # v2's own conversions

    factor = a[:, :1].to(torch.float32).view(-1, 1, 1)
    h, s, v = _rgb_to_hsv(F.to_dtype(x, torch.float32, scale=True)).unbind(dim=-3)
    out = F.to_dtype(_hsv_to_rgb(torch.stack((h.add(factor).remainder_(1.0), s, v), dim=-3)), torch.uint8, scale=True)
    return torch.where(factor.view(-1, 1, 1, 1) == 0, x, out)


# ---- geometric ops: one affine matrix per image --------------------------------------------------------------------
def _matrices(a: torch.Tensor, *entries: torch.Tensor | float) -> torch.Tensor:
    """(N, 6) float64 on ``a``'s device from six per-image entries (tensors (N,) or constants)."""
    n = a.shape[0]
    return torch.stack([e if isinstance(e, torch.Tensor) else a.new_full((n,), float(e)) for e in entries], dim=1)


def rotate_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """PIL ``Image.rotate`` about the centre: (a, b, c, d, e, f) maps output (x, y) to input (ax+by+c, dx+ey+f)."""
    r = a[:, 0] * (-math.pi / 180)
    cos, sin = torch.cos(r), torch.sin(r)
    cx, cy = w / 2, h / 2
    return _matrices(a, cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy)


def shear_x_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, a[:, 0], 0, 0, 1, 0)


def shear_y_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, 0, 0, a[:, 0], 1, 0)


def translate_x_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, 0, a[:, 0], 0, 1, 0)


def translate_y_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, 0, 0, 0, 1, a[:, 0])


def translate_x_rel_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, 0, a[:, 0] * w, 0, 1, 0)


def translate_y_rel_matrices(a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return _matrices(a, 1, 0, 0, 0, 1, a[:, 0] * h)


class Affine:
    """The kernel of a geometric op: its matrices per image, warped with the context's fill and interpolation."""

    def __init__(self, matrices: Matrices):
        self.matrices = matrices

    def __call__(self, x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
        mats = self.matrices(a, x.shape[-2], x.shape[-1])
        return warp(x, mats, ctx.constant(x.device, "fill"), ctx.interpolation)


def warp(x: torch.Tensor, mats: torch.Tensor, fill_t: torch.Tensor, mode: str) -> torch.Tensor:
    """One affine warp per image (PIL's inverse-map convention; ``mats`` (N, 6) on the device), ``grid_sample`` as
    v2's ``affine`` does, with the grid built by elementwise ops (no matmul), so one image and a batch get the same
    coordinates."""
    n, _, h, w = x.shape
    m = mats.to(torch.float32).view(n, 6, 1, 1)
    ys = (torch.arange(h, device=x.device, dtype=torch.float32) + 0.5).view(1, h, 1)
    xs = (torch.arange(w, device=x.device, dtype=torch.float32) + 0.5).view(1, 1, w)
    gx = (m[:, 0] * xs + m[:, 1] * ys + m[:, 2]) * (2.0 / w) - 1.0
    gy = (m[:, 3] * xs + m[:, 4] * ys + m[:, 5]) * (2.0 / h) - 1.0
    return _sample(x, torch.stack([gx, gy], dim=-1), fill_t, mode)


def warp_normalized(x: torch.Tensor, m: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """:func:`warp` with ``m`` (N, 6) float32 already mapping each output pixel's centre to ``grid_sample``'s
    normalized coordinates (worked out on the host), on the context's cached pixel centres: a few launches."""
    m = m.view(len(x), 6, 1, 1)
    xs, ys = ctx.centres(x.device, x.shape[-2], x.shape[-1])
    gx = torch.addcmul(torch.addcmul(m[:, 2], m[:, 1], ys), m[:, 0], xs)
    gy = torch.addcmul(torch.addcmul(m[:, 5], m[:, 4], ys), m[:, 3], xs)
    return _sample(x, torch.stack([gx, gy], dim=-1), ctx.constant(x.device, "fill"), ctx.interpolation)


def _sample(x: torch.Tensor, grid: torch.Tensor, fill_t: torch.Tensor, mode: str) -> torch.Tensor:
    # sampling (image - fill) with zero padding, then adding fill back, blends the fill in where the source runs out
    # (v2's extra mask channel, without the fourth channel)
    out = torch.nn.functional.grid_sample(
        x.float() - fill_t, grid, mode=mode, padding_mode="zeros", align_corners=False
    )
    return out.add_(fill_t).round_().clamp_(0, 255).to(torch.uint8)


# ---- random erasing --------------------------------------------------------------------------------------------------
def erase(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """Boxes (top, left, bottom, right, hashed noise seed; int64, :func:`erase_params`) filled per the context's
    mode. On the CPU box by box, computing only the rows and columns each box spans; on a device the whole group at
    once over the whole image (the span would have to be read back to the host), on the context's cached positions.
    The values depend on absolute positions only, so both agree."""
    if x.device.type == "cpu" and len(x) > 1:
        for i in range(len(x)):
            x[i : i + 1] = erase(x[i : i + 1], a[i : i + 1], ctx)
        return x
    dev, (height, width) = x.device, x.shape[-2:]
    t, l_, b, r, seed = (v.view(-1, 1, 1, 1) for v in a.long().unbind(1))
    if dev.type == "cpu":  # one box: its span (host values, no sync on the CPU)
        y0, y1, x0, x1 = int(t), int(b), int(l_), int(r)
        rows = torch.arange(y0, y1).view(1, 1, -1, 1)
        cols = torch.arange(x0, x1).view(1, 1, 1, -1)
        pos = (torch.arange(3).view(1, 3, 1, 1) * height + rows) * width + cols
    else:
        y0, y1, x0, x1 = 0, height, 0, width
        rows, cols, pos = ctx.positions(dev, height, width)
    inside = ((rows >= t) & (rows < b)) & ((cols >= l_) & (cols < r))
    region = x[:, :, y0:y1, x0:x1]
    if ctx.erase_mode == "const":
        fill = ctx.constant(dev, "erase_fill")
    else:
        pos = torch.arange(3, device=dev).view(1, 3, 1, 1) if ctx.erase_mode == "rand" else pos
        idx = (hash32(pos ^ seed) & 0xFFFF).expand(len(x), 3, *region.shape[-2:])
        table = ctx.noise_table(dev).expand(len(x), 3, 65536)
        fill = torch.gather(table, 2, idx.reshape(len(x), 3, -1)).view(idx.shape)
    if dev.type != "cpu":
        return torch.where(inside, fill, x)
    x[:, :, y0:y1, x0:x1] = torch.where(inside, fill, region)
    return x


def erase_params(args) -> np.ndarray:
    """Erasing's (top, left, h, w, seed) rows as the kernel's (top, left, bottom, right, hashed seed), int64."""
    a = np.asarray(args, np.float64).astype(np.int64)
    return np.stack([a[:, 0], a[:, 1], a[:, 0] + a[:, 2], a[:, 1] + a[:, 3], hash32_numpy(a[:, 4])], 1)


def hash32_numpy(x: np.ndarray) -> np.ndarray:
    """:func:`hash32` on the host."""
    x = x.astype(np.int64) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


# ---- CTAugment's own ops (FixMatch's ``libml/ctaugment.py``) ----------------------------------------------------
_RING = [(dy, dx) for dy in range(5) for dx in range(5) if dy in (0, 4) or dx in (0, 4)]


def _box_blur(x: torch.Tensor) -> torch.Tensor:
    """PIL's ``ImageFilter.BLUR`` (the 16 pixels on the 5x5 ring, /16, rounded), borders kept."""
    h, w = x.shape[-2:]
    if h < 5 or w < 5:
        return x.float()
    xi = x.to(torch.int16)  # at most 16 * 255 + 8: no overflow
    s = xi[..., 0 : h - 4, 0 : w - 4].clone()
    for dy, dx in _RING[1:]:
        s += xi[..., dy : dy + h - 4, dx : dx + w - 4]
    out = xi.clone()
    out[..., 2:-2, 2:-2] = torch.div(s + 8, 16, rounding_mode="floor")
    return out.float()


def _blended(op: Callable[[torch.Tensor], torch.Tensor]) -> Kernel:
    """``Image.blend(x, op(x), level)`` as PIL computes it (float32 ``x + level * (op(x) - x)``, truncated), one
    level per image."""

    def kernel(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
        f = a[:, :1].to(torch.float32).view(-1, 1, 1, 1)
        xf = x.float()
        return xf.add_(f * (op(x).float() - xf)).clamp_(0, 255).to(torch.uint8)

    return kernel


ct_autocontrast = _blended(_autocontrast)  # v2's arithmetic without its host syncs
ct_equalize = _blended(F.equalize)
ct_invert = _blended(F.invert)
ct_blur = _blended(_box_blur)
ct_smooth = _blended(_sharp_degenerate)  # PIL's SMOOTH is v2's sharpness kernel: 3x3, centre 5, /13


def ct_cutout(x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """A (top, left, bottom, right) box per image, set to grey 127."""
    h, w = x.shape[-2:]
    top, left, bottom, right = (a[:, i].view(-1, 1, 1, 1) for i in range(4))
    rows = torch.arange(h, device=x.device).view(1, 1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    return x.masked_fill(inside, 127)


class CtRescale:
    """(s,): crop ``s`` of the side off every edge and resize back, a zoom about the centre: output (x, y) reads
    input (s*W + (1-2s)x, s*H + (1-2s)y); one kernel per resampling mode (PIL's six methods map to three)."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, x: torch.Tensor, a: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
        h, w = x.shape[-2:]
        s = a[:, 0]
        mats = _matrices(a, 1 - 2 * s, 0, s * w, 0, 1 - 2 * s, s * h)
        return warp(x, mats, ctx.constant(x.device, "fill"), self.mode)
