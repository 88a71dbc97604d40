"""libjpeg-turbo through PyTurboJPEG (1.x on libjpeg-turbo 2.1, or 2.x on 3.x) for JPEGs; Pillow for the rest.

TurboJPEG cannot decode CMYK/YCCK JPEGs or non-JPEG files: those go to Pillow and are counted as fallbacks.
It decodes truncated data with only a warning, so warnings are errors here. It ignores EXIF orientation,
so the orientation read from the header is applied afterwards, as Pillow does.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .._deps import require
from ..errors import DecodeError
from ..image import (
    ForCrop,
    Slot,
    chw_view,
    crop_resize_into,
    decode_failure,
    default_max_pixels,
    ends_after,
    exif_block_orientation,
    is_jpeg,
    jpeg_exif_orientation,
    pixel_limit_reason,
    pixel_window,
    resize_into,
    resized_cut_reads,
    stored_window,
    upright_array,
    upright_hw,
    whole,
)
from ..recipe import Box, dct_scale
from .cpu import cpu_decoder_spec
from .pillow import PillowDecoder

try:
    from .. import _jpeg_window  # built with the package where libjpeg-turbo's headers were (setup.py)
except ImportError:  # not built: the whole image is decoded, then cut (the same pixels)
    _jpeg_window = None


def turbojpeg_handle():
    """A TurboJPEG instance, or an error with the install command when the module or the C library is missing."""
    require("turbojpeg", "turbojpeg")
    from turbojpeg import TurboJPEG  # defer: loads the C library

    try:
        return TurboJPEG()
    except (OSError, RuntimeError) as e:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"PyTurboJPEG cannot load libturbojpeg ({e}); apt-get install libturbojpeg0"
        ) from e


class TurboJpegDecoder:
    name = "turbojpeg"
    window_decode = _jpeg_window is not None  # decode only the crop's part of a JPEG (see :meth:`_window`)

    def __init__(self, max_pixels: int | None = None, reduced_decode: bool = True):
        self.max_pixels = max_pixels or default_max_pixels()
        self.reduced_decode = reduced_decode
        self._fallback = PillowDecoder(self.max_pixels, reduced_decode)
        self._fallback.name = self.name
        self._tj = None
        turbojpeg_handle()  # fail at construction, in the main process, not in a worker

    def __getstate__(self):
        return {**self.__dict__, "_tj": None}  # ctypes handles do not pickle; each worker opens its own

    def _handle(self):
        if self._tj is None:
            from turbojpeg import TJCS_CMYK, TJCS_YCCK, TJPF_RGB

            self._tj, self._rgb, self._no_rgb = turbojpeg_handle(), TJPF_RGB, (TJCS_CMYK, TJCS_YCCK)
        return self._tj

    def _decode_array(self, data: bytes, path: str, denom: int) -> np.ndarray:
        tj = self._handle()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a truncated JPEG is a warning in libjpeg-turbo
                return tj.decode(data, pixel_format=self._rgb, scaling_factor=(1, denom) if denom > 1 else None)
        except (OSError, Warning, ValueError) as e:
            raise DecodeError(path, self.name, decode_failure(e)) from None

    def _header(self, data: bytes, path: str) -> _Header | None:
        """The header as libjpeg-turbo's TurboJPEG reads it (C, no Python marker parsing), or None when TurboJPEG
        cannot take the file (not a JPEG, CMYK/YCCK, no frame header, or a header it rejects: Pillow then decides)."""
        if not is_jpeg(data):
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # libjpeg-turbo warns about some broken headers
                width, height, _, colorspace = self._handle().decode_header(data)
        except (OSError, Warning):
            return None
        if colorspace in self._no_rgb or not width or not height:  # 0 x 0: a JPEG cut before its frame header
            return None
        return self._checked(_Header(height, width, jpeg_exif_orientation(data)), path)

    def _window_header(self, data: bytes, path: str) -> _Header | None:
        """As :meth:`_header`, read by the window decode's module in one call (libjpeg's own header reader, which
        also says where the header ends and hands over the EXIF block): None where it is not built or TurboJPEG's
        header reader would decide otherwise (:meth:`decode` then does, with TurboJPEG's own)."""
        if not self.window_decode or not is_jpeg(data):
            return None
        try:
            height, width, cmyk, end, exif = _jpeg_window.header(data)
        except (OSError, RuntimeWarning):
            return None
        if cmyk or not width or not height:
            return None
        orientation = 1 if exif is None else exif_block_orientation(exif)
        return self._checked(_Header(height, width, orientation, ends_after(data, end)), path)

    def _checked(self, header: _Header, path: str) -> _Header:
        if (reason := pixel_limit_reason(header.width, header.height, self.max_pixels)) is not None:
            raise DecodeError(path, self.name, reason)
        return header

    def decode(self, data: bytes, path: str, plan: Callable[[int, int], Box] | None = None, size: int = 0) -> ForCrop:
        """As :meth:`PillowDecoder.decode`; the image is an (H, W, 3) array here (a view when turned; a PIL image
        when Pillow took the file, and then ``fell_back`` is True)."""
        header = self._header(data, path)
        if header is None:
            return self._fallback.decode(data, path, plan, size)._replace(fell_back=True)
        size_hw, box, denom = self._planned(header, plan, size)
        return ForCrop(upright_array(self._decode_array(data, path, denom), header.orientation), box, size_hw, False)

    def _planned(
        self, header: _Header, plan: Callable[[int, int], Box] | None, size: int
    ) -> tuple[tuple[int, int], Box, int]:
        """(upright size, box, DCT reduction) of an image whose header is ``header``."""
        size_hw = header.upright
        box = whole(*size_hw) if plan is None else plan(*size_hw)
        return size_hw, box, dct_scale(box, size) if plan is not None and self.reduced_decode else 1

    def crop(
        self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int, out: Slot | None = None
    ) -> tuple[Slot, bool]:
        """As :meth:`PillowDecoder.crop`: the crop resized straight into ``out`` (or a new array). Only the crop's
        part of the image is decoded where :meth:`_window` can; else :meth:`decode` decodes it whole."""
        out = np.empty((size, size, 3), dtype=np.uint8) if out is None else out
        if (header := self._window_header(data, path)) is not None:
            size_hw, box, denom = self._planned(header, plan, size)
            if (region := self._window(data, path, header, box, denom)) is not None:
                resize_into(region, torch.as_tensor(out), box.flip)
                return chw_view(out), False
            if (canvas := self._cut_reads(data, path, header, box, denom, size)) is not None:
                crop_resize_into(canvas, box, size_hw, torch.as_tensor(out))
                return chw_view(out), False
        img, box, size_hw, fell_back = self.decode(data, path, plan, size)
        crop_resize_into(img, box, size_hw, torch.as_tensor(out))
        return chw_view(out), fell_back

    def _window(self, data: bytes, path: str, header: _Header, box: Box, denom: int) -> np.ndarray | None:
        """The box's pixels alone, upright, from libjpeg-turbo's window decode (gpupipe/_jpeg_window.c: the rows
        above the box entropy-decoded only, those below not at all), the same pixels as the whole image's decode
        cut; None where the whole image is decoded instead: a box that is not a cut of the image (a fraction, past
        its edges), or a file without its end marker (the whole decode judges a truncated file, whatever the crop).
        Corrupt data above the box or in it is an error, as in the whole decode; below it, it goes unnoticed (the
        crop's pixels are whole), as in DALI's region decode (Pillow and DALI accept corrupt data anywhere)."""
        height, width, orientation, ends = header
        reduced = upright_hw(-(-height // denom), -(-width // denom), orientation)  # libjpeg rounds up
        window = pixel_window(box, header.upright, reduced)
        if window is None or not ends:
            return None
        top, left, h, w = stored_window(window, orientation, reduced)
        region = self._decode_window(data, path, denom, (top, left, h, w))
        return upright_array(region, orientation)

    def _decode_window(self, data: bytes, path: str, denom: int, window: tuple[int, int, int, int]) -> np.ndarray:
        """The stored image's ``window`` (top, left, height, width) at ``1/denom``, from the window decode."""
        top, left, h, w = window
        region = np.empty((h, w, 3), dtype=np.uint8)
        try:
            _jpeg_window.decode_window(data, denom, top, left, h, w, region)
        except (OSError, RuntimeWarning) as e:  # as PyTurboJPEG's errors and warnings
            raise DecodeError(path, self.name, decode_failure(e)) from None
        return region

    def _cut_reads(self, data: bytes, path: str, header: _Header, box: Box, denom: int, size: int) -> np.ndarray | None:
        """A fractional box (the eval recipe's resize + centre crop): an image of the decoded size in which only the
        pixels that the cut's resize reads are decoded (:func:`~gpupipe.image.resized_cut_reads`; the rows below
        them not at all, the columns beside them entropy-decoded only), which :func:`crop_resize_into` resizes to
        the whole decode's cut, bit for bit. None where the whole image is decoded instead (a turned image, a box
        of whole pixels or past the edges, a file without its end marker)."""
        height, width, orientation, ends = header
        if orientation != 1 or not ends:
            return None
        hw = (-(-height // denom), -(-width // denom))  # libjpeg rounds up
        if (reads := resized_cut_reads(box, header.upright, hw, size)) is None:
            return None
        top, left, h, w = reads
        region = self._decode_window(data, path, denom, (top, left, h, w))
        canvas = _canvas(hw)
        canvas[top : top + h, left : left + w] = region
        return canvas


_CANVAS = threading.local()


def _canvas(hw: tuple[int, int]) -> np.ndarray:
    """A reused (H, W, 3) uint8 image of this thread's (what is in it is whatever the last image left): one buffer,
    grown to the largest image seen, so that an eval crop allocates nothing of the image's size."""
    need = hw[0] * hw[1] * 3
    buf = getattr(_CANVAS, "buf", None)
    if buf is None or buf.size < need:
        buf = _CANVAS.buf = np.empty(need, dtype=np.uint8)
    return buf[:need].reshape(hw[0], hw[1], 3)


class _Header(NamedTuple):
    """What a decode needs from a JPEG's header: its stored size, its EXIF orientation, and whether it ends with its
    end-of-image marker after the header (:func:`~gpupipe.image.ends_whole`; None where the header reader did not
    say)."""

    height: int
    width: int
    orientation: int
    ends: bool | None = None

    @property
    def upright(self) -> tuple[int, int]:
        return upright_hw(self.height, self.width, self.orientation)


def _unavailable() -> str | None:
    try:
        turbojpeg_handle()
    except ModuleNotFoundError as e:  # BackendUnavailableError included
        return str(e)
    return None


SPEC = cpu_decoder_spec(
    "turbojpeg",
    "libjpeg-turbo (PyTurboJPEG) in DataLoader workers: header in C, DCT-scaled decode; Pillow for the rest",
    TurboJpegDecoder,
    _unavailable,
)
