"""The backend registry: names, availability (with the reason and the install command), and decoders."""

from __future__ import annotations

from typing import Literal

import torch

from .._deps import INSTALL_HINTS, has_module
from . import _fork  # noqa: F401  (registers the DALI fork guard)

BackendName = Literal["auto", "pillow", "pillow-simd", "turbojpeg", "dali", "nvjpeg", "synthetic"]
BACKENDS: tuple[str, ...] = ("pillow", "pillow-simd", "turbojpeg", "dali", "nvjpeg", "synthetic")
CPU_DECODERS: tuple[str, ...] = ("pillow", "pillow-simd", "turbojpeg")


def check_name(name: str) -> str:
    name = name.lower()
    if name not in BACKENDS and name != "auto":
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(('auto', *BACKENDS))}")
    return name


def unavailable_reason(name: str) -> str | None:
    """``None`` when ``name`` can be built here, else why not and how to fix it."""
    name = check_name(name)
    if name == "pillow-simd":
        from .pillow import pil_is_simd

        return None if pil_is_simd() else f"the installed PIL is not pillow-simd; {INSTALL_HINTS['pillow-simd']}"
    if name == "turbojpeg":
        try:
            from .turbojpeg import turbojpeg_handle

            turbojpeg_handle()
        except ModuleNotFoundError as e:
            return str(e)
        return None
    if name == "dali":
        return None if has_module("nvidia.dali") else f"DALI is not installed; {INSTALL_HINTS['dali']}"
    if name == "nvjpeg":
        return None if torch.cuda.is_available() else "needs a CUDA GPU (torchvision's nvJPEG decode runs on CUDA only)"
    return None


def available_backends() -> list[str]:
    """The backend names usable on this machine, in registry order."""
    return [name for name in BACKENDS if unavailable_reason(name) is None]


def require_backend(name: str) -> None:
    reason = unavailable_reason(name)
    if reason is not None:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")


def cpu_decoder(name: str, max_pixels: int | None = None, reduced_decode: bool = True):
    """The CPU decoder behind ``pillow``, ``pillow-simd`` or ``turbojpeg``."""
    require_backend(name)
    if name == "turbojpeg":
        from .turbojpeg import TurboJpegDecoder

        return TurboJpegDecoder(max_pixels, reduced_decode)
    if name in ("pillow", "pillow-simd"):
        from .pillow import PillowDecoder, PillowSimdDecoder

        return (PillowSimdDecoder if name == "pillow-simd" else PillowDecoder)(max_pixels, reduced_decode)
    raise ValueError(f"{name!r} is not a CPU decoder; CPU decoders: {', '.join(CPU_DECODERS)}")


def rule_of_thumb(device: torch.device) -> str:
    """The stated rule for ``backend="auto"`` when no benchmark result applies."""
    avail = available_backends()
    if device.type == "cuda" and "dali" in avail:
        return "dali"
    for name in ("turbojpeg", "pillow-simd"):
        if name in avail:
            return name
    return "pillow"
