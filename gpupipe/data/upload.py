"""One host-to-device copy per batch for everything small: labels, sample keys, augmentation arguments.

Each ``tensor.to("cuda")`` from pageable memory is a copy the host waits for, and each ``torch.tensor(...,
device="cuda")`` is one more; a device stage that made a few dozen of them per batch waited on the GPU a few dozen
times a batch, so every batch waited for the previous training step. :class:`HostPack` gathers the batch's small
arrays on the host in one byte buffer (pinned when the target is CUDA), each converted to its dtype there, sends it
with one non-blocking copy and hands back views of the device copy.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

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


class Reaper:
    """Drops objects on a thread of its own: freeing a batch's shared-memory buffer costs the thread that frees it
    the unmapping (bench/README.md: figures behind the code), time the training thread need not spend.

    One thread per process, shared by every loader, and ended at interpreter exit (``atexit``: what is still queued
    is dropped, then the thread is joined). A daemon thread still running C++ code when the interpreter finalizes
    is ended by ``pthread_exit`` on its way back into Python, which aborts the process ("terminate called without
    an active exception") after a run that went well."""

    _lock = threading.Lock()
    _spent: queue.SimpleQueue[Any] | None = None
    _thread: threading.Thread | None = None

    def drop(self, obj: Any) -> None:
        cls = type(self)
        with cls._lock:
            if cls._thread is None or cls._spent is None:
                cls._spent = queue.SimpleQueue()
                cls._thread = threading.Thread(target=_reap, args=(cls._spent,), daemon=True, name="gpupipe-reaper")
                cls._thread.start()
            cls._spent.put(obj)

    @classmethod
    def stop(cls) -> None:
        """Drop what is queued and end the thread (at exit; a later :meth:`drop` starts a new one)."""
        with cls._lock:
            thread, spent, cls._thread, cls._spent = cls._thread, cls._spent, None, None
        if thread is not None and spent is not None:
            spent.put(_STOP)
            thread.join(timeout=10)

    @classmethod
    def _forget(cls) -> None:  # in a forked child: the parent's thread is not there
        cls._lock, cls._thread, cls._spent = threading.Lock(), None, None


_STOP = object()


def _reap(spent: queue.SimpleQueue[Any]) -> None:
    while spent.get() is not _STOP:  # each object is dropped here
        pass


atexit.register(Reaper.stop)
os.register_at_fork(after_in_child=Reaper._forget)
