"""What every CPU decoder shares: header probing (size, EXIF orientation, pixel limit), colour conversion
to RGB, and the one-pass crop + resize that turns a decoded image into the recipe's output."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import DecodeError
from ..recipe import Box

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
        return (self.width, self.height) if self.orientation in (5, 6, 7, 8) else (self.height, self.width)


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
        raise DecodeError(path, backend, f"not a readable image ({type(e).__name__}: {e})") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise DecodeError(path, backend, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise DecodeError(
            path, backend, f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}"
        )
    try:
        orientation = int(img.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block is not a broken image: treat it as upright
        orientation = 1
    return Header(img, width, height, orientation if orientation in _ORIENT else 1, img.format == "JPEG")


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


def upright(img: Image.Image, orientation: int) -> Image.Image:
    return img.transpose(_ORIENT[orientation]) if orientation != 1 else img


def resize_box(img: Image.Image, box: Box, upright_hw: tuple[int, int], size: int) -> np.ndarray:
    """Crop ``box`` (given in full-resolution upright pixels) out of ``img`` (possibly DCT-reduced) and resize it to
    ``size`` x ``size`` in one antialiased bilinear pass, then mirror it when the box says so."""
    sy, sx = img.height / upright_hw[0], img.width / upright_hw[1]
    b = box.scaled(sy, sx)
    out = img.resize((size, size), Image.Resampling.BILINEAR, box=(b.left, b.top, b.left + b.width, b.top + b.height))
    if box.flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == _JPEG_MAGIC
