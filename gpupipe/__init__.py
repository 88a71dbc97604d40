"""gpupipe: one loader API over Pillow, pillow-simd, TurboJPEG, DALI and nvJPEG, for GPU-starved training.

The names below torch is needed for are imported on first use (PEP 562), so ``gpupipe --version`` and
``import gpupipe.errors`` do not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__
from .errors import (
    BackendUnavailableError,
    DecodeError,
    GpupipeError,
    LoaderClosedError,
    MissingFileError,
    NoFullBatch,
    SourceError,
    StorageError,
    TransformError,
)

if TYPE_CHECKING:
    from .api import build_loader, read_image
    from .backends import available_backends
    from .mix import Mix
    from .recipe import Recipe, ResolutionSchedule
    from .sources.dataset import DatasetSource
    from .sources.objstore import Remote

_LAZY = {
    "build_loader": ".api",
    "read_image": ".api",
    "available_backends": ".backends",
    "Remote": ".sources.objstore",
    "DatasetSource": ".sources.dataset",
    "Mix": ".mix",
    "Recipe": ".recipe",
    "ResolutionSchedule": ".recipe",
}

__all__ = [
    "BackendUnavailableError",
    "DatasetSource",
    "DecodeError",
    "GpupipeError",
    "LoaderClosedError",
    "MissingFileError",
    "Mix",
    "NoFullBatch",
    "Recipe",
    "Remote",
    "ResolutionSchedule",
    "SourceError",
    "StorageError",
    "TransformError",
    "__version__",
    "available_backends",
    "build_loader",
    "read_image",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gpupipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
