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
    Slot,
    chw_view,
    crop_resize_into,
    decode_failure,
    default_max_pixels,
    probe,
    reaches_out,
    resize_box_into,
    to_rgb,
    upright,
    whole,
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

    def decode(self, data: bytes, path: str, plan: Callable[[int, int], Box] | None = None, size: int = 0) -> ForCrop:
        """Everything before the resize, RGB and upright (a PIL image). With ``plan``, ``plan(height, width)`` picks
        the crop from the upright size, and a JPEG is decoded at the largest DCT reduction that keeps that crop at
        least ``size`` (``gpupipe bench``'s ``floor`` pipeline times this alone); without, the whole image at full
        scale, its box the whole image."""
        header = probe(data, path, self.name, self.max_pixels)
        size_hw = header.upright_size
        box = whole(*size_hw) if plan is None else plan(*size_hw)
        img = header.image
        if plan is not None and header.is_jpeg and self.reduced_decode:
            denom = dct_scale(box, size)
            if denom > 1:  # libjpeg scales in the IDCT: 1/denom of the work, and no resolution the crop needs is lost
                img.draft(None, (header.width // denom, header.height // denom))
        return ForCrop(upright(to_rgb(self._load(img, path)), header.orientation), box, size_hw, False)

    def decode_opened(self, header: Header, path: str) -> Image.Image:
        """Finish decoding a probed file (the whole image): load the pixels, RGB, upright."""
        return upright(to_rgb(self._load(header.image, path)), header.orientation)

    def crop(
        self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int, out: Slot | None = None
    ) -> tuple[Slot, bool]:
        """The recipe's output: ``plan(height, width)`` picks the crop from the upright size, resized to ``size``
        straight into ``out`` (an (S, S, 3) uint8 slot of a batch, an array or a tensor; else a new array). Returns
        ((3, size, size) uint8, a view of that slot; whether a slower decoder had to take the file)."""
        out = np.empty((size, size, 3), dtype=np.uint8) if out is None else out
        img, box, upright_hw, fell_back = self.decode(data, path, plan, size)
        # Pillow's decode gives a PIL image; its resampler would stretch the edge over a box past the image
        if self.pil_resize and isinstance(img, Image.Image) and not reaches_out(box, upright_hw):
            resize_box_into(img, box, upright_hw, np.asarray(out))
        else:
            crop_resize_into(img, box, upright_hw, torch.as_tensor(out))
        return chw_view(out), fell_back

    def _load(self, img: Image.Image, path: str) -> Image.Image:
        try:
            img.load()
        except Exception as e:  # truncated data, corrupt Huffman codes, unsupported variants...
            raise DecodeError(path, self.name, decode_failure(e)) from None
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
