"""gpupipe: one loader API over Pillow, pillow-simd, TurboJPEG, DALI and nvJPEG, for GPU-starved training."""

from .api import build_loader, read_image
from .backends import available_backends
from .errors import BackendUnavailableError, DecodeError, GpupipeError
from .mix import Mix
from .recipe import Recipe

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailableError",
    "DecodeError",
    "GpupipeError",
    "Mix",
    "Recipe",
    "__version__",
    "available_backends",
    "build_loader",
    "read_image",
]
