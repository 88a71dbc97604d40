"""The CPU decoders' backend (``pillow``, ``pillow-simd``, ``turbojpeg``, or any registered :class:`Decoder`): decode,
crop and augment one image at a time in DataLoader workers, collate uint8 batches, deliver them to any device.
:func:`cpu_decoder_spec` makes a whole backend spec from one decoder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from ..data.device import normalize_on_cpu
from ..data.loader import DATALOADER_SETTINGS, Batch, Loader, LoaderParts
from ..errors import DecodeError, TransformError
from ..image import chw_tensor, crop_resize_into
from ..plumbing.decode_ahead import DecodeAhead
from ..recipe import Recipe
from ..sources.scan import ImageList
from .cpu_stream import Gate, Stream, StreamedLoader, Task
from .handover import WireBatch, buffer, release
from .registry import BackendSpec, Decoder


class Sample(NamedTuple):
    """One sample as a decode worker hands it to the collate: the image, or why there is none."""

    path: str
    label: int
    image: np.ndarray | None  # (3, S, S) uint8
    error: str | None = None
    fell_back: bool = False
    key: tuple[int, int] = (0, 0)  # (epoch, index): the device stage augments from it when the worker did not


class _SampleDataset(torch.utils.data.Dataset):
    """One sample per ``(epoch, index)`` key: read, decode, crop, resize. Errors come back as data, so the main
    process raises them (with the file named) instead of a worker's traceback.

    The DataLoader's fetcher hands a whole batch of keys to :meth:`__getitems__`, which builds the batch in one
    call: each image resized straight into its slot of one (n, S, S, 3) buffer, allocated in shared memory in a
    worker (what the hand-over to the main process would otherwise copy it into), no per-sample tensor or collate
    copy. ``__getitem__`` (one sample) remains for callers that want one."""

    def __init__(self, dataset: ImageList, decoder: Decoder, recipe: Recipe, train: bool, seed: int, augment=None):
        self.dataset, self.decoder, self.recipe, self.train, self.seed = dataset, decoder, recipe, train, seed
        self.augment = augment  # a SampleAugment to run here, in the worker (CPU device), or None
        self.gate = Gate()  # when a Task of the loader's stream may be made, or is skipped

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple) -> Sample:
        path, label = self.dataset.samples[key[1]]
        size = self.recipe.side(self.train, key[0])  # the epoch's size (a resolution schedule's)
        image = np.empty((size, size, 3), dtype=np.uint8)
        error, fell_back = self._into(key, self.dataset.read_samples([key[1]])[0], image)
        if error is not None:
            return Sample(path, label, None, error, key=(key[0], key[1]))
        return Sample(path, label, image.transpose(2, 0, 1), fell_back=fell_back, key=(key[0], key[1]))

    def __getitems__(self, keys: list[tuple]) -> Batch | None:
        """A batch (the DataLoader's fetcher calls this): its bytes read together, concurrently where the storage
        can (object storage: one round trip's latency for the batch), then each image made into its slot. For a
        :class:`Task` of the loader's stream, once its gate lets it (None: skipped), its files stamped first when it
        is read ahead of its pass."""
        made, stamps = self.gate.let_in(keys, self.dataset)
        if not made:
            return None
        batch = self._batch(keys)
        batch.stamps = stamps
        return batch

    def _batch(self, keys: list[tuple]) -> Batch:
        data = self.dataset.read_samples([key[1] for key in keys])
        size = self.recipe.side(self.train, keys[0][0])  # a batch is one epoch's: one size
        images = _batch_buffer(len(keys), size)
        labels: list[int] = []
        good: list[tuple[int, int]] = []
        errors: list[tuple[str, str]] = []
        fallbacks = 0
        plans = self.recipe.plans(self.train, self.seed, keys)  # the batch's crops drawn at once
        for key, d, plan in zip(keys, data, plans, strict=True):
            path, label = self.dataset.samples[key[1]]
            try:
                error, fell_back = self._into(key, d, images[len(good)], plan)
            except TransformError as e:  # carried to the main process as the batch's failure
                return WireBatch(images[:0], torch.empty(0, dtype=torch.int64), "NHWC", [], 0, None, e)
            if error is not None:
                errors.append((path, error))
                continue
            labels.append(label)
            good.append((key[0], key[1]))
            fallbacks += fell_back
        keys_t = torch.tensor(good, dtype=torch.int64).view(-1, 2)
        labels_t = torch.tensor(labels, dtype=torch.int64)
        return WireBatch(images[: len(good)], labels_t, "NHWC", errors, fallbacks, keys_t)

    def _into(
        self,
        key: tuple,
        data: bytes | np.ndarray | Exception,
        out: np.ndarray | torch.Tensor,
        plan: Callable | None = None,
    ) -> tuple[str | None, bool]:
        """Decode sample ``key`` (its bytes, its pixels, or why they could not be read) into ``out`` ((S, S, 3) uint8)
        with its ``plan`` (the recipe's, when not given): (why it failed or None, whether it fell back). Pixels (an
        (H, W, 3) array) are cropped and resized as they are: nothing to decode."""
        epoch, index, *snapshot = key  # with an adaptive policy, the state the sample's batch draws from
        path = self.dataset.samples[index][0]
        try:
            if isinstance(data, Exception):
                raise data
            plan = plan or self.recipe.plan(self.train, self.seed, epoch, index)
            if isinstance(data, np.ndarray):
                crop_resize_into(data, plan(*data.shape[:2]), data.shape[:2], torch.as_tensor(out))
                fell_back = False
            else:
                _, fell_back = self.decoder.crop(data, path, plan, out.shape[0], out)
            if self.augment is not None:
                chw = torch.as_tensor(out).permute(2, 0, 1)
                chw.copy_(self.augment.one(chw.clone(), epoch, index, *snapshot))
            return None, fell_back
        except DecodeError as e:
            return e.reason, False
        except TransformError as e:  # a bug in the transform, not the file: raised in the main process, never skipped
            raise TransformError(path, e.transform, e.cause) from None
        except OSError as e:
            return f"cannot read the file ({e.strerror or e})", False
        except Exception as e:  # anything else a decoder raises still names the file in the main process
            return f"{type(e).__name__}: {e}", False


def _batch_buffer(n: int, size: int) -> torch.Tensor:
    """An uninitialised (n, S, S, 3) uint8 batch (see :func:`handover.buffer`)."""
    return buffer((n, size, size, 3), torch.uint8)


class _Collate:
    """A batch as :meth:`_SampleDataset.__getitems__` built it (or stacked from single samples), without the keys
    when nothing is left to augment; with ``normalize`` (mean, 1/std), also normalised here, in the worker, for
    batches that stay on a CPU whose cores the workers all take."""

    def __init__(self, size: int, normalize: tuple[torch.Tensor, torch.Tensor] | None = None, keys: bool = False):
        self.size, self.normalize, self.keys = size, normalize, keys

    def __call__(self, items: Batch | list[Sample] | None) -> Batch | None:
        if items is None:  # a task skipped (see cpu_stream.Gate)
            return None
        batch = items if isinstance(items, Batch) else self._stack(items)
        if not self.keys:
            batch.keys = None
        if self.normalize is not None:  # NCHW float32, converted from NHWC uint8 in the same pass
            nchw = batch.images.permute(0, 3, 1, 2) if batch.layout == "NHWC" else batch.images
            out = buffer(tuple(nchw.shape), torch.float32)
            images, batch.layout = batch.images, "NCHW"
            batch.images, batch.normalized = normalize_on_cpu(nchw, *self.normalize, out=out), True
            release(images)
        return batch

    def _stack(self, items: list[Sample]) -> Batch:
        good = [it for it in items if it.image is not None]
        images = _batch_buffer(len(good), np.asarray(good[0].image).shape[-1] if good else self.size)
        for slot, it in zip(images, good, strict=True):
            torch.as_tensor(slot).copy_(torch.from_numpy(np.asarray(it.image)).permute(1, 2, 0))
        labels = torch.tensor([it.label for it in good], dtype=torch.int64)
        errors = [(it.path, it.error or "") for it in items if it.image is None]
        keys = torch.tensor([it.key for it in good], dtype=torch.int64).view(-1, 2)
        return WireBatch(images, labels, "NHWC", errors, sum(it.fell_back for it in items), keys)


class _Remake:
    """A task's batch made again on this thread (its files changed after it was read ahead of its pass)."""

    def __init__(self, data: _SampleDataset, collate: _Collate):
        self.data, self.collate = data, collate

    def __call__(self, task: Task) -> Batch:
        batch = self.collate(self.data._batch(task))
        assert batch is not None  # made, not skipped
        return batch


class CpuLoader(StreamedLoader):
    """Pillow, pillow-simd and TurboJPEG: decode and augment in DataLoader workers, uint8 to the device."""

    upstream = "workers"  # they can augment and normalise (data/placement.py)

    def __init__(self, parts: LoaderParts, decoder: Decoder):
        super().__init__(parts)
        self.backend = decoder.name
        self.decoder = decoder
        # the workers augment where the placement says so (a CPU device, and no adaptive policy reading the keys of the
        # batches handed out); else the device stage does, batched
        in_worker = parts.stage.augment if self.placement.augment == "worker" else None
        self._data = _SampleDataset(parts.dataset, decoder, parts.recipe, self.train, parts.seed, in_worker)

    @staticmethod
    def _drawn_ahead(parts: LoaderParts) -> int:
        """The workers draw on a CPU device, when the DataLoader hands them the batch's keys: up to ``workers *
        prefetch_factor`` batches ahead."""
        if parts.stage.device.type != "cpu":
            return 0
        return parts.workers * parts.dataloader.prefetch_factor  # DataLoader's queue (no prefetch with 0 workers)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        taken: Iterator[Batch] = self._taken(epoch, start_batch)  # type: ignore[assignment]  # the workers' Batches
        if self.stage.device.type == "cpu" or not self.parts.workers or self._stream()._pinned:
            return taken
        return self._taken_ahead(taken)

    def _taken_ahead(self, taken: Iterator[Batch]) -> Iterator[Batch]:
        """Batches for a device, with no pin thread (``pin_memory=False``, or a device torch pins nothing for, such as
        the meta device that stands in for CUDA): what that thread does on CUDA, taking each batch off the workers'
        queue (unpickling) and copying it out of the worker's buffer, is done on a thread of the loader's own, one
        batch ahead, not on the training thread."""
        self._ahead = DecodeAhead(
            taken, _as_is, self.device, _none, name="gpupipe-take", cpu=self.thread_cpu, turn=self.turn
        )
        return iter(self._ahead)

    def _open_stream(self) -> Stream:
        """The loader's one stream of batches (persistent workers and one DataLoader iteration outlive epochs; see
        :mod:`.cpu_stream`)."""
        keyed = self.placement.augment == "worker" and self.snapshots is not None  # the workers draw the policy's
        collate = self._collate()
        nicer = self.stage.device.type != "cpu"  # where it only launches a device's work
        clock = self.snapshots if keyed else None
        return self._streaming(self._data, collate, _Remake(self._data, collate), nicer, clock)

    def _collate(self) -> _Collate:
        """The workers' collate, as the placement says: the keys kept where the device stage augments each sample,
        and the batch normalised there where the workers normalise (on a CPU whose cores they all take; else the
        main process does it, while it has a core to itself)."""
        normalize = (self.stage.mean, self.stage.inv_std) if self.placement.normalize == "worker" else None
        # the size of a batch with no good sample (else the images')
        return _Collate(self.recipe.side(self.train, 0), normalize, keys=self.placement.keys)


def _as_is(batch: Batch) -> Batch:
    return batch


def _none(batch: Batch) -> list[torch.Tensor]:
    return []  # host memory: nothing for a CUDA stream to record


def cpu_decoder_spec(
    name: str, summary: str, make_decoder: Callable[[int | None, bool], Decoder], unavailable: Callable[[], str | None]
) -> BackendSpec:
    """The spec of a backend that decodes one image at a time on the CPU (``decode``/``crop``):
    DataLoader workers run it, and batches go to any device."""

    def make_loader(parts: LoaderParts) -> Loader:
        return CpuLoader(parts, make_decoder(parts.max_pixels, True))

    def read(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:

        return chw_tensor(make_decoder(max_pixels, True).decode(data, path).image).to(device)

    return BackendSpec(
        name, summary, ("cpu", "cuda"), unavailable, make_loader, read, make_decoder, DATALOADER_SETTINGS
    )
