"""The backends, and the questions asked of them by name: which exist, which work here (and if not, why and how to
install them), which decode on the CPU. Each backend is declared once, as a ``SPEC`` in its own module."""

from __future__ import annotations

from typing import Literal

from . import (
    _fork,  # noqa: F401  (registers the DALI fork guard)
    dali,
    nvjpeg,
    pillow,
    synthetic,
    turbojpeg,
)
from .registry import BackendSpec, Decoder, get, names, register, unregister

BackendName = Literal["auto", "pillow", "pillow-simd", "turbojpeg", "dali", "nvjpeg", "synthetic"]

# The built-in backends, in the order tables and ``available_backends()`` list them: one line each.
for _spec in (pillow.SPEC, pillow.SIMD_SPEC, turbojpeg.SPEC, dali.SPEC, nvjpeg.SPEC, synthetic.SPEC):
    register(_spec)

__all__ = [
    "BackendName",
    "BackendSpec",
    "Decoder",
    "available_backends",
    "check_name",
    "cpu_decoder",
    "cpu_decoders",
    "get",
    "names",
    "register",
    "require_backend",
    "unavailable_reason",
    "unregister",
]


def check_name(name: str) -> str:
    """``name`` in lower case when it is a registered backend or ``auto``; ``ValueError`` listing them otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"backend must be a name, one of {', '.join([*names(), 'auto'])}; got {name!r}")
    name = name.lower()
    return name if name == "auto" else get(name).name


def unavailable_reason(name: str) -> str | None:
    """``None`` when ``name`` can be built here, else why not and how to fix it."""
    return get(name).unavailable()


def available_backends() -> list[str]:
    """The backend names usable on this machine, in registry order."""
    return [name for name in names() if unavailable_reason(name) is None]


def cpu_decoders() -> list[str]:
    """The registered backends that decode one image at a time on the CPU (the bench's ``floor`` pipeline)."""
    return [name for name in names() if get(name).decoder is not None]


def require_backend(name: str) -> BackendSpec:
    spec = get(name)
    reason = spec.unavailable()
    if reason is not None:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    return spec


def cpu_decoder(name: str, max_pixels: int | None = None, reduced_decode: bool = True) -> Decoder:
    """The CPU decoder behind ``pillow``, ``pillow-simd``, ``turbojpeg`` (or a registered one)."""
    spec = require_backend(name)
    if spec.decoder is None:
        raise ValueError(f"{name!r} is not a CPU decoder; CPU decoders: {', '.join(cpu_decoders())}")
    return spec.decoder(max_pixels, reduced_decode)
