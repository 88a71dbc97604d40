"""The backend registry: each backend module declares one :class:`BackendSpec`, and everything that picks a backend
(``build_loader``, ``read_image``, ``gpupipe bench``, ``gpupipe info``, the CLI, the tests) reads it from here.

Adding a backend is one module that defines a ``SPEC`` and one line in ``gpupipe/backends/__init__.py`` (or a call
to :func:`register` from user code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..data.loader import Loader, LoaderParts
    from ..image import ForCrop, Slot
    from ..recipe import Box


class Decoder(Protocol):
    """A CPU decoder (``pillow``, ``pillow-simd``, ``turbojpeg``): one image at a time, in DataLoader workers, so it
    must pickle. Two methods: ``decode`` (everything before the resize: ``read_image``, header checks, the bench's
    decode-only pipelines) and ``crop`` (the loaders' one entry point). Each raises
    :class:`~gpupipe.errors.DecodeError` naming the file for bad data."""

    name: str  # the backend's name, for errors and counters

    def decode(self, data: bytes, path: str, plan: Callable[[int, int], Box] | None = None, size: int = 0) -> ForCrop:
        """Everything before the resize: the image RGB and upright, as an (H, W, 3) uint8 array or a PIL image. With
        ``plan``, ``plan(height, width)`` picks the crop from the upright size, and the image is decoded at the
        smallest scale that keeps that crop at least ``size``; without, the whole image at full scale."""
        ...

    def crop(
        self, data: bytes, path: str, plan: Callable[[int, int], Box], size: int, out: Slot | None = None
    ) -> tuple[Slot, bool]:
        """The recipe's output, written into ``out`` (an (S, S, 3) uint8 slot of a batch, an array or a tensor) or a
        new array: ((3, size, size) uint8, a view of it; whether a slower decoder had to take the file)."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    """One backend, declared once, in its own module.

    Attributes:
        name: the lower-case name users pass as ``backend=``.
        summary: one line for ``gpupipe info`` and error messages.
        devices: where its batches can be delivered (``"cpu"``, ``"cuda"``).
        unavailable: ``None`` when it can be built here, else why not and the install command. Must not import the
            backend's library (``importlib.util.find_spec`` is the tool).
        make_loader: builds its :class:`~gpupipe.data.loader.Loader` from the parts ``build_loader`` prepared.
        read: ``(data, name, max_pixels, device) -> (3, H, W) uint8`` for ``read_image``; ``None``: not a decoder.
        decoder: ``(max_pixels, reduced_decode) -> decoder`` for backends that decode one image at a time on the
            CPU (``decode``/``crop``); the bench's ``floor`` pipeline uses it.
        dataloader_settings: the ``build_loader`` DataLoader settings it honours (of ``pin_memory``,
            ``prefetch_factor``, ``persistent_workers``); the others, set explicitly, are refused.
    """

    name: str
    summary: str
    devices: tuple[str, ...]
    unavailable: Callable[[], str | None]
    make_loader: Callable[[LoaderParts], Loader]
    read: Callable[[bytes, str, int | None, torch.device], torch.Tensor] | None = None
    decoder: Callable[[int | None, bool], Decoder] | None = None
    dataloader_settings: tuple[str, ...] = ()


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec, override: bool = False) -> BackendSpec:
    """Add a backend; its name becomes valid everywhere a backend is named. A name already registered is refused
    unless ``override`` (then the new spec replaces the old one, in its place in the order)."""
    if spec.name != spec.name.lower() or spec.name == "auto":
        raise ValueError(f"a backend name is lower case and not 'auto', got {spec.name!r}")
    if spec.name in _REGISTRY and not override:
        raise ValueError(f"backend {spec.name!r} is already registered; pass override=True to replace it")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered backend, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> BackendSpec:
    """The spec of ``name``; ``ValueError`` listing the valid names for anything else (``auto`` is resolved by the
    caller)."""
    try:
        return _REGISTRY[name.lower()]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(('auto', *_REGISTRY))}") from None
