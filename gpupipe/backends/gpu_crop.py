"""The recipe's crop, resize, flip and EXIF orientation for a whole batch of decoded images on the GPU, in a
handful of batched ops (nvjpeg's device side, and a held set's: :mod:`.held`).

The images stay as the decoder stored them: each upright crop box is mapped into stored pixels on the host (numpy,
the whole batch at once), one ``roi_align`` per chunk crops and resizes every image (its adaptive sampling averages
each output pixel's footprint: an antialiased resize), and the orientation's transpose and flips, with the recipe's
random flip, are applied to the square outputs by one ``where`` each over the batch. Sampling is symmetric within a
box, so mirroring a box and then its output is the same as cropping the mirrored image.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from ..image import ORIENT_STEPS
from ..plumbing.host_pack import HostPack

# (transpose, mirror, flip) of each EXIF orientation, indexed by it (0 and 1: upright)
_STEPS = np.array([(False, False, False)] * 2 + [ORIENT_STEPS[o] for o in range(2, 9)], dtype=bool)

# The padded float copy one roi_align call reads: at most this many elements (1 GiB), so 1-8 MP photos go in chunks.
_PAD_ELEMENTS = 1 << 28
_PAD_STEP = 64  # padded sides are rounded up to a multiple of this (PadSize)


def stored_rois(boxes: np.ndarray, orientation: np.ndarray, shapes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rois, steps)`` for a batch: ``boxes`` (n, 5) ``top, left, height, width, flip`` in upright pixels,
    ``orientation`` (n,) EXIF, ``shapes`` (n, 2) the stored ``(height, width)``. ``rois`` (n, 4) are ``x1, y1, x2, y2``
    in stored pixels; ``steps`` (n, 3) bool: transpose, then flip vertically, then mirror each square output (the
    mirror includes the recipe's flip) to get the upright crop."""
    top, left, height, width, flip = (boxes[:, k] for k in range(5))
    transpose, mirror, vflip = _STEPS[orientation].T
    stored_h, stored_w = shapes[:, 0], shapes[:, 1]
    upright_h, upright_w = np.where(transpose, stored_w, stored_h), np.where(transpose, stored_h, stored_w)
    top = np.where(vflip, upright_h - top - height, top)  # the box before the vertical flip
    left = np.where(mirror, upright_w - left - width, left)  # before the mirror
    x1, y1 = np.where(transpose, top, left), np.where(transpose, left, top)  # before the transpose
    w, h = np.where(transpose, height, width), np.where(transpose, width, height)
    rois = np.stack([x1, y1, x1 + w, y1 + h], 1)
    return rois, np.stack([transpose, vflip, mirror ^ (flip > 0.5)], 1)


def chunks(shapes: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges, in order, each as long as its padded (n, 3, Hmax, Wmax) batch stays under
    ``_PAD_ELEMENTS`` (at least one image each): a few numpy ops per chunk, none per image."""
    lo, n = 0, len(shapes)
    while lo < n:
        heights, widths = np.maximum.accumulate(shapes[lo:, 0]), np.maximum.accumulate(shapes[lo:, 1])
        cost = np.arange(1, n - lo + 1) * 3 * heights.astype(np.int64) * widths
        hi = lo + max(1, int(np.searchsorted(cost, _PAD_ELEMENTS, side="right")))  # cost grows with each image
        yield lo, hi
        lo = hi


class PadSize:
    """The (height, width) one loader pads its batches to: the largest so far, rounded up to a multiple of
    ``_PAD_STEP``. The padded float batch is the largest allocation of the device side; padded to each batch's own
    largest image, its size changes every batch, and each new size the caching allocator has no block for makes it
    split or reserve another (the pattern that fragments it: reserved memory grows with the batches). Padded to a size
    that only grows, every batch after the first few asks for a size it has cached. A batch that needs under half
    that area pads to its own rounded size, so one huge photo does not make every later batch pay for it."""

    def __init__(self) -> None:
        self.height = self.width = 0

    def __call__(self, shapes: np.ndarray) -> tuple[int, int]:
        need_h, need_w = (-(-(int(v) + 1) // _PAD_STEP) * _PAD_STEP for v in shapes.max(0))  # an edge row past each
        self.height, self.width = max(self.height, need_h), max(self.width, need_w)
        if 2 * need_h * need_w < self.height * self.width:
            return need_h, need_w
        return self.height, self.width


def padded(
    images: list[torch.Tensor],
    shapes: np.ndarray,
    size: tuple[int, int] | None = None,
    sides: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N,3,H,W) float32, each image (of ``shapes``: its height, width) at the top left, its last row and column
    repeated once past its edges, zeros beyond; ``(H, W)`` = ``size`` (larger than every image; by default the
    largest image's sides plus one).

    The images go into one flat buffer (one ``cat``), and every padded pixel is gathered from it by an index made on
    the device from each image's sides and start in that buffer (``sides``, ``starts``: :func:`pad_arguments`, sent by
    the caller with its other arguments in one pinned copy): a dozen ops for the batch, none per image, the same on
    every device (the meta device of the sync tests included), and no metadata copied from pageable memory (torch's
    nested ``to_padded_tensor`` copies its sizes to the device from pageable memory: a host sync on CUDA).

    The repeated edge is what roi_align reads past an image's last pixel centre (a crop that reaches the bottom or
    right edge and is enlarged samples up to half a pixel beyond it): it clamps there for an image as large as the
    padded batch, and would otherwise read the zeros, a dark border on every other image."""
    device = images[0].device
    height, width = size if size is not None else (int(v) + 1 for v in shapes.max(0))
    if sides is None or starts is None:
        sides_np, starts_np = pad_arguments(shapes)
        sides, starts = (torch.from_numpy(a).to(device) for a in (sides_np, starts_np))
    flat = torch.cat([img.reshape(-1) for img in images])  # uint8: image k's 3 planes from starts[k] on
    h, w = sides[:, :1], sides[:, 1:]  # (N, 1) int32 each
    ys, xs = (
        torch.arange(height, device=device, dtype=torch.int32),
        torch.arange(width, device=device, dtype=torch.int32),
    )
    rows = torch.minimum(ys, h - 1) * w + starts[:, None]  # (N, H): where each padded row reads, edge row clamped
    cols = torch.minimum(xs, w - 1)  # (N, W)
    inside = (ys <= h)[:, :, None] & (xs <= w)[:, None, :]  # (N, H, W): the image and its repeated edge
    at = rows[:, :, None] + cols[:, None, :]  # (N, H, W): channel 0's source of each padded pixel
    plane = h[:, :, None] * w[:, :, None]
    planes = [flat.index_select(0, (at + c * plane).view(-1)).view(len(images), height, width) for c in range(3)]
    return torch.stack(planes, 1).float().mul_(inside[:, None])


def pad_arguments(shapes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sides, starts)``: each image's (height, width) and where its pixels start in the flat buffer of
    :func:`padded`, int32 (a chunk's buffer holds well under 2**31 bytes: ``_PAD_ELEMENTS``)."""
    sides = np.ascontiguousarray(shapes, dtype=np.int32)
    sizes = 3 * sides[:, 0].astype(np.int64) * sides[:, 1]
    return sides, (np.cumsum(sizes) - sizes).astype(np.int32)


def crop_resize_flip(
    images: list[torch.Tensor],
    rois: np.ndarray,
    steps: np.ndarray,
    shapes: np.ndarray,
    size: int,
    pad: PadSize | None = None,
) -> torch.Tensor:
    """Each stored (3,H,W) uint8 image (of ``shapes``) cropped to its ``rois`` and resized to ``size``, then turned
    upright and flipped by its ``steps`` (both from :func:`stored_rois`), as (N,3,S,S) uint8. The boxes, the flags and
    the mirror's column order go to the device in one pinned non-blocking copy, then a handful of ops per chunk, none
    per image. ``pad``: the loader's :class:`PadSize` (each chunk padded to its own largest image without one)."""
    from torchvision.ops import roi_align  # defer: loads torchvision's C++ ops

    device = images[0].device
    spans = list(chunks(shapes))
    first = np.concatenate([np.arange(hi - lo) for lo, hi in spans])  # each box's image within its chunk
    pack = HostPack()
    roi_slot = pack.add(np.concatenate([first[:, None], rois], 1), torch.float32)
    step_slot = pack.add(steps, torch.int64)
    starts = np.concatenate([pad_arguments(shapes[lo:hi])[1] for lo, hi in spans])  # in each chunk's own buffer
    side_slot, start_slot = pack.add(shapes, torch.int32), pack.add(starts, torch.int32)
    pack.send(device)
    on_device, flags = pack.get(roi_slot), pack.get(step_slot)
    sides_on, starts_on = pack.get(side_slot), pack.get(start_slot)
    mirror = None  # each row's columns in order, or reversed where mirrored
    if steps[:, 2].any():
        mirror = _column_orders(device, size).index_select(0, flags[:, 2]).view(-1, 1, 1, size)
    out = None if len(spans) == 1 else torch.empty(len(images), 3, size, size, dtype=torch.uint8, device=device)
    for lo, hi in spans:
        hw = None if pad is None else pad(shapes[lo:hi])
        batch = padded(images[lo:hi], shapes[lo:hi], hw, sides_on[lo:hi], starts_on[lo:hi])
        resized = roi_align(batch, on_device[lo:hi], size, 1.0, -1, True)
        # a convex mix of uint8 values stays within [0, 255]: adding 0.5 and truncating rounds it
        chunk = _turned(resized.add_(0.5).to(torch.uint8), steps[lo:hi], flags[lo:hi])
        dest = None if out is None else out[lo:hi]
        if mirror is not None:  # one gather: every row's columns in its own order (reversed where mirrored)
            chunk = torch.gather(chunk, -1, mirror[lo:hi].expand_as(chunk), out=dest)
        elif dest is not None:
            dest.copy_(chunk)
        if out is None:
            return chunk
    assert out is not None
    return out


def _turned(chunk: torch.Tensor, steps: np.ndarray, flags: torch.Tensor) -> torch.Tensor:
    """The orientation's transpose and vertical flip, for the images whose ``steps`` say so (before the mirror)."""
    if steps[:, 0].any():
        chunk = torch.where(flags[:, 0].view(-1, 1, 1, 1) > 0, chunk.transpose(-1, -2), chunk)
    if steps[:, 1].any():
        chunk = torch.where(flags[:, 1].view(-1, 1, 1, 1) > 0, chunk.flip(-2), chunk)
    return chunk


@functools.lru_cache(maxsize=16)
def _column_orders(device: torch.device, size: int) -> torch.Tensor:
    """(2, size) int64 on ``device``: the columns in order, and reversed; made there once (no copy per batch)."""
    columns = torch.arange(size, device=device)
    return torch.stack([columns, columns.flip(0)])


def pad_crop_flip(
    images: list[torch.Tensor], rois: np.ndarray, steps: np.ndarray, shapes: np.ndarray, size: int, fill: str
) -> torch.Tensor:
    """The ``"pad"`` crop: each stored (3,H,W) uint8 image's S x S window (``rois`` from :func:`stored_rois`, which may
    reach past its edges: zeros there, or the image reflected about its edge, ``fill``), turned upright and flipped
    by its ``steps``, as (N,3,S,S) uint8. No resize: every pixel is gathered from one flat buffer of the batch by an
    index made on the device, a few ops for the batch, none per image."""
    device = images[0].device
    sides, starts = pad_arguments(shapes)
    pack = HostPack()
    corner_slot = pack.add(np.round(rois[:, 1::-1]), torch.int64)  # each window's top, left in stored pixels
    side_slot, start_slot, step_slot = (
        pack.add(sides, torch.int64),
        pack.add(starts, torch.int64),
        pack.add(steps, torch.int64),
    )
    pack.send(device)
    corner, sides_on, starts_on, flags = (pack.get(s) for s in (corner_slot, side_slot, start_slot, step_slot))
    span = torch.arange(size, device=device)
    h, w = sides_on[:, :1], sides_on[:, 1:]
    rows, rows_in = _folded(corner[:, :1] + span, h, fill)  # (N, S) each
    cols, cols_in = _folded(corner[:, 1:] + span, w, fill)
    at = (starts_on[:, None] + rows * w)[:, :, None] + cols[:, None, :]  # (N, S, S): channel 0's source pixel
    plane = (h * w)[:, :, None]
    flat = torch.cat([img.reshape(-1) for img in images])
    crops = torch.stack([flat[at + c * plane] for c in range(3)], 1)
    if fill == "zero":
        crops = torch.where((rows_in[:, :, None] & cols_in[:, None, :])[:, None], crops, 0)
    crops = _turned(crops, steps, flags)
    if steps[:, 2].any():
        mirror = _column_orders(device, size).index_select(0, flags[:, 2]).view(-1, 1, 1, size)
        crops = torch.gather(crops, -1, mirror.expand_as(crops))
    return crops


def _folded(index: torch.Tensor, length: torch.Tensor, fill: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, inside)``: where each of the rows (or columns) ``index`` of an image ``length`` long reads from, and
    whether it lies in the image: reflected about the edges (``fill="reflect"``), else clamped (and zeroed later)."""
    if fill == "reflect":
        index = index.abs()
        index = torch.where(index >= length, 2 * (length - 1) - index, index)
        return index, torch.ones_like(index, dtype=torch.bool)
    inside = (index >= 0) & (index < length)
    return torch.minimum(index.clamp(min=0), length - 1), inside
