"""Small sets held in memory (``build_loader(cache="device" | "host")``): every image decoded once into one uint8
buffer, and every epoch's batches cut from it by index with the recipe's boxes, in a few batched ops, with no worker
and no decode after the first.

The images are kept as decoded (RGB, upright, their own size), so any recipe's crop is made from them as every
backend makes it (:mod:`.gpu_crop`'s batched crop, resize and flip; the ``"pad"`` crop's gather); where the recipe
resizes every image whole (the ``"resize"`` crop, the eval of the ``"pad"`` one), they are kept resized, as the CPU
backends resize them, and a batch is only indexed and flipped. The memory the set
needs is known from the headers alone, before any pixel is decoded: a set that does not fit is refused then, in one
line with the figure and the fix. A file that cannot be read or decoded is found then too: raised, naming it, or
(``on_error="skip"``) left out of every batch and listed in ``loader.skipped`` each pass, as for every loader.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .._options import CACHES, Cache
from .._system import cores_per_rank
from ..data.loader import Batch, Loader, LoaderParts, empty_batch
from ..errors import DecodeError
from ..image import chw_tensor, crop_resize, default_max_pixels, probe, whole
from ..plumbing.decode_ahead import DecodeAhead
from ..plumbing.host_pack import HostPack
from ..sources.cache import size_text  # bytes, KiB, MiB or GiB: a small set read '0.00 GiB'
from .gpu_crop import crop_resize_flip, pad_crop_flip, stored_rois
from .pillow import PillowDecoder
from .registry import BackendSpec, Decoder

_READS = 256  # samples read together (object storage: one round trip's latency for them)


@dataclass
class HeldSet:
    """The decoded images of a set, one after another in ``pixels`` (uint8; image ``i``'s (3, H, W) planes from
    ``starts[i]``, its ``shapes[i]`` = (H, W)), and the samples that could not be read (index -> why)."""

    pixels: torch.Tensor
    shapes: np.ndarray  # int64 (N, 2)
    starts: np.ndarray  # int64 (N,)
    bad: dict[int, str]

    def images(self, indices: list[int]) -> list[torch.Tensor]:
        """The (3, H, W) images of ``indices``: views of the buffer, no copy."""
        out = []
        for i in indices:
            h, w = self.shapes[i].tolist()
            out.append(self.pixels[self.starts[i] : self.starts[i] + 3 * h * w].view(3, h, w))
        return out


def memory_for(where: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: the memory a set held on ``where`` may take: the GPU's free memory, else the machine's
    available memory (the meta device stands in for a GPU it does not have: the machine's, too)."""
    if where.type == "cuda":
        return torch.cuda.mem_get_info(where)[0], f"{where}'s free memory"
    return _available(), "this machine's available memory"


def _available() -> int:
    """The memory the kernel says can be taken without swapping (``MemAvailable``: free memory and the page cache it
    can drop), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(need: int, count: int, where: torch.device, cache: Cache, memory: int | None = None) -> None:
    """A set of ``count`` images taking ``need`` bytes held on ``where`` must fit ``memory`` (default
    :func:`memory_for`), with a tenth of it left over for the batches: refused otherwise, in one line."""
    have, what = (memory, "the memory given") if memory is not None else memory_for(where)
    if need > 0.9 * have:
        raise ValueError(
            f'cache="{cache}": the {count} decoded images need {size_text(need)}, more than {what} allows '
            f'({size_text(have)}, a tenth kept for the batches); hold them elsewhere (cache="host"), take a smaller '
            "set or image files at a smaller size, or leave cache=None to decode every epoch"
        )


class HeldLoader(Loader):
    """Batches cut from a :class:`HeldSet` on the device it is held on (``cache="device"``: the loader's device;
    ``"host"``: page-locked host memory where CUDA is there, plain host memory otherwise), then through the device
    stage (augmentation, normalisation) as every backend's batches."""

    def __init__(self, parts: LoaderParts, decoder: Decoder, cache: Cache):
        super().__init__(parts)
        self.backend, self.cache = decoder.name, cache
        device = parts.stage.device
        self.held_on = device if cache == "device" else torch.device("cpu")
        self._ahead: DecodeAhead | None = None  # the last pass's thread cutting its batches
        self.side = self._resized_side()
        kept: list[tuple[int, str, bytes | np.ndarray | Exception]] = []  # what the headers' pass read, decoded next
        shapes, bad = self._headers(decoder, kept if self.held_on.type != "meta" else None)
        if self.side is not None:  # held as the recipe resizes every image, whatever its own size
            shapes[np.any(shapes > 0, axis=1)] = self.side
        sizes = 3 * shapes[:, 0] * shapes[:, 1]
        self.held_bytes = int(sizes.sum())
        check_fits(self.held_bytes, len(shapes) - len(bad), self.held_on, cache)
        starts = np.cumsum(sizes) - sizes
        pinned = cache == "host" and torch.cuda.is_available() and device.type == "cuda"
        pixels = torch.empty(self.held_bytes, dtype=torch.uint8, device=self.held_on, pin_memory=pinned)
        self.held = HeldSet(pixels, shapes, starts, bad)
        if self.held_on.type != "meta":  # the meta device holds shapes, no pixels
            self._decode(decoder, kept)
        self._labels = np.asarray(parts.dataset.targets, np.int64)

    def _made_by(self) -> str:
        return f"no workers, {size_text(self.held_bytes)} held on {self.held_on.type} ({self.cache!r})"

    def _resized_side(self) -> int | None:
        """The side every image is resized to whole when the recipe's geometry does not depend on the draws (the
        ``"resize"`` crop; the eval of the ``"pad"`` one): held resized, so that a batch is only indexed (and
        flipped); None where each sample's box is drawn (held at its own size, cropped per batch)."""
        recipe = self.recipe
        if not self.train and recipe.crop != "random-resized":
            return recipe.eval_side
        if recipe.crop == "resize" and isinstance(recipe.size, int):  # one side for every epoch
            return recipe.train_size(0)
        return None

    def _read(self) -> Iterator[tuple[int, str, bytes | np.ndarray | Exception]]:
        """Each sample's index, path and bytes, or its (H, W, 3) pixels where the source holds pixels (never encoded
        to be decoded again), or why they could not be read; a few hundred read together."""
        dataset = self.dataset
        for lo in range(0, len(dataset), _READS):
            indices = list(range(lo, min(lo + _READS, len(dataset))))
            for i, data in zip(indices, dataset.read_samples(indices), strict=True):
                yield i, dataset.samples[i][0], data

    def _headers(self, decoder: Decoder, kept: list | None) -> tuple[np.ndarray, dict[int, str]]:
        """Each image's upright (H, W) from its header (0 x 0 for one that cannot be read), and the failures: raised
        now, naming the file, unless ``on_error="skip"``. What is read is added to ``kept`` (unless None), for the
        decode: each sample is read once."""
        shapes = np.zeros((len(self.dataset), 2), np.int64)
        bad: dict[int, str] = {}
        limit = self.parts.max_pixels or default_max_pixels()
        for i, path, data in self._read():
            if kept is not None:
                kept.append((i, path, data))
            try:
                if isinstance(data, Exception):
                    raise DecodeError(path, decoder.name, f"cannot read the file ({data})")
                shapes[i] = (
                    data.shape[:2]
                    if isinstance(data, np.ndarray)
                    else probe(data, path, decoder.name, limit).upright_size
                )
                self._check_crop(path, decoder.name, *shapes[i].tolist())
            except DecodeError as e:
                self._failed(bad, i, e)
        return shapes, bad

    def _check_crop(self, path: str, backend: str, height: int, width: int) -> None:
        """An image the ``"pad"`` crop cannot be cut from (smaller than the crop once padded; reflect padding not
        below its sides) is a bad sample, found now, as a backend finds it when it crops the file."""
        if self.train and self.recipe.crop == "pad":
            try:
                self.recipe.fixed_boxes([height], [width], np.zeros((1, 2)), np.zeros(1), self.recipe.train_size(0))
            except ValueError as e:
                raise DecodeError(path, backend, str(e)) from None

    def _decode(self, decoder: Decoder, read: list[tuple[int, str, bytes | np.ndarray | Exception]]) -> None:
        """Every readable image decoded once into its place in the buffer, on a thread per core of this process's
        share (decoders and resizes release the GIL; no worker is left behind); failures in the samples' order."""
        held = self.held
        todo = [item for item in read if item[0] not in held.bad]
        read.clear()
        with ThreadPoolExecutor(cores_per_rank()) as pool:
            for lo in range(0, len(todo), _READS):  # a few hundred in flight
                for i, failure in pool.map(lambda item: self._place(decoder, *item), todo[lo : lo + _READS]):
                    if failure is not None:
                        self._failed(held.bad, i, failure)

    def _place(
        self, decoder: Decoder, i: int, path: str, data: bytes | np.ndarray | Exception
    ) -> tuple[int, DecodeError | None]:
        """Sample ``i`` decoded (or taken as pixels) and copied into its place; the error that stopped it, if any."""
        held = self.held
        try:
            if isinstance(data, Exception):
                raise DecodeError(path, decoder.name, f"cannot read the file ({data})")
            image = self._image(data if isinstance(data, np.ndarray) else decoder.decode(data, path).image)
            if tuple(image.shape[1:]) != tuple(held.shapes[i].tolist()):
                raise DecodeError(
                    path,
                    decoder.name,
                    f"decoded as {tuple(image.shape[1:])}, its header said {tuple(held.shapes[i].tolist())}",
                )
        except DecodeError as e:
            return i, e
        held.images([i])[0].copy_(image)
        return i, None

    def _image(self, decoded) -> torch.Tensor:
        """(3, H, W) uint8: a decoded image as it is held (resized whole to :attr:`side`, as every backend resizes)."""
        if self.side is None:
            return chw_tensor(decoded)
        height, width = (decoded.height, decoded.width) if isinstance(decoded, Image.Image) else decoded.shape[:2]
        return torch.from_numpy(crop_resize(decoded, whole(height, width), (height, width), self.side))

    def _failed(self, bad: dict[int, str], index: int, error: DecodeError) -> None:
        if self.on_error == "raise":
            raise error
        bad[index] = error.reason

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        """This pass's batches, cut (and, where nothing may still change a batch: no adaptive policy, no bad sample to
        fill in, also augmented and normalised by the device stage) two batches ahead on a thread of the loader's own
        (:class:`DecodeAhead`: on CUDA, on a stream of its own, handed over with an event), so the training thread
        only takes finished batches; the kernel launches of a batch (a few dozen op calls) are off it. Batches for
        the CPU are cut on the caller's thread, when asked: the model's step takes every core there."""
        if self._ahead is not None:
            self._ahead.join()  # the last pass's thread (one left early: stopped after its batch), before this one
        finish = self.adaptive is None and not self.held.bad
        make = functools.partial(self._batch, epoch, self.recipe.side(self.train, epoch), finish)
        if self.stage.device.type == "cpu":  # the model computes on every core: cut on the caller's thread
            yield from map(make, self.sampler.batches(epoch, start_batch))
            return
        ahead = DecodeAhead(
            iter(self.sampler.batches(epoch, start_batch)),
            make,
            self.stage.device,
            Batch.on_gpu,
            depth=2,
            name="gpupipe-held",
            turn=self.turn,
        )
        self._ahead = ahead
        yield from ahead  # a pass left early closes it: what it made ahead is dropped

    def _batch(self, epoch: int, size: int, finish: bool, idx: list[int]) -> Batch:
        """One batch of the samples ``idx`` (less those that could not be held), cut; ``finish``: through the device
        stage too, so that only its layout is left."""
        good = [i for i in idx if i not in self.held.bad]
        errors = [(self.dataset.samples[i][0], self.held.bad[i]) for i in idx if i in self.held.bad]
        if not good:
            return empty_batch(size, self.held_on, errors)
        index = np.asarray(good, np.int64)
        keys = None  # the device stage augments from these, where it augments
        if self.placement.keys:
            keys = torch.from_numpy(np.stack([np.full_like(index, epoch), index], 1))
        labels = torch.from_numpy(self._labels[index])
        if finish and self._normalizes_here():  # no crop to cut: normalised from the held images, into reused memory
            return Batch(self._normalized(epoch, good), labels, "NCHW", errors, normalized=True)
        batch = Batch(self._crops(epoch, good, size), labels, "NCHW", errors, keys=keys)
        if not finish:
            return batch
        images, labels = self.stage.upload(batch)  # augmented and normalised as the stage does it
        return Batch(images, labels, "NCHW", errors, normalized=True)

    def _normalizes_here(self) -> bool:
        """Whether a batch is normalised straight from the held images: a set held resized on the CPU, for a CPU
        stage that normalises and has no per-sample augmentation to run first."""
        stage = self.stage
        return (
            self.side is not None
            and self.held_on.type == "cpu"
            and stage.device.type == "cpu"
            and stage.normalize
            and stage.augment is None
            and not self.placement.keys
        )

    def _normalized(self, epoch: int, good: list[int]) -> torch.Tensor:
        """(n, 3, S, S) float32: the held images ``good``, mirrored where the recipe draws it, normalised in one read
        of each (no gather into a uint8 batch first), on a thread per core of this process's share, into memory the
        stage's earlier batches used once nothing else holds them (fresh memory costs a page fault per page)."""
        side, stage = self.side, self.stage
        assert side is not None  # held resized: what makes a batch normalised here
        flips = self.recipe.flips(self.train, self.seed, epoch, good)
        held = self.held.pixels.numpy().reshape(-1, 3, side, side)
        images = [held[i][..., ::-1] if flip else held[i] for i, flip in zip(good, flips.tolist(), strict=True)]
        return stage.normalize_on_host(images)

    def _abandon(self) -> None:
        """An error ended the pass (or the loader is closed): its thread ends now."""
        if self._ahead is not None:
            self._ahead.close()

    def _crops(self, epoch: int, good: list[int], size: int) -> torch.Tensor:
        """(n, 3, S, S) uint8 on the held set's device: the recipe's boxes of the samples ``good``, cut and resized
        (the ``"pad"`` crop gathered) and flipped, the batch at once."""
        if self.side is not None:  # held resized: indexed, and mirrored where the recipe draws it
            return self._indexed(good, self.recipe.flips(self.train, self.seed, epoch, good), self.side)
        shapes = self.held.shapes[good]
        boxes = self.recipe.plan_boxes(self.train, self.seed, epoch, good, shapes[:, 0], shapes[:, 1])
        rois, steps = stored_rois(boxes, np.ones(len(good), np.int64), shapes)
        images = self.held.images(good)
        if self.train and self.recipe.crop == "pad":
            return pad_crop_flip(images, rois, steps, shapes, size, self.recipe.padding_mode)
        return crop_resize_flip(images, rois, steps, shapes, size)

    def _indexed(self, good: list[int], flips: np.ndarray, side: int) -> torch.Tensor:
        """The held (resized) images ``good``, mirrored where ``flips`` says: a batch that mirrors none (or all) is
        one gather (and one flip), with no select between a mirrored and a plain copy of the whole batch."""
        pack = HostPack()
        index_slot = pack.add(good, torch.int64)
        mixed = bool(flips.any()) and not bool(flips.all())
        flip_slot = pack.add(flips, torch.bool) if mixed else None
        pack.send(self.held_on)
        images = self.held.pixels.view(-1, 3, side, side).index_select(0, pack.get(index_slot))
        if flip_slot is not None:
            return torch.where(pack.get(flip_slot).view(-1, 1, 1, 1), images.flip(-1), images)
        return images.flip(-1) if flips.any() else images


def held_loader(parts: LoaderParts, spec: BackendSpec, cache: str) -> HeldLoader:
    """``build_loader(cache=...)``'s loader: the set decoded once by ``spec``'s decoder (Pillow for a backend that
    decodes whole batches: dali, nvjpeg), held as ``cache`` says."""
    if cache not in CACHES:
        raise ValueError(f"cache must be None, 'device' or 'host', got {cache!r}")
    if spec.read is None:
        raise ValueError(f"backend {spec.name!r} decodes no images, so it has none to hold: leave cache=None")
    decoder = spec.decoder(parts.max_pixels, False) if spec.decoder is not None else PillowDecoder(parts.max_pixels)
    return HeldLoader(parts, decoder, cache)
