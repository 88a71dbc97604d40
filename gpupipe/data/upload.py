"""One host-to-device copy per batch for everything small: labels, sample keys, augmentation arguments.

Each ``tensor.to("cuda")`` from pageable memory is a copy the host waits for, and each ``torch.tensor(...,
device="cuda")`` is one more; a device stage that made a few dozen of them per batch waited on the GPU a few dozen
times a batch, so every batch waited for the previous training step. :class:`HostPack` gathers the batch's small
arrays on the host in one float64 buffer (pinned when the target is CUDA), sends it with one non-blocking copy and
hands back views of the device copy. float64 holds every int64 below 2**53 exactly (labels, indices, 31-bit seeds).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class Slot:
    """Where one array sits in the pack: ``pack.get(slot)`` after :meth:`HostPack.send`."""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype


class HostPack:
    """Collect arrays with :meth:`add`, then :meth:`send` once; read each back on the device with :meth:`get`."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0
        self._device: torch.Tensor | None = None

    def add(self, values: np.ndarray | torch.Tensor | Sequence, dtype: torch.dtype = torch.float64) -> Slot:
        """Queue ``values`` (any shape); :meth:`get` returns them as ``dtype`` on the device."""
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        arr = np.asarray(values, dtype=np.float64)
        slot = Slot(self._size, arr.shape, dtype)
        self._parts.append(arr.reshape(-1))
        self._size += arr.size
        return slot

    def send(self, device: torch.device) -> None:
        """One copy of everything queued to ``device``: pinned and non-blocking on CUDA, so the host never waits."""
        pinned = device.type == "cuda"
        host = torch.empty(max(1, self._size), dtype=torch.float64, pin_memory=pinned)
        if self._parts:
            np.concatenate(self._parts, out=host.numpy()[: self._size])
        # the caching host allocator keeps ``host`` until the copy has run, even once it is freed here
        self._device = host.to(device, non_blocking=True)

    def get(self, slot: Slot) -> torch.Tensor:
        assert self._device is not None, "send() first"
        n = int(np.prod(slot.shape, dtype=np.int64))
        view = self._device[slot.offset : slot.offset + n].view(slot.shape)
        return view if slot.dtype == torch.float64 else view.to(slot.dtype)


class Reaper:
    """Drops objects on a thread of its own: a batch's shared-memory buffer costs the thread that frees it 0.5-1.5 ms
    (unmapping), time the training thread need not spend."""

    def __init__(self) -> None:
        self._spent: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def drop(self, obj: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="gpupipe-reaper")
            self._thread.start()
        self._spent.put(obj)

    def _run(self) -> None:
        while True:
            self._spent.get()  # the object is dropped here
