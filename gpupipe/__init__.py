"""gpupipe: one loader API over Pillow, pillow-simd, TurboJPEG, DALI and nvJPEG, for GPU-starved training."""

from ._version import __version__
from .api import build_loader, read_image
from .backends import available_backends
from .data.objstore import Remote
from .errors import BackendUnavailableError, DecodeError, GpupipeError, StorageError, TransformError
from .mix import Mix
from .recipe import Recipe

__all__ = [
    "BackendUnavailableError",
    "DecodeError",
    "GpupipeError",
    "Mix",
    "Recipe",
    "Remote",
    "StorageError",
    "TransformError",
    "__version__",
    "available_backends",
    "build_loader",
    "read_image",
]
