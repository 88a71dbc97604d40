"""libjpeg-turbo through PyTurboJPEG (1.x on libjpeg-turbo 2.1, or 2.x on 3.x) for JPEGs; Pillow for the rest.

TurboJPEG cannot decode CMYK/YCCK JPEGs or non-JPEG files: those go to Pillow and are counted as fallbacks.
It decodes truncated data with only a warning, so warnings are errors here. It ignores EXIF orientation,
so the orientation read from the header is applied afterwards, as Pillow does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
from PIL import Image

from .._deps import require
from ..errors import DecodeError
from ..recipe import Box, dct_scale
from ._image import default_max_pixels, is_jpeg, probe, resize_box, upright
from .pillow import PillowDecoder

_TJ_MODES = ("RGB", "L")  # what TurboJPEG can turn into RGB; CMYK and YCCK cannot


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

    def __init__(self, max_pixels: int | None = None, reduced_decode: bool = True):
        self.max_pixels = max_pixels or default_max_pixels()
        self.reduced_decode = reduced_decode
        self._fallback = PillowDecoder(self.max_pixels, reduced_decode)
        self._fallback.name = self.name
        self._tj = None
        turbojpeg_handle()  # fail at construction, in the main process, not in a worker

    def __getstate__(self):
        return {**self.__dict__, "_tj": None}  # ctypes handles do not pickle; each worker opens its own

    def _decode_array(self, data: bytes, path: str, denom: int) -> np.ndarray:
        if self._tj is None:
            from turbojpeg import TJPF_RGB

            self._tj, self._rgb = turbojpeg_handle(), TJPF_RGB
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a truncated JPEG is a warning in libjpeg-turbo
                return self._tj.decode(data, pixel_format=self._rgb, scaling_factor=(1, denom) if denom > 1 else None)
        except (OSError, Warning, ValueError) as e:
            raise DecodeError(path, self.name, f"{type(e).__name__}: {e}") from None

    def _usable(self, data: bytes, header) -> bool:
        return is_jpeg(data) and header.image.mode in _TJ_MODES

    def decode(self, data: bytes, path: str) -> Image.Image:
        header = probe(data, path, self.name, self.max_pixels)
        if not self._usable(data, header):
            return self._fallback.decode(data, path)
        return upright(Image.fromarray(self._decode_array(data, path, 1)), header.orientation)

    def crop(self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int) -> tuple[np.ndarray, bool]:
        header = probe(data, path, self.name, self.max_pixels)
        if not self._usable(data, header):
            return self._fallback.crop(data, path, plan, size)[0], True
        box = plan(*header.upright_size)
        denom = dct_scale(box, size) if self.reduced_decode else 1
        img = upright(Image.fromarray(self._decode_array(data, path, denom)), header.orientation)
        return resize_box(img, box, header.upright_size, size), False
