"""One host-to-device copy per batch for everything small: labels, sample keys, augmentation arguments.

Each ``tensor.to("cuda")`` from pageable memory is a copy the host waits for, and each ``torch.tensor(...,
device="cuda")`` is one more; a device stage that made a few dozen of them per batch waited on the GPU a few dozen
times a batch, so every batch waited for the previous training step. :class:`HostPack` gathers the batch's small
arrays on the host in one float64 buffer (pinned when the target is CUDA), sends it with one non-blocking copy and
hands back views of the device copy. float64 holds every int64 below 2**53 exactly (labels, indices, 31-bit seeds).
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
    (unmapping), time the training thread need not spend.

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
