"""The device side of every loader: copy uint8 batches on a side CUDA stream, then layout, dtype and
normalization on the device, where they cost microseconds instead of CPU milliseconds."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from ..plumbing.host_pack import HostPack
from ..recipe import Recipe

if TYPE_CHECKING:
    from ..augment import SampleAugment


Layout = Literal["NHWC", "NCHW"]  # a batch's uint8 images: (n,H,W,3) or (n,3,H,W)


class BatchLike(Protocol):
    """What the stage reads of a :class:`gpupipe.data.loader.Batch` (named here, not imported: loader imports this)."""

    images: torch.Tensor
    labels: torch.Tensor
    layout: Layout
    keys: torch.Tensor | None
    snapshot: Any  # an adaptive policy's state the batch draws from (augment/adaptive.py), or None
    normalized: bool  # float32, normalised already (the placement's decode workers or decoder did it)


def normalize(images: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 ``(x - mean) * inv_std``, the statistics given per channel on the 0-255 scale."""
    return images.float().sub_(mean).mul_(inv_std)


_HUGE_MIN = 32 << 20  # bytes: glibc's largest mmap threshold; smaller blocks come back from malloc's reused memory


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new, uninitialised CPU tensor for a whole batch. Over 32 MiB (a float32 batch of 64 at 224 is 38.5 MB),
    glibc maps every block afresh, and its first write then takes a page fault per 4 KiB (a cost per image:
    bench/README.md): such a batch gets its own anonymous mapping advised for transparent huge pages, one fault per
    2 MiB.
    Without THP (or mmap's ``madvise``), the same 4 KiB pages as ``torch.empty``; smaller batches are ``torch.empty``
    (malloc reuses their memory without faults)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < _HUGE_MIN or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: 4 KiB pages, as malloc's
        pass
    return torch.frombuffer(block, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class HostBlocks:
    """Batch-sized CPU memory handed out again once nothing but this pool holds it: a fresh block costs a page fault
    per 4 KiB on its first write (copying a batch into fresh memory costs several times a copy into memory written
    before: bench/README.md), and the batches a loader copies out of its workers' buffers for a CPU or meta device
    come and go at one size. A block is reused only when no tensor (a view included) or array but the pool's own
    refers to its memory (the storage's use count); at most ``keep`` are kept."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        # each block (flat uint8) with its storage's use count when no one else holds it
        self._blocks: list[tuple[torch.Tensor, int | None]] = []

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``: in a kept block no one else holds, else a new one (kept if there is
        room, or in place of a block no one holds)."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        for block, idle in self._blocks:
            if block.numel() == nbytes and _idle(block, idle):
                return block.view(dtype).view(shape)
        block = host_tensor((nbytes,), torch.uint8)
        kept = (block, _use_count(block))  # a mapped block's view holds its base too: counted as it is made
        if len(self._blocks) < self.keep:
            self._blocks.append(kept)
        elif (free := next((i for i, (b, n) in enumerate(self._blocks) if _idle(b, n)), None)) is not None:
            self._blocks[free] = kept  # a block of another size (a short last batch, another loader): replaced
        return block.view(dtype).view(shape)


def _use_count(block: torch.Tensor) -> int | None:
    """The number of owners of ``block``'s memory (torch's count of its storage's owners: tensors, views' bases, and
    the storage object asked for here); None in a torch without that count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count(block.untyped_storage()._cdata) if use_count is not None else None


def _idle(block: torch.Tensor, idle: int | None) -> bool:
    """Whether no one but the pool holds ``block`` (its owners as many as when it was made); never, without the
    count."""
    count = _use_count(block)
    return count is not None and idle is not None and count <= idle


def pinned_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new, uninitialised page-locked CPU tensor, from torch's caching host allocator: a block freed once its copy to
    the device has run is handed out again, so a batch's pinned memory is reused rather than locked anew."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def copy_into(out: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """``out.copy_(images)`` in this thread alone (numpy): torch's copy of a batch runs on its intra-op threads, which
    would take the cores the decode workers run on (and spin there after the copy)."""
    np.copyto(out.numpy(), images.numpy())
    return out


def normalize_on_cpu(
    images: torch.Tensor | list[np.ndarray],
    mean: torch.Tensor,
    inv_std: torch.Tensor,
    out: torch.Tensor | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> torch.Tensor:
    """:func:`normalize` of a uint8 (N, 3, H, W) batch on the CPU, in any strides (an NHWC batch's NCHW view), or of
    a list of its (3, H, W) images (views: a held set's, mirrored by a negative stride), into ``out`` (else a new
    float32 tensor in ``memory_format``): the same float32 operations, so the same bits, but image by image (one pass
    converts while subtracting and writing the output's layout, the other multiplies while the image is still in
    cache), in this thread, or split over ``threads`` of ``pool``'s (numpy releases the GIL). torch's ops would make
    four passes over the whole batch (layout copy, float, sub, mul) on its intra-op threads: on the decode workers'
    cores, where they also spin after each op."""
    if out is None:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else (len(images), *images[0].shape)
        out = host_batch(shape, torch.float32, memory_format)
    m, s = mean.reshape(-1, 1, 1).numpy(), inv_std.reshape(-1, 1, 1).numpy()
    sources = list(images.numpy()) if isinstance(images, torch.Tensor) else images
    outs = list(out.numpy())

    def part(first: int, step: int) -> None:
        for x, o in zip(sources[first::step], outs[first::step], strict=True):
            np.subtract(x, m, out=o)  # uint8 - float32 is float32 - float32 (the uint8 converted exactly)
            np.multiply(o, s, out=o)

    threads = min(threads, len(sources))
    if pool is None or threads <= 1:
        part(0, 1)
    else:  # every thread its share, interleaved; results taken so that an error is raised here
        list(pool.map(part, range(threads), [threads] * threads))
    return out


def layout_on_cpu(images: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``images.contiguous(memory_format)`` for a CPU batch, copied image by image in this thread (as
    :func:`normalize_on_cpu`, whose reasons apply)."""
    if images.is_contiguous(memory_format=memory_format) or images.dtype not in (torch.uint8, torch.float32):
        return images.contiguous(memory_format=memory_format)
    out = host_batch(tuple(images.shape), images.dtype, memory_format)
    for x, o in zip(images.numpy(), out.numpy(), strict=True):
        np.copyto(o, x)
    return out


def host_batch(
    shape: tuple[int, ...], dtype: torch.dtype, memory_format: torch.memory_format, blocks: HostBlocks | None = None
) -> torch.Tensor:
    """A new (N, C, H, W) batch from :func:`host_tensor` (or from ``blocks``, reused), laid out in ``memory_format``."""
    make = host_tensor if blocks is None else blocks.take
    if memory_format == torch.channels_last:  # (N, H, W, C) in memory, seen as (N, C, H, W)
        return make((shape[0], *shape[2:], shape[1]), dtype).permute(0, 3, 1, 2)
    return make(shape, dtype)


class DeviceStage:
    """uint8 (N,H,W,3) or (N,3,H,W) batches in, (N,3,S,S) float32 normalized (or uint8) on ``device`` out. It does
    what each batch says is left: the per-sample augmentation of a batch with keys, the normalisation of a batch not
    ``normalized`` (the loader's :class:`~gpupipe.data.placement.Placement` decided which)."""

    def __init__(
        self,
        device: torch.device,
        recipe: Recipe,
        *,
        normalize: bool = True,
        channels_last: bool = False,
        augment: SampleAugment | None = None,
        host_threads: int = 1,
    ):
        self.device = device
        self.normalize = normalize
        # a CPU batch is normalised on this many threads of the process (the cores its workers leave), into memory
        # the stage's earlier batches used once nothing else holds them
        self.host_threads = host_threads
        self._blocks = HostBlocks()
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process it was made in, the pool)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.augment = augment if augment is not None and augment.active else None
        shape = (1, 3, 1, 1)
        self.mean = torch.tensor([m * 255 for m in recipe.mean], device=device).view(shape)
        self.inv_std = torch.tensor([1 / (s * 255) for s in recipe.std], device=device).view(shape)
        self._stream: torch.cuda.Stream | None = None
        if self.augment is not None:
            self.augment.to_device(device)  # its constant tables, once, at build

    def finish(
        self, images: torch.Tensor, layout: Layout, job=None, pack: HostPack | None = None, normalized: bool = False
    ) -> torch.Tensor:
        """``job``: what :meth:`SampleAugment.prepare` planned for this batch, its arguments already in ``pack``;
        ``normalized``: the images are normalised already (then only laid out)."""
        if layout == "NHWC":
            images = images.permute(0, 3, 1, 2)
        if self.augment is not None:  # on uint8, before normalization
            images = self.augment.run(images, job, pack)
        if self.normalize and not normalized:  # else the decode workers or the decoder did
            if images.device.type == "cpu":  # layout and normalization in one pass
                return self.normalize_on_host(images)
            images = images.contiguous(memory_format=self.memory_format)  # on uint8: a quarter of the bytes
            return normalize(images, self.mean, self.inv_std)
        if images.device.type == "cpu":
            return layout_on_cpu(images, self.memory_format)
        return images.contiguous(memory_format=self.memory_format)

    def normalize_on_host(self, images: torch.Tensor | list[np.ndarray]) -> torch.Tensor:
        """:func:`normalize_on_cpu` of a CPU batch (or of its images), on :attr:`host_threads` threads, into reused
        memory."""
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else (len(images), *images[0].shape)
        out = host_batch(shape, torch.float32, self.memory_format, self._blocks)
        return normalize_on_cpu(images, self.mean, self.inv_std, out, pool=self._host_pool(), threads=self.host_threads)

    def _host_pool(self) -> ThreadPoolExecutor | None:
        """The stage's threads, made at their first use in this process (a forked child has none of its parent's)."""
        if self.host_threads <= 1:
            return None
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(self.host_threads, thread_name_prefix="gpupipe-normalize"))
        return self._pool[1]

    def close(self) -> None:
        """Its threads ended (the loader is closed)."""
        if self._pool is not None and self._pool[0] == os.getpid():
            self._pool[1].shutdown()
        self._pool = None

    def upload(self, b: BatchLike) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's images and labels on the device, finished: the images in one non-blocking copy (pinned by the
        loader) unless they are there already, the labels and every per-batch argument of the augmentation in one
        more (:class:`HostPack`), and nothing on this path waits for the GPU."""
        images = b.images if b.images.device == self.device else b.images.to(self.device, non_blocking=True)
        pack = HostPack()
        label_slot = None if b.labels.device == self.device else pack.add(b.labels, torch.int64)
        job = None
        if self.augment is not None and b.keys is not None:
            hw = b.images.shape[1:3] if b.layout == "NHWC" else b.images.shape[2:]
            job = self.augment.prepare(b.keys, pack, b.snapshot, hw)
        if label_slot is not None or job is not None:
            pack.send(self.device)
        labels = b.labels if label_slot is None else pack.get(label_slot)
        return self.finish(images, b.layout, job, pack, b.normalized), labels

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # one for the stage's life: a new stream per pass strands the allocator's blocks
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def iterate(self, batches: Iterable[BatchLike]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield finished (images, labels). On CUDA a batch made on the host is copied and normalized one batch
        ahead, on a side stream, while the caller computes on the current one (timm's PrefetchLoader pattern). A
        batch made on the device (nvjpeg, synthetic, DALI), or any batch elsewhere, is yielded at once: it has no copy
        to overlap, and waiting for the next one to be made would let the backend's latency, not its throughput,
        decide the caller's wait."""
        pending = None
        for b in batches:
            if b.images.device.type == self.device.type or self.device.type != "cuda":
                # Made on the device, in order with the current stream: finished here, so it is never read on a side
                # stream before it is written, nor freed while read.
                if pending is not None:
                    yield pending
                    pending = None
                yield self.upload(b)
                continue
            with torch.cuda.stream(self._side_stream()):
                ready = self.upload(b)
            if pending is not None:
                yield pending
            self._hand_over(ready)  # after the caller queued its step on the previous batch: the copy overlaps it
            pending = ready
        if pending is not None:
            yield pending

    def _hand_over(self, ready: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The current stream waits for the side stream's copy, and the memory made there is marked as used here."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._side_stream())
        for t in ready:
            t.record_stream(current)
