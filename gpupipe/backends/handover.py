"""How a CPU decode worker hands a batch to the main process: written once into a shared-memory buffer that the worker
reuses, the labels and keys as bytes in the message.

A fresh shared-memory buffer costs a page fault per 4 KiB on its first write (about as much as resizing the images
into it on a 2-core VM: ~0.14 ms per 224x224 image, measured in bench/README.md), and a tensor handed over from
ordinary memory is first copied into one. So each worker keeps a few buffers and reuses one once the main process
says it is done with it: the batch arrives holding the buffer (``Batch.lease``), the main process copies the images
out once, into the memory they end in (``Batch.own``: page-locked memory on the DataLoader's pin thread, for the copy
to a GPU; ordinary memory otherwise; a plain memory copy, a tenth of that cost), and sets the buffer's "free" byte,
which the worker reads before it writes the buffer again.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from ..data.device import HostBlocks, Layout, copy_into, pinned_tensor
from ..data.loader import Batch

_HEADER = 64  # bytes before the data: [0] free flag (1: the main process is done), [1:9] the magic below
_MAGIC = np.frombuffer(b"gpupipe!", dtype=np.uint8)
_POOL_SIZE = 8  # per worker: more than the batches in flight (prefetch_factor per worker, the one being read)
_pool: list[torch.Tensor] = []  # this worker's buffers (flat uint8, header included)
# main process: the latest buffers stay mapped, so a reused one arrives without mmap and page faults (bounded: a
# worker that exited leaves its buffers here until newer ones push them out)
_mapped: deque[torch.Tensor] = deque(maxlen=2 * _POOL_SIZE)
_host_blocks = HostBlocks()  # main process: the memory of batches copied out for a CPU or meta device, reused


def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor: in a DataLoader worker, in one of the worker's shared-memory buffers (handed over
    without a copy; reused once the main process is done with it); in the main process, ordinary memory."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    flat = _free_buffer(nbytes)
    return flat[_HEADER:].view(dtype).view(shape)


def _free_buffer(nbytes: int) -> torch.Tensor:
    for flat in _pool:
        head = flat.numpy()
        if head[0] == 1 and flat.numel() == _HEADER + nbytes:
            head[0] = 0
            return flat
    storage = torch.UntypedStorage._new_shared(_HEADER + nbytes)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (_HEADER + nbytes,), (1,))
    flat.numpy()[: 1 + len(_MAGIC)] = np.concatenate([[0], _MAGIC])
    if len(_pool) < _POOL_SIZE:
        _pool.append(flat)
    elif (stale := next((i for i, f in enumerate(_pool) if f.numpy()[0] == 1), None)) is not None:
        _pool[stale] = flat  # a buffer of another size (a short last batch): replaced
    return flat


class WireBatch(Batch):
    """A worker's batch on its way to the main process: labels and keys travel as bytes in the message (a tensor
    would cost a shared-memory file and a file-descriptor round trip each)."""

    def __reduce__(self):
        keys = None if self.keys is None else self.keys.numpy()
        labels = self.labels.numpy()
        return arrive, (self.images, labels, self.layout, self.errors, self.fallbacks, keys, self.failure, self.stamps)


def arrive(
    images: torch.Tensor, labels: np.ndarray, layout: Layout, errors, fallbacks: int, keys, failure=None, stamps=None
) -> Batch:
    """The batch in the main process, its images still in the worker's buffer: ``Batch.own`` (or ``pin_memory``)
    copies them out and hands the buffer back, ``Batch.drop`` hands it back uncopied."""
    flat = _header(images)
    if flat is not None:
        _mapped.append(flat)  # its mapping stays: the next batch in it arrives without mapping or page faults
    keys_t = None if keys is None else torch.from_numpy(keys)
    batch = Batch(images, torch.from_numpy(labels), layout, errors, fallbacks, keys_t, failure, stamps=stamps)
    batch.lease = None if flat is None else _Lease(flat)
    return batch


class _Lease:
    """A worker's buffer lent to this process, handed back once: after its images are copied out, or when the batch
    holding it is dropped uncopied (a task skipped; DataLoader's reset discards the batches it finds in flight)."""

    __slots__ = ("_flat",)

    def __init__(self, flat: torch.Tensor):
        self._flat: torch.Tensor | None = flat

    def copy_out(self, images: torch.Tensor, pinned: bool) -> torch.Tensor:
        """``images`` (in the lent buffer) copied once into new memory of this process's own (page-locked with
        ``pinned``, where the pin thread calls it), then the buffer handed back."""
        out = (pinned_tensor if pinned else _host_blocks.take)(tuple(images.shape), images.dtype)
        copy_into(out, images)
        self.give_back()  # after the copy: the worker may write the buffer again
        return out

    def give_back(self) -> None:
        flat, self._flat = self._flat, None
        if flat is not None:
            flat.numpy()[0] = 1

    def __del__(self) -> None:
        self.give_back()


def release(images: torch.Tensor) -> None:
    """A worker is done with a buffer it will not hand over (its images were converted into another one)."""
    flat = _header(images)
    if flat is not None:
        flat.numpy()[0] = 1


def _header(images: torch.Tensor) -> torch.Tensor | None:
    """The header of the buffer that holds ``images``, when :func:`buffer` made it in a worker; else None."""
    storage = images.untyped_storage()
    if images.storage_offset() * images.element_size() < _HEADER or storage.nbytes() < _HEADER:
        return None
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (_HEADER,), (1,))
    return flat if (flat.numpy()[1 : 1 + len(_MAGIC)] == _MAGIC).all() else None
