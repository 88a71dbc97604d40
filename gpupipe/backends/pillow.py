"""Pillow (and pillow-simd, which installs as the same ``PIL``): decode, crop-aware DCT-reduced JPEG decode, resize."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import PIL
import torch
from PIL import Image

from ..errors import DecodeError
from ..image import (
    ForCrop,
    Header,
    crop_resize_into,
    default_max_pixels,
    probe,
    resize_box_into,
    to_rgb,
    upright,
)
from ..recipe import Box, dct_scale
from .cpu import cpu_decoder_spec


def pil_is_simd() -> bool:
    """pillow-simd versions carry a ``.postN`` suffix that upstream Pillow never uses."""
    return ".post" in PIL.__version__


class PillowDecoder:
    """Decodes with whatever ``PIL`` is installed. Picklable, so DataLoader workers get their own copy."""

    name = "pillow"
    pil_resize = False  # torch's AVX2 uint8 resampler is several times faster than Pillow's

    def __init__(self, max_pixels: int | None = None, reduced_decode: bool = True):
        self.max_pixels = max_pixels or default_max_pixels()
        self.reduced_decode = reduced_decode

    def decode(self, data: bytes, path: str) -> Image.Image:
        """The whole image: RGB, upright."""
        return self.decode_opened(probe(data, path, self.name, self.max_pixels), path)

    def decode_opened(self, header: Header, path: str) -> Image.Image:
        """Finish decoding a probed file: load the pixels, RGB, upright."""
        return upright(to_rgb(self._load(header.image, path)), header.orientation)

    def decode_for_crop(self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int) -> ForCrop:
        """Everything before the resize: ``plan(height, width)`` picks the crop from the upright size, and the JPEG
        is decoded at the largest DCT reduction that keeps that crop at least ``size`` (``gpupipe bench``'s
        ``floor`` pipeline times this alone)."""
        header = probe(data, path, self.name, self.max_pixels)
        box = plan(*header.upright_size)
        img = header.image
        if header.is_jpeg and self.reduced_decode:
            denom = dct_scale(box, size)
            if denom > 1:  # libjpeg scales in the IDCT: 1/denom of the work, and no resolution the crop needs is lost
                img.draft(None, (header.width // denom, header.height // denom))
        return ForCrop(upright(to_rgb(self._load(img, path)), header.orientation), box, header.upright_size, False)

    def crop(self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int) -> tuple[np.ndarray, bool]:
        """``plan(height, width)`` picks the crop from the upright size; returns ((3, size, size) uint8, fell_back)."""
        out = np.empty((size, size, 3), dtype=np.uint8)
        fell_back = self.crop_into(data, path, plan, out)
        return out.transpose(2, 0, 1), fell_back

    def crop_into(self, data: bytes, path: str, plan: Callable[[int, int], Box], out: np.ndarray) -> bool:
        """:meth:`crop` written into ``out``, an (S, S, 3) uint8 slot of a batch (an array or a tensor); returns
        whether a slower decoder had to take the file."""
        img, box, upright_hw, fell_back = self.decode_for_crop(data, path, plan, out.shape[0])
        if self.pil_resize and isinstance(img, Image.Image):  # Pillow's decode_for_crop gives a PIL image
            resize_box_into(img, box, upright_hw, np.asarray(out))
        else:
            crop_resize_into(img, box, upright_hw, torch.as_tensor(out))
        return fell_back

    def _load(self, img: Image.Image, path: str) -> Image.Image:
        try:
            img.load()
        except Exception as e:  # truncated data, corrupt Huffman codes, unsupported variants...
            raise DecodeError(path, self.name, f"{type(e).__name__}: {e}") from None
        return img


class PillowSimdDecoder(PillowDecoder):
    name = "pillow-simd"
    pil_resize = True  # its SIMD resampler is the reason to install it


def _simd_unavailable() -> str | None:
    from .._deps import INSTALL_HINTS

    return None if pil_is_simd() else f"the installed PIL is not pillow-simd; {INSTALL_HINTS['pillow-simd']}"


SPEC = cpu_decoder_spec(
    "pillow",
    "Pillow in DataLoader workers: DCT-reduced JPEG decode, torch's AVX2 resampler",
    PillowDecoder,
    lambda: None,
)
SIMD_SPEC = cpu_decoder_spec(
    "pillow-simd",
    "pillow-simd in DataLoader workers: its SIMD resampler does crop + resize",
    PillowSimdDecoder,
    _simd_unavailable,
)
