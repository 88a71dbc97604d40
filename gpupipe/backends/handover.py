"""How a decode worker hands a batch to the main process: written once into a shared-memory buffer that the worker
reuses, the labels and keys as bytes in the message. A CPU decoder's images (:func:`buffer`, :class:`WireBatch`), and
a GPU feed's encoded files, whose byte count changes each batch (:func:`lent`, :func:`arrived`).

A fresh shared-memory buffer costs a page fault per 4 KiB on its first write (about as much as resizing the images
into it: bench/README.md), and a tensor handed over from
ordinary memory is first copied into one. So each worker keeps a few buffers and reuses one once the main process
says it is done with it: the batch arrives holding the buffer (``Batch.lease``), the main process copies the images
out once, into the memory they end in (``Batch.own``: page-locked memory on the DataLoader's pin thread, for the copy
to a GPU; ordinary memory otherwise; a plain memory copy, a tenth of that cost), and sets the buffer's "free" byte,
which the worker reads before it writes the buffer again.

Torch shares such a buffer by name (a ``torch_*`` file in /dev/shm, the "file_system" strategy) and removes the file
when the last reference to it goes: each process that maps it, and each message that carries it but was not read. So
a worker, as it exits, lets go of its buffers and of the messages it sent that the main process will never read now
(the loader's iteration ended); the main process lets go of its mappings when it ends the iteration
(:func:`let_go`); and a buffer that /dev/shm had no room for is removed at once (torch leaves its file behind).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import deque
from multiprocessing.util import Finalize

import numpy as np
import torch

from ..data.device import HostBlocks, Layout, copy_into, pinned_tensor
from ..data.loader import Batch

_HEADER = 64  # bytes before the data: [0] free flag (1: the main process is done), [1:9] the magic below, then:
_SENT, _RECEIVED = 9, 10  # the worker sent it (pickled it); the main process received it
_MAGIC = np.frombuffer(b"gpupipe!", dtype=np.uint8)
_ROOM_STEP = 1 << 20  # a roomy buffer's size is a multiple of this
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


def lent(nbytes: int) -> torch.Tensor:
    """``nbytes`` uninitialised uint8 bytes, for a count that changes from batch to batch (a GPU feed's encoded files):
    in a DataLoader worker, in one of the worker's shared-memory buffers with room for them (one at most twice their
    size; a new one is made a quarter larger), handed over without a copy and reused once the main process is done
    with it (:func:`arrived`); in the main process, ordinary memory."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    flat = _free_buffer(nbytes, roomy=True)
    return flat[_HEADER : _HEADER + nbytes]


def _free_buffer(nbytes: int, roomy: bool = False) -> torch.Tensor:
    """A free buffer of the pool for ``nbytes`` (exactly that size; with ``roomy``, room for them), else a new one."""
    for flat in _pool:
        head, room = flat.numpy(), flat.numel() - _HEADER
        if head[0] == 1 and (room == nbytes or (roomy and nbytes <= room <= 2 * nbytes + _ROOM_STEP)):
            head[0] = head[_SENT] = head[_RECEIVED] = 0
            return flat
    made = _ROOM_STEP * math.ceil(1.25 * nbytes / _ROOM_STEP) if roomy else nbytes
    flat = _new_buffer(_HEADER + made)
    flat.numpy()[:_HEADER] = np.concatenate([[0], _MAGIC, np.zeros(_HEADER - 1 - len(_MAGIC), np.uint8)])
    if not _pool:
        Finalize(None, _leave, exitpriority=0)  # run as the worker's process ends (multiprocessing's exit function)
    if len(_pool) < _POOL_SIZE:
        _pool.append(flat)
    elif (stale := next((i for i, f in enumerate(_pool) if f.numpy()[0] == 1), None)) is not None:
        _pool[stale] = flat  # a buffer of another size (a short last batch): replaced
    return flat


def _new_buffer(nbytes: int) -> torch.Tensor:
    """A new shared-memory buffer; where /dev/shm has no room, torch's error, and the file it made removed (torch
    leaves it, sparse, until the process tree ends)."""
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
    except RuntimeError as e:
        made = re.search(r"for file <(/torch_[^>/]+)>", str(e))
        if made is not None:
            try:
                os.unlink(f"/dev/shm{made[1]}")
            except OSError:
                pass
        raise
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


def _leave() -> None:
    """A worker's last step: its buffers are let go of, with the reference each unread message holds (the main
    process reads none once its workers exit), so that torch removes their files once the main process has unmapped
    them too. The queue's feeder thread first sends what it holds (or blocks on a full pipe, its message pickled)."""
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(0.2)
    for flat in _pool:
        head = flat.numpy()
        if head[_SENT] and not head[_RECEIVED]:
            flat.untyped_storage()._shared_decref()
    _pool.clear()


def let_go() -> None:
    """The main process, ending a DataLoader iteration, unmaps the buffers it keeps mapped: then each one's file goes
    when its worker exits (or at once, if it has). Another loader's buffers, mapped here too, are mapped again as they
    arrive."""
    _mapped.clear()


class WireBatch(Batch):
    """A worker's batch on its way to the main process: labels and keys travel as bytes in the message (a tensor
    would cost a shared-memory file and a file-descriptor round trip each)."""

    def __reduce__(self):
        handed(self.images)
        keys = None if self.keys is None else self.keys.numpy()
        labels = self.labels.numpy()
        args = (self.images, labels, self.layout, self.errors, self.fallbacks, keys, self.failure, self.stamps)
        return arrive, (*args, self.normalized)


def arrive(
    images: torch.Tensor,
    labels: np.ndarray,
    layout: Layout,
    errors,
    fallbacks: int,
    keys,
    failure=None,
    stamps=None,
    normalized: bool = False,
) -> Batch:
    """The batch in the main process, its images still in the worker's buffer: ``Batch.own`` (or ``pin_memory``)
    copies them out and hands the buffer back, ``Batch.drop`` hands it back uncopied."""
    keys_t = None if keys is None else torch.from_numpy(keys)
    labels_t = torch.from_numpy(labels)
    batch = Batch(images, labels_t, layout, errors, fallbacks, keys_t, failure, stamps=stamps, normalized=normalized)
    batch.lease = arrived(images)
    return batch


def handed(data: torch.Tensor) -> None:
    """In a worker, as a message holding ``data`` is pickled: its buffer (if one of the pool's) was sent."""
    flat = _header(data)
    if flat is not None:
        flat.numpy()[_SENT] = 1


def arrived(data: torch.Tensor) -> _Lease | None:
    """In the main process, as a message holding ``data`` is unpickled: the lease of its worker's buffer (None if it
    is in no such buffer), which hands the buffer back once given back or dropped."""
    flat = _header(data)
    if flat is None:
        return None
    flat.numpy()[_RECEIVED] = 1
    _mapped.append(flat)  # its mapping stays: the next batch in it arrives without mapping or page faults
    return _Lease(flat)


class _Lease:
    """A worker's buffer lent to this process, handed back once: after its images are copied out, or when the batch
    holding it is dropped uncopied (a task skipped; DataLoader's reset discards the batches it finds in flight). Only
    by the process it was lent to: a process forked from it holds a copy, which it drops as it exits, while the
    buffer is still the parent's to read."""

    __slots__ = ("_flat", "_pid")
    _getpid = staticmethod(os.getpid)  # read through the class: ``__del__`` may run once the module's names are cleared

    def __init__(self, flat: torch.Tensor):
        self._flat: torch.Tensor | None = flat
        self._pid = os.getpid()

    def copy_out(self, images: torch.Tensor, pinned: bool) -> torch.Tensor:
        """``images`` (in the lent buffer) copied once into new memory of this process's own (page-locked with
        ``pinned``, where the pin thread calls it), then the buffer handed back."""
        out = (pinned_tensor if pinned else _host_blocks.take)(tuple(images.shape), images.dtype)
        copy_into(out, images)
        self.give_back()  # after the copy: the worker may write the buffer again
        return out

    def give_back(self) -> None:
        flat, self._flat = self._flat, None
        if flat is not None and self._getpid() == self._pid:
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
