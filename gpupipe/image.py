"""What every CPU decoder shares: header probing (size, EXIF orientation, pixel limit), colour conversion
to RGB, and the one-pass crop + resize that turns a decoded image into the recipe's output."""

from __future__ import annotations

import functools
import io
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .errors import DecodeError
from .recipe import Box

# EXIF orientation -> the transpose that makes the image upright (PIL.ImageOps.exif_transpose's table)
_ORIENT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_JPEG_MAGIC = b"\xff\xd8\xff"


class ForCrop(NamedTuple):
    """What a decoder's ``decode`` gives: everything before the resize."""

    image: np.ndarray | Image.Image  # RGB, upright; a JPEG maybe decoded at a reduced DCT scale
    box: Box  # the recipe's crop (the whole image when none was planned), in full-size upright pixels
    upright_hw: tuple[int, int]  # the full-size upright (height, width)
    fell_back: bool  # a slower decoder had to take the file


Slot = np.ndarray | torch.Tensor  # an (S, S, 3) uint8 image a decoder's ``crop`` writes into: a batch's slot


def whole(height: int, width: int) -> Box:
    """The box of a whole (height, width) image: what ``decode`` gives when no crop is planned."""
    return Box(0, 0, height, width)


def chw_view(out: Slot) -> Slot:
    """An (S, S, 3) image seen as (3, S, S), no copy."""
    return out.permute(2, 0, 1) if isinstance(out, torch.Tensor) else out.transpose(2, 0, 1)


def default_max_pixels() -> int:
    """PIL's own decompression-bomb limit, so every backend refuses what Pillow would warn about."""
    return Image.MAX_IMAGE_PIXELS or 2**31


@dataclass
class Header:
    """What the file's header says, read before any pixel is decoded."""

    image: Image.Image  # opened lazily: the pixels are not decoded yet
    width: int  # raw, before orientation
    height: int
    orientation: int
    is_jpeg: bool

    @property
    def upright_size(self) -> tuple[int, int]:
        """(height, width) once EXIF orientation is applied."""
        return upright_hw(self.height, self.width, self.orientation)


def upright_hw(height: int, width: int, orientation: int) -> tuple[int, int]:
    """(height, width) once EXIF orientation is applied: orientations 5-8 swap the sides."""
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def pixel_limit_reason(width: int, height: int, max_pixels: int) -> str | None:
    """The one refusal message for images over the pixel limit, read from the header; None when within it."""
    if width * height > max_pixels:
        return f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}"
    return None


def probe(data: bytes, path: str, backend: str, max_pixels: int) -> Header:
    """Open the header with PIL (no decode), and refuse empty, unknown and too-large images up front."""
    if not data:
        raise DecodeError(path, backend, "empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies below
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise DecodeError(path, backend, "more pixels than PIL allows (decompression bomb)") from None
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise DecodeError(path, backend, _unreadable(e)) from None
    width, height = img.size
    if (reason := float_image_reason(img.mode)) is not None:
        raise DecodeError(path, backend, reason)
    if width < 1 or height < 1:
        raise DecodeError(path, backend, f"image has no pixels ({width}x{height})")
    if (reason := pixel_limit_reason(width, height, max_pixels)) is not None:
        raise DecodeError(path, backend, reason)
    return Header(img, width, height, orientation_to_apply(img), img.format == "JPEG")


def _unreadable(e: Exception) -> str:
    """Why PIL could not open the data, without the ``<_io.BytesIO object at 0x...>`` it names in-memory input by."""
    if isinstance(e, Image.UnidentifiedImageError):
        return "not a readable image (no image format PIL knows starts this data)"
    if "Truncated File Read" in str(e):  # cut inside its header: one wording for a truncated file
        return TRUNCATED
    return f"not a readable image ({type(e).__name__}: {re.sub(r' ?<_io.BytesIO object at 0x[0-9a-f]+>', '', str(e))})"


TRUNCATED = "truncated (the data ends before the image does)"
# how each library says it: Pillow; libjpeg-turbo through TurboJPEG ("file") and through DALI's decoder ("data")
_TRUNCATION = ("image file is truncated", "Premature end of JPEG")


def decode_failure(e: BaseException | str) -> str:
    """Why a decoder failed, in one wording per cause whatever the library: a truncated file is :data:`TRUNCATED`
    on every backend; the decoder stopped by the data (an ``OSError``: Pillow's "broken data stream", libjpeg's "Bogus
    Huffman table definition") is corrupt image data, in the library's words; any other cause as the library says it
    (a warning made an error without its class name)."""
    if isinstance(e, str) or isinstance(e, Warning):
        text = str(e)
    else:
        text = f"corrupt image data ({e})" if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    return TRUNCATED if any(words in text for words in _TRUNCATION) else text


def float_image_reason(mode: str) -> str | None:
    """The rule for floating-point images (TIFF mode ``F``), the same on every backend: refused, as their value range
    (0-1? 0-255? HDR?) says nothing about which 8-bit value a pixel is. Integer modes are scaled (see ``to_rgb``)."""
    if mode == "F":
        return (
            "a floating-point image (mode F): its value range does not say which 8-bit colour a pixel is; "
            "convert it to 8- or 16-bit integers first"
        )
    return None


def _orientation(read_exif: Callable[[], Image.Exif]) -> int:
    """The EXIF orientation (1-8); 1 when there is none or the block is broken (not a broken image: upright)."""
    try:
        orientation = int(read_exif().get(0x0112, 1))
    except Exception:
        return 1
    return orientation if orientation in _ORIENT else 1


def orientation_to_apply(img: Image.Image) -> int:
    """The EXIF orientation still to apply to ``img`` once loaded: 1 where Pillow turns the image itself (a TIFF, on
    Pillow versions whose TIFF loader applies the tag; its size is then upright already, before the load)."""
    if img.format == "TIFF" and _pillow_turns_tiff():
        return 1
    return _orientation(img.getexif)


@functools.cache
def _pillow_turns_tiff() -> bool:
    """Whether this Pillow applies a TIFF's orientation itself (recent versions do; older ones leave it to the
    caller, as for JPEG, PNG and WebP): asked of a 2 x 1 TIFF whose tag turns it."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("L", (2, 1)).save(buf, "TIFF", exif=exif)
    with Image.open(buf) as img:
        return img.size == (1, 2)


# What DALI's image decoders take (as PIL names the format); the rest (GIF, ICO, float TIFF...) Pillow decodes.
PIPELINE_FORMATS = frozenset({"JPEG", "MPO", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000"})
PILLOW_ONLY_MODES = frozenset({"F", "I"})  # 32-bit pixels: one rule on every backend, Pillow's


class HeaderCheck(NamedTuple):
    """One file judged from its header alone: its upright size, whether only Pillow should decode it, its EXIF
    orientation and PIL mode, or why it cannot be decoded (``problem``; then the size is 0 x 0)."""

    height: int = 0
    width: int = 0
    pillow_only: bool = False
    problem: str | None = None
    orientation: int = 1
    mode: str = ""


def header_entry(src: str | bytes, max_pixels: int) -> HeaderCheck:
    """One file judged from its header alone (PIL reads only the first bytes): its upright (height, width) and
    whether only Pillow should decode it, or why it cannot be decoded (empty, not an image, over the pixel limit)."""
    if isinstance(src, bytes) and not src:
        return HeaderCheck(problem="empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(src if isinstance(src, str) else io.BytesIO(src)) as img:
                (width, height), mode = img.size, img.mode
                if (reason := float_image_reason(mode)) is not None:
                    return HeaderCheck(problem=reason)
                orientation = orientation_to_apply(img)
                pillow_only = img.format not in PIPELINE_FORMATS or mode in PILLOW_ONLY_MODES
    except Image.DecompressionBombError:
        return HeaderCheck(problem="more pixels than PIL allows (decompression bomb)")
    except OSError as e:
        if isinstance(src, str) and os.path.exists(src) and os.path.getsize(src) == 0:
            return HeaderCheck(problem="empty file")
        if isinstance(src, str) and not os.path.exists(src):
            return HeaderCheck(problem="cannot read the file (no such file)")
        return HeaderCheck(problem=_unreadable(e))
    except Exception as e:  # PIL raises SyntaxError, ValueError... on broken headers
        return HeaderCheck(problem=_unreadable(e))
    if (reason := pixel_limit_reason(width, height, max_pixels)) is not None:
        return HeaderCheck(problem=reason)
    return HeaderCheck(*upright_hw(height, width, orientation), pillow_only, None, orientation, mode)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB; 16-bit and 32-bit integer images are scaled, not clipped."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img)
        shift = 8 if img.mode.startswith("I;16") or arr.max(initial=0) < 65536 else 24
        return Image.fromarray((arr >> shift).clip(0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        return img.convert("RGBA").convert("RGB")  # drop alpha as torchvision's pil_loader does
    return img.convert("RGB")


def chw_tensor(img: np.ndarray | Image.Image) -> torch.Tensor:
    """An RGB PIL image or (H, W, 3) array as a contiguous, writable (3, H, W) uint8 tensor (a copy)."""
    # np.array copies even where the transpose is already contiguous (a 1x1 image), so the tensor never shares
    # PIL's read-only buffer
    return torch.from_numpy(np.array(np.asarray(img).transpose(2, 0, 1), order="C"))


def upright(img: Image.Image, orientation: int) -> Image.Image:
    return img.transpose(_ORIENT[orientation]) if orientation != 1 else img


def resize_box(img: Image.Image, box: Box, upright_hw: tuple[int, int], size: int) -> np.ndarray:
    """Pillow's resampler: crop ``box`` (given in full-resolution upright pixels) out of ``img`` (possibly
    DCT-reduced) and resize it to ``size`` x ``size`` in one antialiased bilinear pass, mirrored when the box says
    so. pillow-simd uses this (its SIMD resampler is the reason to install it); the others use :func:`crop_resize`."""
    out = np.empty((size, size, 3), dtype=np.uint8)
    resize_box_into(img, box, upright_hw, out)
    return out.transpose(2, 0, 1)


def resize_box_into(img: Image.Image, box: Box, upright_hw: tuple[int, int], out: np.ndarray) -> None:
    """:func:`resize_box` written into ``out``, an (S, S, 3) uint8 slot of a batch."""
    size = out.shape[0]
    sy, sx = img.height / upright_hw[0], img.width / upright_hw[1]
    b = box.scaled(sy, sx)
    res = img.resize((size, size), Image.Resampling.BILINEAR, box=(b.left, b.top, b.left + b.width, b.top + b.height))
    if box.flip:
        res = res.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out[...] = np.asarray(res)


# EXIF orientation -> (transpose, mirror left-right, mirror top-bottom), applied in that order: the same result as
# _ORIENT's PIL transposes, for arrays and tensors (numpy views here, torch ops on the nvJPEG path)
ORIENT_STEPS = {
    2: (False, True, False),
    3: (False, True, True),
    4: (False, False, True),
    5: (True, False, False),
    6: (True, True, False),
    7: (True, True, True),
    8: (True, False, True),
}


def upright_array(arr: np.ndarray, orientation: int) -> np.ndarray:
    """An (H, W, 3) array turned upright: a view, copied later only where the crop needs it."""
    if orientation == 1:
        return arr
    transpose, mirror, flip = ORIENT_STEPS[orientation]
    if transpose:
        arr = arr.transpose(1, 0, 2)
    if mirror:
        arr = arr[:, ::-1]
    return arr[::-1] if flip else arr


def _as_tensor(region: np.ndarray) -> torch.Tensor:
    """An (H, W, 3) uint8 array as a contiguous channels-last (1, 3, H, W) tensor: torch's AVX2 uint8 resampler takes
    that layout, several times faster than Pillow's resampler (and than the same call on a strided view). A turned
    view (:func:`upright_array`: mirrored, flipped, transposed) is made contiguous by torch, not numpy: numpy copies a
    reversed or transposed uint8 view element by element, several times slower (bench/README.md, "A turned window
    made contiguous by torch")."""
    flips = [axis for axis in (0, 1) if region.strides[axis] < 0]
    if region.flags.c_contiguous and not flips:
        return _from_numpy(region).permute(2, 0, 1).unsqueeze(0)
    forward = region[:: -1 if 0 in flips else 1, :: -1 if 1 in flips else 1]  # the same pixels, strides positive
    x = _from_numpy(forward).contiguous()
    x = x.flip(flips) if flips else x
    return x.permute(2, 0, 1).unsqueeze(0)


def _from_numpy(region: np.ndarray) -> torch.Tensor:
    if region.flags.writeable:
        return torch.from_numpy(region)
    with warnings.catch_warnings():  # Pillow hands out read-only arrays; the resampler only reads, so no copy is needed
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(region)


def _resize(region: np.ndarray, hw: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of an (H, W, 3) uint8 array, as torchvision's ``Resize`` on a uint8 tensor."""
    x = _as_tensor(region)
    if tuple(x.shape[2:]) == hw:
        return x
    return F.interpolate(x, size=hw, mode="bilinear", antialias=True, align_corners=False)


def resize_into(region: np.ndarray, out: torch.Tensor, flip: bool = False) -> None:
    """:func:`_resize` to ``out``'s size, written by the resampler straight into ``out`` ((S, S, 3) uint8); with
    ``flip``, resized into a scratch image and mirrored into ``out`` (one pass each, no allocation)."""
    x = _as_tensor(region)
    dest = _scratch(out) if flip else out
    slot = dest.permute(2, 0, 1).unsqueeze(0)  # channels-last (1, 3, S, S), as x
    if x.shape == slot.shape:
        slot.copy_(x)
    else:  # what F.interpolate(antialias=True) calls, with out=: no intermediate image
        torch.ops.aten._upsample_bilinear2d_aa.out(x, list(slot.shape[2:]), False, None, None, out=slot)
    if flip:
        torch.ops.aten.flip.out(dest, [1], out=out)


_SCRATCH = threading.local()


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reusable image of ``like``'s shape, one per shape and thread: a process may crop on several threads at once
    (a dali or nvjpeg loader's own thread, another loader's, the held set's decode threads, the caller), and a scratch
    image shared between two of them gave one image the other's pixels."""
    key = tuple(like.shape)
    images: dict[tuple[int, ...], torch.Tensor] = _SCRATCH.__dict__.setdefault("images", {})
    if key not in images:
        images[key] = torch.empty(key, dtype=torch.uint8)
    return images[key]


def crop_resize(img: np.ndarray | Image.Image, box: Box, upright_hw: tuple[int, int], size: int) -> np.ndarray:
    """The recipe's crop + resize on a decoded, upright image (an (H, W, 3) uint8 array or an RGB PIL image,
    possibly DCT-reduced): a (3, size, size) array, mirrored when the box says so (see :func:`crop_resize_into`)."""
    out = torch.empty((size, size, 3), dtype=torch.uint8)
    crop_resize_into(img, box, upright_hw, out)
    return out.permute(2, 0, 1).numpy()


def crop_resize_into(img: np.ndarray | Image.Image, box: Box, upright_hw: tuple[int, int], out: torch.Tensor) -> None:
    """:func:`crop_resize` written into ``out``, an (S, S, 3) uint8 slot of a batch: the resampler writes into the
    slot itself (into a reused scratch image when the box mirrors it, then mirrored into the slot).

    A box in whole source pixels (the train recipe's) is cut out, then resized: torchvision's ``resized_crop``.
    After a DCT reduction it is rounded to the reduced image's pixel grid (at most half a pixel of a picture at
    least ``size`` wide). A fractional box (the eval recipe's centre crop, in source pixels) means "resize the whole
    image by the box's scale, then cut": exactly torchvision's ``Resize`` + ``CenterCrop``.
    """
    size = out.shape[0]
    h, w = (img.height, img.width) if isinstance(img, Image.Image) else img.shape[:2]
    sy, sx = h / upright_hw[0], w / upright_hw[1]
    if reaches_out(box, upright_hw):  # the "pad" crop: zeros or the reflected image past the edges
        cut = (round(box.top * sy), round(box.left * sx), round(box.height * sy), round(box.width * sx))
        resize_into(padded_window(np.asarray(img), *cut, box.fill), out, box.flip)
        return
    if (cut_out := pixel_window(box, upright_hw, (h, w))) is not None:
        top, left, bh, bw = cut_out
        # a PIL image is cut before it becomes an array, so only the crop's pixels are copied out of Pillow
        if isinstance(img, Image.Image):
            region = np.asarray(img.crop((left, top, left + bw, top + bh)))
        else:
            region = img[top : top + bh, left : left + bw]
        resize_into(region, out, box.flip)
        return
    (rh, rw), (top, left) = _resized_cut(box, upright_hw, (h, w), size)
    window = _resize(np.asarray(img), (rh, rw))[0, :, top : top + size, left : left + size]
    out.copy_((window.flip(-1) if box.flip else window).permute(1, 2, 0))


def _resized_cut(
    box: Box, upright_hw: tuple[int, int], hw: tuple[int, int], size: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A fractional box on a decoded image of ``hw``: the size the whole image is resized to, and the top-left corner
    of the ``size`` x ``size`` cut out of that (torchvision's ``Resize`` + ``CenterCrop``)."""
    (h, w), sy, sx = hw, hw[0] / upright_hw[0], hw[1] / upright_hw[1]
    fy, fx = size / (box.height * sy), size / (box.width * sx)
    rh, rw = round(h * fy), round(w * fx)
    return (rh, rw), (min(rh - size, round(box.top * sy * fy)), min(rw - size, round(box.left * sx * fx)))


def resized_cut_reads(box: Box, upright_hw: tuple[int, int], hw: tuple[int, int], size: int) -> Window | None:
    """The pixels of a decoded upright image of ``hw`` that :func:`crop_resize_into` reads for a fractional box's
    cut (the eval recipe's): the supports of its output rows and columns in the antialiased bilinear resize of the
    whole image (torch's ``_upsample_bilinear2d_aa``: input/output scale, a support of the scale when shrinking, one
    pixel when enlarging), with a pixel's margin each side. The resize of an image whose other pixels are anything
    gives the same cut, bit for bit. None for a box of whole pixels (:func:`pixel_window` cuts those) or one that
    reaches past the edges."""
    if reaches_out(box, upright_hw) or pixel_window(box, upright_hw, hw) is not None:
        return None
    resized, corner = _resized_cut(box, upright_hw, hw, size)
    spans = []
    for n_in, n_out, first in zip(hw, resized, corner, strict=True):
        scale = n_in / n_out
        support = max(scale, 1.0)
        lo = max(int(scale * (first + 0.5) - support + 0.5) - 1, 0)
        hi = min(int(scale * (first + size - 0.5) + support + 0.5) + 1, n_in)
        spans.append((lo, hi - lo))
    (top, height), (left, width) = spans
    return top, left, height, width


Window = tuple[int, int, int, int]  # (top, left, height, width) in pixels of a decoded image


def pixel_window(box: Box, upright_hw: tuple[int, int], hw: tuple[int, int]) -> Window | None:
    """The pixels of a decoded upright image of ``hw`` (the source's ``upright_hw``, or less after a DCT reduction)
    that a box in whole source pixels cuts out, rounded to that image's grid: what :func:`crop_resize_into` resizes.
    None for a box of fractions or one that reaches past the edges (those are not a cut of the image alone)."""
    if reaches_out(box, upright_hw) or not all(
        float(v).is_integer() for v in (box.top, box.left, box.height, box.width)
    ):
        return None
    (h, w), sy, sx = hw, hw[0] / upright_hw[0], hw[1] / upright_hw[1]
    bh, bw = min(h, max(1, round(box.height * sy))), min(w, max(1, round(box.width * sx)))
    return min(h - bh, round(box.top * sy)), min(w - bw, round(box.left * sx)), bh, bw


def stored_window(window: Window, orientation: int, hw: tuple[int, int]) -> Window:
    """The window of the stored image (before EXIF ``orientation`` turns it) that :func:`upright_array` turns into
    ``window`` of the upright image of ``hw``."""
    if orientation == 1:
        return window
    top, left, height, width = window
    transpose, mirror, flip = ORIENT_STEPS[orientation]
    top = hw[0] - top - height if flip else top
    left = hw[1] - left - width if mirror else left
    return (left, top, width, height) if transpose else (top, left, height, width)


def reaches_out(box: Box, upright_hw: tuple[int, int]) -> bool:
    """Whether ``box`` reaches past the edges of an image of ``upright_hw`` by half a pixel or more (a ``"pad"`` crop
    near an edge; a fractional box's rounding error stays inside)."""
    height, width = upright_hw
    return min(box.top, box.left) <= -0.5 or box.top + box.height >= height + 0.5 or box.left + box.width >= width + 0.5


def padded_window(arr: np.ndarray, top: int, left: int, height: int, width: int, fill: str) -> np.ndarray:
    """The ``height`` x ``width`` window at ``top, left`` of an (H, W, 3) image padded on every side: zeros past its
    edges (``fill="zero"``), or the image reflected about its edge rows and columns (``"reflect"``, the edge itself not
    repeated): torchvision's ``pad(padding_mode="constant" / "reflect")`` followed by the crop."""
    h, w = arr.shape[:2]
    pads = ((max(0, -top), max(0, top + height - h)), (max(0, -left), max(0, left + width - w)), (0, 0))
    if fill == "reflect":
        return np.pad(arr, pads, mode="reflect")[top + pads[0][0] :, left + pads[1][0] :][:height, :width]
    inside = arr[max(0, top) : top + height, max(0, left) : left + width]
    return np.pad(inside, pads)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == _JPEG_MAGIC


_EOI, _EOI_TAIL = b"\xff\xd9", 4096  # a whole JPEG ends with its end-of-image marker (trailing bytes allowed)


def ends_whole(data: bytes) -> bool:
    """Whether a JPEG's last ``_EOI_TAIL`` bytes hold its end-of-image marker. nvJPEG (the hardware decoder too) may
    decode a truncated baseline JPEG into grey rows without an error: one without the marker goes to Pillow, which
    decides (as the dali feed does). Given a whole file (not only its tail), the marker counts only after the header:
    an EXIF thumbnail's own end marker, inside the header, is no sign that a small file is whole."""
    start = 0
    if is_jpeg(data):
        for _, at, length in _jpeg_segments(data):
            start = at + length
    return ends_after(data, start)


def ends_after(data: bytes, start: int) -> bool:
    """:func:`ends_whole` of a JPEG whose header ends at ``start`` (known from a header read already)."""
    return data.rfind(_EOI, max(start, len(data) - _EOI_TAIL)) >= 0


ARITHMETIC_SOF = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})  # start-of-frame markers of arithmetic coding


def _jpeg_markers(data: bytes):
    """(marker, offset) of each marker of a JPEG's header, up to its first scan's (0xDA) included, read without
    touching the entropy-coded data (a "needle in data" search would scan megabytes of it). It ends where the bytes
    do, or where a marker is due and another byte is there: then ``(None, offset)`` comes last (a damaged header)."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            yield None, i
            return
        marker = data[i + 1]
        yield marker, i
        if marker == 0xDA:  # start of scan: the header is over
            return
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            i += 2
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")


def _jpeg_segments(data: bytes):
    """(marker, payload offset, payload length) of each segment before the first scan: the header."""
    for marker, i in _jpeg_markers(data):
        if marker is None or marker == 0xDA:
            return
        if marker != 0xFF and marker != 0x01 and not 0xD0 <= marker <= 0xD8:
            yield marker, i + 4, int.from_bytes(data[i + 2 : i + 4], "big") - 2


def jpeg_header_sound(data: bytes) -> bool:
    """Whether a JPEG's header, as far as ``data`` holds it, is a chain of marker segments up to its first scan's. A
    byte other than a marker's where one is due, a stuffed zero, an image's start or end, a restart marker or a length
    under 2 there is a damaged header (bytes overwritten), which PIL may still open (it skips what it does not know),
    as are quantization or Huffman tables that do not fill their segment exactly. DALI's decoder prints such a file on
    stderr ("[ERROR] [jpeg_parser] Invalid marker", "Bogus Huffman table definition") before it fails, so the dali
    backend gives it to Pillow, which decodes it or names the cause. True for bytes that are not a JPEG's, or that end
    before its header does (nothing to say from them)."""
    if not is_jpeg(data):
        return True
    for marker, i in _jpeg_markers(data):
        if marker is None or marker == 0x00 or 0xD0 <= marker <= 0xD9:
            return False
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:  # start of scan, the header's last segment: 1 to 4 components, 2 bytes each
            return i + 5 > len(data) or (1 <= data[i + 4] <= 4 and length == 6 + 2 * data[i + 4])
        if marker not in (0xFF, 0x01) and (
            length < 2 or not _tables_fill(marker, data[i + 4 : i + 2 + length], length - 2)
        ):
            return False
    return True


def _tables_fill(marker: int, payload: bytes, length: int) -> bool:
    """Whether a DQT (0xDB) or DHT (0xC4) segment's ``payload`` is whole tables that fill its ``length`` exactly
    (one cut short by the end of the bytes at hand counts as whole); other segments are not looked into."""
    if marker not in (0xDB, 0xC4):
        return True
    k = 0
    while k < len(payload):
        if marker == 0xDB:  # precision (8 or 16-bit entries) and id, then 64 entries
            if payload[k] >> 4 > 1:
                return False
            k += 1 + 64 * (2 if payload[k] >> 4 else 1)
        elif k + 17 > len(payload):
            return len(payload) < length
        else:  # class and id, 16 code counts, then as many symbols
            counts = sum(payload[k + 1 : k + 17])
            if payload[k] >> 4 > 1 or counts > 256:
                return False
            k += 17 + counts
    return k == length or (k > len(payload) and len(payload) < length)


def jpeg_sof(data: bytes) -> int | None:
    """The JPEG's start-of-frame marker (0xC0 baseline, 0xC2 progressive, 0xC9 arithmetic...); None when there is
    none before the first scan (PIL parses these too, but keeps only "progressive"). nvJPEG cannot decode arithmetic
    coding, so its path needs to know."""
    for marker, _, _ in _jpeg_segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker
    return None


def jpeg_exif_orientation(data: bytes) -> int:
    """The EXIF orientation of a JPEG, parsed from its first APP1 "Exif" block (the one Pillow reads) found by the
    header walk: no PIL open, no scan of the pixel data; 1 without one."""
    for marker, at, length in _jpeg_segments(data):
        if marker == 0xE1 and data[at : at + 6] == b"Exif\x00\x00":
            return exif_block_orientation(data[at : at + length])
    return 1


def exif_block_orientation(block: bytes) -> int:
    """The orientation an APP1 "Exif" block (from its ``Exif\\0\\0`` identifier on) holds; 1 when it holds none."""
    return _orientation(functools.partial(_exif_from_block, block))


def _exif_from_block(block: bytes) -> Image.Exif:
    exif = Image.Exif()
    exif.load(block)  # accepts the "Exif\0\0" identifier in front of the TIFF structure
    return exif
