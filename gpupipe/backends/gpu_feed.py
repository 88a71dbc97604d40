"""The one feed of the batched GPU decoders, off the training thread, a whole batch at a time.

DALI (on shards and object storage: :mod:`.dali_stream`; on local files DALI reads them itself, :mod:`.dali_files`)
and nvJPEG (:mod:`.nvjpeg`) decode what DataLoader workers hand them. A worker makes a batch's :class:`Work`
(:meth:`Feed.work`): it reads the batch's bytes (together: object storage serves a batch in few requests), judges
each sample (its upright size, EXIF orientation, pixel limit, whether the GPU decoder takes it) from the bytes just
read or from the sizes a prepared data set recorded, draws each crop, and hands the batch over as named arrays: the
bytes in **one** uint8 tensor (shared memory, not pickled; zero-padded rows when the batch is all JPEG), one row per
sample the GPU decodes, the images Pillow had to take, the failures. Before it, the training thread read every file
and judged every header for DALI (most of its CPU per batch: bench/README.md), and nvJPEG had a feed of its own.

A source that holds pixels (a dataset of arrays) gives DALI nothing to decode: its samples are handed over raw, in
the same one tensor (``Work.shapes`` says how to read it), and DALI crops and resizes them as it does decoded images.

**One fallback**: a file the GPU decoder does not take (a format or mode it lacks, CMYK, 16-bit) is decoded and
cropped by Pillow in the worker, and so is one it refuses when decoding (:meth:`Feed.fallback`, on the loader's
thread); each is counted in ``fallbacks``. Pillow decides about a JPEG that does not end whole (the GPU decoders may
stop at the crop's last row); what Pillow refuses is an error naming the file.

The decoder's part is its crop layout (:meth:`Feed.crops`): DALI takes (n, 6) integer rows (fed as typed columns,
:func:`.dali_graph.crop_inputs`), nvJPEG's batched crop on the GPU (n, 5) boxes with each image's stored size and
orientation (:class:`Work` names each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .._files import Stamp, unchanged
from ..errors import DecodeError
from ..image import (
    ARITHMETIC_SOF,
    HeaderCheck,
    crop_resize,
    ends_whole,
    header_entry,
    is_jpeg,
    jpeg_header_sound,
    jpeg_sof,
    pixel_limit_reason,
)
from ..recipe import Recipe
from .handover import arrived, handed, lent
from .pillow import PillowDecoder

_PAD_RATIO = 4.0  # padded rows cost at most this many times the bytes themselves


@dataclass
class Work:
    """One batch on its way through the pipeline: which samples the GPU decodes, which Pillow decoded, which failed.
    The arrays with one row per GPU sample (``lengths``, ``paths`` and the crop layouts) follow ``gpu``'s order."""

    epoch: int
    indices: list[int]  # the sampler's batch, in order
    number: int = 0  # which batch of its epoch (the loader's count)
    gpu: list[int] = field(default_factory=list)  # positions in ``indices`` the GPU decoder takes
    encoded: torch.Tensor | None = None  # uint8: the GPU samples' bytes (see :func:`_encoded`) or pixels, shared memory
    lengths: np.ndarray | None = None  # int64: each GPU sample's byte count
    # set where the samples are pixels (a feed that takes them raw, :func:`_raw`): int64 (n, 3), each one's (H, W, 3)
    # as ``encoded`` holds it, one after the other, or (n, H, W, 3) when they all have one shape
    shapes: np.ndarray | None = None
    # DALI's crop layout, as it is fed: int64 (n, 6) top, left, height, width, flip, side (the recipe's crop in upright
    # pixels and the epoch's output side), or for eval float32 (n, 8) the window decoded and the crop in it
    # (:func:`eval_windows`)
    rows: np.ndarray | None = None
    # nvJPEG's: float64 (n, 5) top, left, height, width, flip in upright pixels (Recipe.plan_boxes); each image's EXIF
    # orientation, applied after the decode, int64 (n,); its (height, width) as stored, int64 (n, 2); the box in stored
    # pixels, float64 (n, 4), and the steps that turn it upright, bool (n, 3) (gpu_crop.stored_rois)
    boxes: np.ndarray | None = None
    orientation: np.ndarray | None = None
    stored: np.ndarray | None = None
    rois: np.ndarray | None = None
    steps: np.ndarray | None = None
    cpu: dict[int, np.ndarray] = field(default_factory=dict)  # position -> (3, S, S) uint8 Pillow decoded and cropped
    errors: list[tuple[str, str]] = field(default_factory=list)
    fallbacks: int = 0
    scheduled: bool = False  # fed to DALI
    stamps: list[Stamp] | None = None  # read before its pass began: its files as they were then
    index: np.ndarray | None = None  # int64 (len(indices),): ``indices`` as an array, made in the worker
    labels: np.ndarray | None = None  # int64 (len(indices),): their labels, made in the worker
    data: list[np.ndarray] | None = None  # set when a retry narrows the batch: the samples left, one array each
    listed: Any = None  # the samples as DALI TensorCPUs over their bytes (no copy), made on the feed's thread
    # set where DALI reads the files itself (:mod:`.dali_files`), instead of ``encoded``: uint8 (n, W), each GPU
    # sample's path, then NULs
    paths: np.ndarray | None = None
    # in the main process: the worker's buffer that holds ``encoded``, handed back to it when given back (or dropped)
    lease: Any = None

    def __getstate__(self) -> dict:
        if self.encoded is not None:
            handed(self.encoded)  # in a worker, as the work is sent: its buffer is on its way
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.encoded is not None:
            self.lease = arrived(self.encoded)  # the worker reuses the buffer once the work is done with (dropped)

    @property
    def tag(self) -> tuple[int, int]:
        """``(epoch, number)``: its place in the loader's batches (what a :class:`~gpupipe.plumbing.carry.Carry`
        orders it by)."""
        return self.epoch, self.number

    def read_as_now(self) -> bool:
        """Whether its files are as they were when it was read (a work read before its pass began was stamped)."""
        return not self.stamps or unchanged(self.stamps)

    def samples(self) -> list[np.ndarray]:
        """Each GPU sample's bytes, as views (no copy)."""
        if self.data is not None:
            return self.data
        if self.encoded is None or self.lengths is None:
            return []
        enc = self.encoded.numpy()
        if enc.ndim == 4:  # pixels of one shape
            return list(enc)
        if enc.ndim == 2:
            return [row[:n] for row, n in zip(enc, self.lengths.tolist(), strict=True)]
        views = np.split(enc, np.cumsum(self.lengths)[:-1])
        if self.shapes is not None:
            return [v.reshape(shape) for v, shape in zip(views, self.shapes.tolist(), strict=True)]
        return views

    def narrow(self, chosen: list[int]) -> None:
        """Left with its GPU samples at ``chosen`` (positions in ``self.gpu``), for a retry after the decoder failed."""
        if self.paths is not None:
            self.paths = self.paths[chosen]
        else:
            views = self.samples()
            self.data = [views[k] for k in chosen]
        for name in ("rows", "boxes", "orientation", "stored", "rois", "steps"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[chosen])
        self.gpu = [self.gpu[k] for k in chosen]

    def batch(self) -> Any:
        """What DALI is fed: one (n, L) array when the feed padded the batch (or (n, H, W, 3) pixels of one shape),
        else the samples as the TensorCPUs :meth:`prepare` made (no per-sample work on the training thread either
        way), else one view per sample."""
        if self.data is None and self.encoded is not None and self.encoded.dim() > 1:
            return self.encoded.numpy()
        if self.data is None and self.listed is not None:
            return self.listed
        return self.samples()

    def prepare(self) -> None:
        """On the feed's thread: the samples of a batch the feed could not pad as DALI TensorCPUs over their bytes
        where the worker put them (no copy; the pipeline's inputs are ``no_copy``, and this work holds the buffer
        until its batch is fetched). A ``TensorListCPU`` made from the list copies every byte with the GIL held, in
        the training process (bench/README.md: figures behind the code)."""
        if self.encoded is not None and self.encoded.dim() == 1 and self.data is None:
            from nvidia.dali.tensors import TensorCPU  # defer: this module is imported without DALI too

            layout = "" if self.shapes is None else "HWC"
            self.listed = [TensorCPU(view, layout) for view in self.samples()]

    def own(self, pinned: bool = False) -> Work:
        """As taken off the stream (:mod:`.cpu_stream`): the decode thread reads the bytes where the worker put them."""
        return self


class Judged(NamedTuple):
    """One sample as its worker judged it: upright (height, width), EXIF orientation, whether the GPU decoder takes
    it, or why it cannot be decoded."""

    height: int = 0
    width: int = 0
    orientation: int = 1
    takes: bool = False
    problem: str | None = None


def dali_takes(data: bytes, entry: HeaderCheck) -> bool:
    """DALI decodes the formats of ``image.PIPELINE_FORMATS``, but not CMYK or 16-bit images, and is not given a JPEG
    whose header is damaged (:func:`.image.jpeg_header_sound`: its decoder would print the file on stderr)."""
    return not entry.pillow_only and jpeg_header_sound(data)


def nvjpeg_takes(data: bytes, entry: HeaderCheck) -> bool:
    """nvJPEG decodes RGB and grey JPEGs, not CMYK/YCCK and not arithmetic-coded ones."""
    return is_jpeg(data) and entry.mode in ("RGB", "L") and jpeg_sof(data) not in ARITHMETIC_SOF


class Feed:
    """A batch's keys -> its :class:`Work`, in a DataLoader worker (or in the caller with no workers): the part every
    GPU decoder shares. A decoder gives ``takes`` (which bytes it decodes) and its crop layout (:meth:`crops`)."""

    decoder = "gpu"
    takes: Callable[[bytes, HeaderCheck], bool] = staticmethod(dali_takes)
    pad = True  # an all-JPEG batch's bytes as padded rows (DALI takes them as one dense batch)

    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int, pixels: bool = False):
        """``pixels``: the decoder takes pixels, not encoded bytes (a source that holds them: DALI's pipeline for it
        has no decoder, :func:`.dali_graph.build_pipeline`). They are handed over raw, for the decoder's ops to crop
        and resize; an encoded item among them is decoded whole here (:meth:`_as_pixels`). Else pixel items are
        cropped and resized here, like the images Pillow decodes."""
        self.dataset, self.recipe, self.train, self.seed, self.max_pixels = dataset, recipe, train, seed, max_pixels
        self.pixels = pixels
        self.check = PillowDecoder(max_pixels)  # the fallback; made once, not per sample
        self._targets: np.ndarray | None = None  # the labels as one array, made on first use (in each worker)

    def __len__(self) -> int:
        return len(self.dataset)

    def work(self, epoch: int, indices: list[int], number: int = 0) -> Work:
        """The batch ``indices`` of ``epoch``, read, judged and planned."""
        work = Work(epoch, list(indices), number)
        if self._targets is None:
            self._targets = np.asarray(self.dataset.targets, dtype=np.int64)
        work.index = np.asarray(indices, dtype=np.int64)
        work.labels = self._targets[work.index]  # here, not on the training thread
        chunks: list[Any] = []  # bytes, or pixels for a decoder that takes them
        judged: list[Judged] = []
        read = self.dataset.read_samples(work.indices)  # together: object storage serves a batch in few requests
        for pos, (i, data) in enumerate(zip(work.indices, read, strict=True)):
            if self.pixels and isinstance(data, bytes):
                data = self._as_pixels(work, i, data)
            entry = self._sample(work, pos, i, data)
            if entry is not None:
                work.gpu.append(pos)
                chunks.append(data)  # the sample was read
                judged.append(entry)
        if self.pixels:
            work.encoded, work.shapes, work.lengths = _raw(chunks)
        else:
            work.lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
            work.encoded = _encoded(chunks, work.lengths, self.pad) if chunks else None
        sizes = np.array([(j.height, j.width, j.orientation) for j in judged], np.int64).reshape(-1, 3)
        self.crops(work, sizes[:, 0], sizes[:, 1], sizes[:, 2])
        return work

    def crops(self, work: Work, heights: np.ndarray, widths: np.ndarray, orientation: np.ndarray) -> None:
        """The GPU samples' crops (upright sizes ``heights``, ``widths``) in the decoder's layout: DALI's here
        (``work.rows``), nvJPEG's in its loader."""
        if not self.train:
            work.rows = eval_windows(self.recipe, heights, widths)
            return
        work.rows = np.empty((len(heights), 6), np.int64)  # the side goes with the crop: DALI resizes to it, and the
        work.rows[:, :5] = self.boxes(work, heights, widths)  # pipeline is never rebuilt for another
        work.rows[:, 5] = self.recipe.side(True, work.epoch)  # the epoch's (a resolution schedule's)

    def boxes(self, work: Work, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """(n, 5) float64: the recipe's crop of each GPU sample (:meth:`Recipe.plan_boxes`, the whole batch at once)."""
        chosen = work.index[work.gpu] if work.index is not None else np.zeros(0, np.int64)
        return self.recipe.plan_boxes(self.train, self.seed, work.epoch, chosen, heights, widths)

    def fallback(
        self, work: Work, positions: list[int], datas: Sequence[bytes | np.ndarray], why: list[str] | None = None
    ) -> None:
        """The GPU samples at ``positions`` (of ``work.indices``; ``datas``: their bytes, or their pixels), refused by
        the GPU decoder (``why``, where it said), decoded and cropped by Pillow (:func:`decode_on_cpu`), or errors
        naming their files; the rest stay the GPU's."""
        for k, (pos, data) in enumerate(zip(positions, datas, strict=True)):
            i = work.indices[pos]
            plan = self.recipe.plan(self.train, self.seed, work.epoch, i)
            size = self.recipe.side(self.train, work.epoch)
            if isinstance(data, np.ndarray):  # pixels (a feed that takes them): nothing to decode
                work.cpu[pos] = crop_resize(data, plan(*data.shape[:2]), data.shape[:2], size)
                work.fallbacks += 1
                continue
            refused = why[k] if why is not None else None
            decode_on_cpu(self.check, size, work, pos, self.dataset.samples[i][0], data, plan, refused)
        work.narrow([k for k, pos in enumerate(work.gpu) if pos not in set(positions)])

    def _sample(self, work: Work, pos: int, i: int, data: bytes | np.ndarray | Exception) -> Judged | None:
        """The sample judged, for the GPU; None: it failed (in ``work.errors``), Pillow decoded it, or it was pixels
        already (a dataset of arrays) and the decoder takes none (cropped and resized here, never encoded for it)."""
        path = self.dataset.samples[i][0]
        if isinstance(data, OSError):
            work.errors.append((path, f"cannot read the file ({data.strerror or data})"))
            return None
        if isinstance(data, DecodeError):  # a dataset's item that is no image
            work.errors.append((path, data.reason))
            return None
        if isinstance(data, np.ndarray) and self.pixels:  # no header, no orientation: its shape is its upright size
            return Judged(data.shape[0], data.shape[1], 1, True)
        if isinstance(data, np.ndarray):
            plan = self.recipe.plan(self.train, self.seed, work.epoch, i)
            size = self.recipe.side(self.train, work.epoch)
            work.cpu[pos] = crop_resize(data, plan(*data.shape[:2]), data.shape[:2], size)
            return None
        if isinstance(data, Exception):  # not a bad file (object storage gone): the loader raises it
            raise data
        entry = self._judge(i, data)
        if entry.problem is not None:
            work.errors.append((path, entry.problem))
            return None
        if entry.takes and is_jpeg(data) and not ends_whole(data):
            try:  # the GPU decoder may decode only the crop's rows, so never reach a truncation: Pillow decides
                self.check.decode(data, path)
            except DecodeError as e:
                work.errors.append((path, e.reason))
                return None
        if not entry.takes:
            plan = self.recipe.plan(self.train, self.seed, work.epoch, i)  # drawn here only: the GPU's are batched
            decode_on_cpu(self.check, self.recipe.side(self.train, work.epoch), work, pos, path, data, plan)
            return None
        return entry

    def _as_pixels(self, work: Work, i: int, data: bytes) -> np.ndarray | DecodeError:
        """An encoded item of a source of pixels (a mixed dataset, rare), for a decoder that takes only pixels: decoded
        whole by Pillow (RGB, upright; counted as a fallback), or why it cannot be."""
        try:
            image = np.asarray(self.check.decode(data, self.dataset.samples[i][0]).image)
        except DecodeError as e:
            return e
        work.fallbacks += 1
        return image

    def _judge(self, i: int, data: bytes) -> Judged:
        """From the bytes just read, or from the sizes a prepared data set recorded (its files are upright baseline
        RGB or grey JPEGs, which every GPU decoder takes)."""
        if not data:
            return Judged(problem="empty file")
        if self.dataset.sizes is not None:
            h, w = (int(v) for v in self.dataset.sizes[i])
            reason = pixel_limit_reason(w, h, self.max_pixels)
            return Judged(problem=reason) if reason is not None else Judged(h, w, 1, True)
        entry = header_entry(data, self.max_pixels)
        if entry.problem is not None:
            return Judged(problem=entry.problem)
        return Judged(entry.height, entry.width, entry.orientation, self.takes(data, entry))


def _encoded(chunks: list[bytes], lengths: np.ndarray, pad: bool) -> torch.Tensor:
    """The batch's bytes as one tensor, in a buffer the worker reuses (:func:`.handover.lent`: no new shared memory
    and no page faults each batch). All JPEGs, and padding costs under half the bytes: an (n, L) array, each row a
    file followed by zeros (JPEG decoders stop at the end-of-image marker), which DALI takes as one dense batch with
    no per-sample work on the training thread. Otherwise the files one after the other (1-D)."""
    longest, n = int(lengths.max()), len(chunks)
    if pad and all(is_jpeg(c) for c in chunks) and longest * n <= _PAD_RATIO * lengths.sum():
        out = lent(n * longest).view(n, longest)
        rows = out.numpy()
        for k, c in enumerate(chunks):
            rows[k, : len(c)] = np.frombuffer(c, np.uint8)
            rows[k, len(c) :] = 0  # the buffer held an earlier batch
        return out
    out = lent(int(lengths.sum()))
    np.concatenate([np.frombuffer(c, np.uint8) for c in chunks], out=out.numpy())
    return out


def _raw(chunks: list[np.ndarray]) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
    """A batch of pixels as one tensor in a buffer the worker reuses (as :func:`_encoded` does bytes), with each
    sample's shape and byte count: (n, H, W, 3) when they all have one shape (CIFAR's; DALI takes it as one dense
    batch), else the samples one after the other (1-D)."""
    shapes = np.array([c.shape for c in chunks], np.int64).reshape(-1, 3)
    lengths = shapes.prod(axis=1)
    if not chunks:
        return None, shapes, lengths
    if (shapes == shapes[0]).all():
        out = lent(int(lengths.sum())).view(len(chunks), *chunks[0].shape)
        np.stack(chunks, out=out.numpy())
        return out, shapes, lengths
    out = lent(int(lengths.sum()))
    np.concatenate([c.reshape(-1) for c in chunks], out=out.numpy())
    return out, shapes, lengths


def eval_rows(recipe: Recipe, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """(n, 4) int64: :meth:`Recipe.eval_offsets` for a batch in a few array ops, to the bit (the same float64
    division, truncation and round-half-to-even)."""
    size, side = recipe.resize_size, recipe.eval_side
    if recipe.crop != "random-resized":  # the whole image resized to the eval side
        return np.tile(np.array([side, side, 0, 0], np.int64), (len(heights), 1))
    short, long_ = np.minimum(heights, widths), np.maximum(heights, widths)
    new_long = (size * long_ / short).astype(np.int64)
    wide = heights <= widths
    rh, rw = np.where(wide, size, new_long), np.where(wide, new_long, size)
    top, left = np.round((rh - side) / 2.0), np.round((rw - side) / 2.0)
    return np.stack([rh, rw, top, left], 1).astype(np.int64)


def eval_windows(recipe: Recipe, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """(n, 8) float32: for each eval image (upright ``heights``, ``widths``), the window of it that is decoded (top,
    left, height, width, whole pixels) and the recipe's crop in that window's pixels (y0, x0, y1, x1: torchvision's
    Resize + CenterCrop, :meth:`Recipe.eval_box`), which DALI's resize maps onto the output as it resizes (its region
    of interest). The window holds every pixel that resize reads: each output pixel's support (the input/output
    scale each side when shrinking, a pixel when enlarging), a pixel more each side, within the image. So the rows
    below the crop are not decoded, nor the columns beside it converted, and no pixel outside it is resized."""
    rows = eval_rows(recipe, heights, widths).astype(np.float64)
    side = recipe.eval_side
    out = np.empty((len(rows), 8), np.float32)
    axes = ((heights, rows[:, 0], rows[:, 2]), (widths, rows[:, 1], rows[:, 3]))
    for axis, (length, resized, offset) in enumerate(axes):
        scale = length / resized
        start, support = offset * scale, np.maximum(scale, 1.0)
        lo = np.clip(np.floor(start + 0.5 * scale - support) - 1, 0, length)
        hi = np.clip(np.ceil(start + (side - 0.5) * scale + support) + 1, lo + 1, length)
        out[:, axis], out[:, 2 + axis] = lo, hi - lo
        out[:, 4 + axis], out[:, 6 + axis] = start - lo, start + side * scale - lo
    return out


def decode_on_cpu(
    check: PillowDecoder, size: int, work: Work, pos: int, path: str, data: bytes, plan, refused: str | None = None
) -> None:
    """The fallback: the sample at ``pos`` decoded and cropped by Pillow into ``work.cpu`` (a fallback), else an error
    naming its file (and what the GPU decoder said, ``refused``, when it refused it)."""
    try:
        image, _ = check.crop(data, path, plan, size)  # a new array: no slot given
        work.cpu[pos] = np.asarray(image)
        work.fallbacks += 1
    except DecodeError as e:
        work.errors.append((path, e.reason if refused is None else f"{refused}; Pillow: {e.reason}"))
