"""One host-to-device copy per batch for everything small: labels, sample keys, augmentation arguments.

Each ``tensor.to("cuda")`` from pageable memory is a copy the host waits for, and each ``torch.tensor(...,
device="cuda")`` is one more; a device stage that made a few dozen of them per batch waited on the GPU a few dozen
times a batch, so every batch waited for the previous training step. :class:`HostPack` gathers the batch's small
arrays on the host in one byte buffer (pinned when the target is CUDA), each converted to its dtype there, sends it
with one non-blocking copy and hands back views of the device copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Slot:
    """Where one array sits in the pack: ``pack.get(slot)`` after :meth:`HostPack.send`."""

    __slots__ = ("count", "dtype", "offset", "shape")

    def __init__(self, offset: int, count: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.offset, self.count, self.shape, self.dtype = offset, count, shape, dtype


_NUMPY: dict[torch.dtype, np.dtype] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype not in _NUMPY:
        _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return _NUMPY[dtype]


class HostPack:
    """Collect arrays with :meth:`add`, then :meth:`send` once; read each back on the device with :meth:`get`.
    Each array is converted to its dtype on the host and stored as its bytes (8-byte aligned), so :meth:`get` is a
    view of the device copy: no conversion kernel per array."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0
        self._device: torch.Tensor | None = None

    def add(self, values: np.ndarray | torch.Tensor | Sequence, dtype: torch.dtype = torch.float64) -> Slot:
        """Queue ``values`` (any shape); :meth:`get` returns them as ``dtype`` on the device."""
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        arr = np.ascontiguousarray(values, dtype=_numpy_dtype(dtype))
        slot = Slot(self._size, arr.size, arr.shape, dtype)
        raw = arr.reshape(-1).view(np.uint8)
        self._parts.append(raw)
        self._size += raw.size
        if raw.size % 8:
            self._parts.append(np.zeros(8 - raw.size % 8, np.uint8))
            self._size += 8 - raw.size % 8
        return slot

    def send(self, device: torch.device) -> None:
        """One copy of everything queued to ``device``: pinned and non-blocking on CUDA, so the host never waits."""
        pinned = device.type == "cuda"
        host = torch.empty(max(8, self._size), dtype=torch.uint8, pin_memory=pinned)
        if self._parts:
            np.concatenate(self._parts, out=host.numpy()[: self._size])
        # the caching host allocator keeps ``host`` until the copy has run, even once it is freed here
        self._device = host.to(device, non_blocking=True)

    def get(self, slot: Slot) -> torch.Tensor:
        assert self._device is not None, "send() first"
        size = slot.count * _numpy_dtype(slot.dtype).itemsize
        return self._device[slot.offset : slot.offset + size].view(slot.dtype).view(slot.shape)
