"""Batched nvJPEG decode on CUDA (torchcodec's ``decode_jpeg``, or torchvision's where torchcodec is missing), with
the recipe's crop, resize and flip as a few batched ops on the GPU.

The GPU path for users who cannot install DALI. DataLoader workers (one stream of batches across epochs, as the CPU
backends': :mod:`.cpu_stream`) read the bytes, judge the header (size, EXIF orientation, pixel limit) and plan the
crops, and hand each batch over as whole-batch arrays: the bytes in one shared-memory tensor, one row of label, key,
orientation and stored size per sample, one crop box each. A decode thread splits the bytes into views and decodes
the whole batch on the GPU in one call, on streams of its own, one batch ahead (:mod:`.decode_ahead`: the decoder's
host work, nvJPEG's Huffman pass, stays off the training thread); the training thread crops, resizes, turns upright
and flips it in a handful of batched ops (:mod:`.gpu_crop`). Files nvJPEG cannot take (non-JPEG, CMYK) are decoded
by Pillow in the worker and counted as fallbacks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from .._files import Stamp
from .._system import resolve_device
from ..data.loader import Batch, LoaderParts, empty_batch
from ..errors import DecodeError
from ..recipe import Recipe
from .cpu_stream import Gate, Stream, StreamedLoader
from .decode_ahead import DecodeAhead
from .gpu_crop import PadSize, crop_resize_flip, stored_rois
from .image import (
    ARITHMETIC_SOF,
    ORIENT_STEPS,
    chw_tensor,
    default_max_pixels,
    ends_whole,
    is_jpeg,
    jpeg_sof,
    probe,
)
from .pillow import PillowDecoder
from .registry import BackendSpec

_GPU_MODES = ("RGB", "L")


def nvjpeg_can_decode(data: bytes, header) -> bool:
    """A JPEG nvJPEG decodes: not CMYK/YCCK, not arithmetic-coded; the rest falls back to Pillow (counted)."""
    return is_jpeg(data) and header.image.mode in _GPU_MODES and jpeg_sof(data) not in ARITHMETIC_SOF


class _Item(NamedTuple):
    """One sample as a worker hands it over: the file's bytes for nvJPEG, pixels Pillow decoded, or an error."""

    path: str
    label: int
    sample: int  # the sample's index in the data set (its key, with the epoch)
    data: np.ndarray | None  # uint8: the file's bytes, or with decoded_on_cpu (H,W,3) RGB pixels; None: error
    decoded_on_cpu: bool  # Pillow decoded it in the worker (nvJPEG cannot take it): counted as a fallback
    orientation: int  # the EXIF orientation the GPU path applies after decoding (1: upright)
    epoch: int  # the sample's key is (epoch, sample): its crop is planned with the batch's (Recipe.plan_boxes)
    error: str | None = None  # why the file could not be read
    stored: tuple[int, int] = (0, 0)  # (height, width) as stored, before the orientation: what nvJPEG will output
    upright: tuple[int, int] = (0, 0)  # (height, width) after the orientation: what the crop box is planned on


class _BytesDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int):
        self.dataset, self.recipe, self.train, self.seed = dataset, recipe, train, seed
        self.max_pixels = max_pixels
        self._fallback = PillowDecoder(max_pixels)  # for what nvJPEG cannot take; made once, not per sample
        self.gate = Gate()  # when a Task of the loader's stream may be made, or is skipped

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> _Item:
        epoch, index = key
        path, label = self.dataset.samples[index]
        try:
            data = self.dataset.read(index)
            header = probe(data, path, "nvjpeg", self.max_pixels)
            if nvjpeg_can_decode(data, header) and ends_whole(data):
                w, h = header.image.size
                raw = np.frombuffer(data, np.uint8)
                return _Item(
                    path, label, index, raw, False, header.orientation, epoch, None, (h, w), header.upright_size
                )
            pixels = np.asarray(self._fallback.decode_opened(header, path))  # RGB, upright
            return _Item(path, label, index, pixels, True, 1, epoch, None, pixels.shape[:2], pixels.shape[:2])
        except DecodeError as e:
            return _Item(path, label, index, None, False, 1, epoch, e.reason)
        except OSError as e:
            return _Item(path, label, index, None, False, 1, epoch, f"cannot read the file ({e.strerror or e})")

    def __getitems__(self, keys: list[tuple[int, int]]) -> _Work | None:
        """A batch (the DataLoader's fetcher calls this): a stream's task once its gate lets it (see Gate.let_in)."""
        made, stamps = self.gate.let_in(keys, self.dataset)
        return self.work(keys)._replace(stamps=stamps) if made else None

    def work(self, keys: list[tuple[int, int]]) -> _Work:
        """A batch's samples read and judged, as whole-batch arrays."""
        return self.collate([self[key] for key in keys])

    def collate(self, items: list[_Item]) -> _Work:
        """The batch's items as whole-batch arrays, its crops planned at once from the samples' keys."""
        good = [it for it in items if it.data is not None]
        jpegs = [it for it in good if not it.decoded_on_cpu]
        table = np.array(
            [(it.label, it.sample, it.orientation, *it.stored, it.decoded_on_cpu, *it.upright) for it in good], np.int64
        ).reshape(-1, 8)
        epochs = np.array([it.epoch for it in good], np.int64)
        planned = np.zeros((len(good), 5))
        for epoch in np.unique(epochs).tolist():  # one: a sampler's batch is drawn from one epoch
            rows = table[epochs == epoch]
            planned[epochs == epoch] = self.recipe.plan_boxes(self.train, self.seed, epoch, *rows[:, [1, 6, 7]].T)
        chunks = [it.data for it in jpegs if it.data is not None]
        return _Work(
            table[:, :6],
            planned,
            *stored_rois(planned, table[:, 2], table[:, 3:5]),
            torch.from_numpy(np.concatenate(chunks)) if chunks else None,
            [len(c) for c in chunks],
            [it.data for it in good if it.decoded_on_cpu and it.data is not None],
            [(it.path, it.error or "") for it in items if it.data is None],
        )


class _Work(NamedTuple):
    """A worker's batch as whole-batch arrays (one small pickle, the bytes in one shared-memory tensor): the samples
    read, in batch order, each a row of ``rows``, ``boxes``, ``rois`` and ``steps``, their JPEG bytes one after another
    in ``encoded`` (the rows whose ``on_cpu`` is 0, in order), the pixels Pillow decoded, in order, and the failures."""

    rows: np.ndarray  # int64 (n, 6): label, sample, EXIF orientation, stored height, stored width, on_cpu
    boxes: np.ndarray  # float64 (n, 5): the recipe's crop in upright pixels: top, left, height, width, flip
    rois: np.ndarray  # float64 (n, 4): the same crop in stored pixels, and (n, 3) bool: what turns it upright
    steps: np.ndarray  # (see gpu_crop.stored_rois)
    encoded: torch.Tensor | None  # uint8: the JPEGs' bytes
    lengths: list[int]  # each JPEG's byte count
    cpu: list[np.ndarray]  # (H, W, 3) RGB, upright: what Pillow decoded in the worker
    errors: list[tuple[str, str]]
    stamps: list[Stamp] | None = None  # its files as they were before a read ahead of its pass (see .cpu_stream)

    def own(self, pinned: bool = False) -> _Work:  # the decode thread reads its bytes where the worker put them
        return self


def _as_made(work: _Work | None) -> _Work | None:
    """The DataLoader's collate: a batch as :meth:`_BytesDataset.__getitems__` made it (None: skipped)."""
    return work


class _Decoded(NamedTuple):
    """A worker's batch after the decode thread: ``work`` without its bytes, each row's image on the device as stored
    (None: it failed), the rows Pillow decoded upright after nvJPEG refused them (row -> (height, width)), how many
    Pillow decoded, and the batch's errors so far."""

    work: _Work
    images: list[torch.Tensor | None]
    upright: dict[int, tuple[int, int]]
    fallbacks: int
    errors: list[tuple[str, str]]


def _tensors(decoded: _Decoded) -> list[torch.Tensor]:
    return [img for img in decoded.images if img is not None]


def _upright_chw(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """EXIF orientation on a (3,H,W) tensor: the same transposes as PIL's ``exif_transpose``."""
    if orientation == 1:
        return img
    transpose, mirror, flip = ORIENT_STEPS[orientation]
    if transpose:
        img = img.transpose(-1, -2)
    if mirror:
        img = img.flip(-1)
    return img.flip(-2) if flip else img


Decode = Callable[[Any], Any]


_CHOSEN: dict[torch.device, Callable[..., Any]] = {}  # the batched decode for each device, chosen once


def _batched_jpeg_decode(device: torch.device) -> Callable[..., Any]:
    """``decode(data, device)``: torchcodec's ``decode_jpeg`` (>= 0.16: batched on CUDA) when it decodes on
    ``device``, else torchvision's (deprecated since torchvision 0.29). Decided once per device, on first use, by
    decoding a tiny JPEG: a torchcodec that imports but was built without CUDA (or against another CUDA) would fail
    every batch, each then retried image by image and decoded by Pillow on the training thread; it is passed over
    with one warning instead."""
    if device not in _CHOSEN:
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv_decode

        _CHOSEN[device] = lambda data, device: tv_decode(data, mode=ImageReadMode.RGB, device=device)
        try:
            from torchcodec.decoders import decode_jpeg as codec_decode  # defer: loads torchcodec's C++ ops
        except (ImportError, OSError, RuntimeError):
            return _CHOSEN[device]
        try:
            codec_decode(_tiny_jpeg(), mode="RGB", device=device)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = f"nvjpeg: torchcodec cannot decode on {device} ({first}); using torchvision's decoder"
            warnings.warn(why, stacklevel=3)  # the caller of the loader's first batch
            return _CHOSEN[device]
        _CHOSEN[device] = lambda data, device: codec_decode(data, mode="RGB", device=device)
    return _CHOSEN[device]


def _tiny_jpeg() -> torch.Tensor:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 64, 32)).save(out, "JPEG")
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def decoder_on_stream(device: torch.device, stream: torch.cuda.Stream) -> Decode:
    """The batched nvJPEG decode to RGB on ``device``, for one tensor of bytes or a list of them, run on ``stream``.

    The CUDA decoders allocate their outputs on the calling stream but may write them on a private one that does not
    wait for it (pytorch/vision#9606): called on a stream of their own, they only ever reuse blocks they wrote
    themselves; the current stream then waits for it, and the outputs are recorded as used there.
    """
    decode_jpeg = _batched_jpeg_decode(device)

    def decode(data):
        with torch.cuda.stream(stream):
            out = decode_jpeg(data, device)
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        for img in out if isinstance(out, list) else [out]:
            img.record_stream(current)
        return out

    return decode


class NvjpegLoader(StreamedLoader):
    backend = "nvjpeg"
    decode_devices: tuple[str, ...] = ("cuda",)  # the host-budget benchmark adds the meta device, with a stand-in

    def __init__(self, parts: LoaderParts):
        if parts.stage.device.type not in self.decode_devices:
            raise ValueError("backend 'nvjpeg' decodes on CUDA: pass device='cuda' (or use 'dali' or 'turbojpeg')")
        super().__init__(parts)
        max_pixels = parts.max_pixels or default_max_pixels()
        self._data = _BytesDataset(parts.dataset, parts.recipe, self.train, parts.seed, max_pixels)
        self._decode: Decode | None = None  # on the loader's own stream, for its life (made at the first batch)
        self._pad = PadSize()  # one padded size for every batch once the largest images were seen

    def decoder(self) -> Decode:
        return decoder_on_stream(self.stage.device, torch.cuda.Stream(self.stage.device))

    def _open_stream(self) -> Stream:
        """The workers' batches, one stream across epochs; the workers below the training thread (batches go to a
        GPU); bytes: nothing to pin."""
        return self._streaming(self._data, _as_made, self._data.work, nicer=True, pin_memory=False)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        decode = self._decode = self._decode or self.decoder()
        works: Iterator[_Work] = self._taken(epoch, start_batch)  # type: ignore[assignment]  # the workers'
        self._ahead = DecodeAhead(works, lambda w: self._decoded(w, decode), self.device, _tensors, cpu=self.thread_cpu)
        for decoded in self._ahead:  # decoded on the decode thread, one batch ahead
            yield self._cropped(epoch, decoded)

    def _batch(self, epoch: int, work: _Work, decode: Decode) -> Batch:
        """A worker's batch decoded and cropped on this thread (what the decode thread and this one do in turn)."""
        return self._cropped(epoch, self._decoded(work, decode))

    def _decoded(self, work: _Work, decode: Decode) -> _Decoded:
        """A worker's batch decoded in one call (on the decode thread); its bytes are dropped there too."""
        errors = list(work.errors)
        images, upright, fallbacks = self._images(work, decode, errors)
        return _Decoded(work._replace(encoded=None, cpu=[]), images, upright, fallbacks, errors)

    def _cropped(self, epoch: int, decoded: _Decoded) -> Batch:
        """A decoded batch cropped, resized, turned upright and flipped on the GPU in a few batched ops. No tensor op
        per image on this thread (except for what nvJPEG or the worker refused)."""
        device, size = self.stage.device, self.recipe.side(self._data.train, epoch)  # the epoch's (a schedule's)
        work, images, upright, fallbacks, errors = decoded
        rows, rois, steps, shapes = work.rows, work.rois, work.steps, work.rows[:, 3:5]
        if upright:  # Pillow decoded these upright after nvJPEG refused them: their boxes planned again
            orientation, shapes = rows[:, 2].copy(), shapes.copy()
            for row, hw in upright.items():
                orientation[row], shapes[row] = 1, hw
            rois, steps = stored_rois(work.boxes, orientation, shapes)
        if len(errors) > len(work.errors):  # a file neither nvJPEG nor Pillow decoded: its row goes
            keep = np.array([k for k, img in enumerate(images) if img is not None], np.int64)
            if not len(keep):
                return empty_batch(size, device, errors)
            images, rows, rois, steps, shapes = (
                [images[k] for k in keep],
                rows[keep],
                rois[keep],
                steps[keep],
                shapes[keep],
            )
        crops = crop_resize_flip(images, rois, steps, shapes, size, self._pad)  # type: ignore[arg-type]
        keys = np.stack([np.full(len(rows), epoch, np.int64), rows[:, 1]], 1)
        return Batch(crops, torch.from_numpy(rows[:, 0].copy()), "NCHW", errors, fallbacks, torch.from_numpy(keys))

    def _images(
        self, work: _Work, decode: Decode, errors: list[tuple[str, str]]
    ) -> tuple[list[torch.Tensor | None], dict[int, tuple[int, int]], int]:
        """Each row's image on the device as stored (None: it failed, added to ``errors``), the rows Pillow decoded
        upright after nvJPEG refused them, with their (height, width), and how many Pillow decoded (fallbacks)."""
        on_cpu = work.rows[:, 5].astype(bool)
        decoded, retried = self._decode_jpegs(work, decode, errors)
        jpeg_rows = np.flatnonzero(~on_cpu)
        upright = {int(jpeg_rows[j]): tuple(decoded[j].shape[1:]) for j in retried}  # type: ignore[union-attr]
        if not on_cpu.any():
            return decoded, upright, len(retried)
        images: list[torch.Tensor | None] = [None] * len(on_cpu)
        for j, row in enumerate(jpeg_rows.tolist()):
            images[row] = decoded[j]
        for row, pixels in zip(np.flatnonzero(on_cpu).tolist(), work.cpu, strict=True):
            pixels = pixels if pixels.flags.writeable else pixels.copy()  # from a worker: unpickled, writable
            images[row] = torch.from_numpy(pixels).to(self.stage.device, non_blocking=True).permute(2, 0, 1)
        return images, upright, len(retried) + len(work.cpu)

    def _decode_jpegs(
        self, work: _Work, decode: Decode, errors: list[tuple[str, str]]
    ) -> tuple[list[torch.Tensor | None], list[int]]:
        """Each JPEG's image as stored (None: failed, in ``errors``) and which of them Pillow decoded (upright): the
        whole batch in one nvJPEG call; when that fails, one by one to find the culprits, which Pillow then tries."""
        if work.encoded is None:
            return [], []
        data = list(work.encoded.split(work.lengths))  # views, no copy
        try:
            return list(decode(data)), []
        except RuntimeError:  # nvJPEG reports the batch, not the file
            pass
        images: list[torch.Tensor | None] = []
        retried, samples = [], work.rows[work.rows[:, 5] == 0, 1].tolist()
        for j, (one, sample) in enumerate(zip(data, samples, strict=True)):
            path = self._data.dataset.samples[sample][0]
            try:
                images.append(decode(one))
            except RuntimeError as e:  # a variant nvJPEG rejects may still be valid: Pillow decides
                images.append(self._pillow_retry(one, path, e, errors))
                retried += [j] if images[-1] is not None else []
        return images, retried

    def _pillow_retry(
        self, data: torch.Tensor, path: str, nvjpeg_error: RuntimeError, errors: list[tuple[str, str]]
    ) -> torch.Tensor | None:
        try:
            img = self._data._fallback.decode(data.numpy().tobytes(), path)  # RGB, upright
        except DecodeError as e:
            errors.append((path, f"nvJPEG: {nvjpeg_error}; Pillow: {e.reason}"))
            return None
        return chw_tensor(img).to(self.stage.device)


_READ_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def read_nvjpeg(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:
    """``read_image(backend="nvjpeg")``: decoded on CUDA (``device``, or the current CUDA device when ``device`` is
    the CPU) on a stream of its own, returned on ``device``; what nvJPEG cannot take is decoded by Pillow."""
    header = probe(data, path, "nvjpeg", max_pixels or default_max_pixels())  # the pixel limit, before any decode
    gpu = resolve_device(device if device.type == "cuda" else "cuda")
    if not nvjpeg_can_decode(data, header) or not ends_whole(data):  # Pillow decides about a truncated one
        return chw_tensor(PillowDecoder(max_pixels).decode_opened(header, path)).to(device)
    if gpu not in _READ_STREAMS:
        _READ_STREAMS[gpu] = torch.cuda.Stream(gpu)
    try:
        img = decoder_on_stream(gpu, _READ_STREAMS[gpu])(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except RuntimeError as e:
        raise DecodeError(path, "nvjpeg", f"nvJPEG: {e}") from None
    return _upright_chw(img, header.orientation).contiguous().to(device)


def _unavailable() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU (torchvision's nvJPEG decode runs on CUDA only)"


SPEC = BackendSpec(
    "nvjpeg",
    "batched nvJPEG decode on CUDA (torchcodec, or torchvision's); crop, resize and flip as batched GPU ops",
    ("cuda",),
    _unavailable,
    NvjpegLoader,
    read=read_nvjpeg,
    dataloader_settings=("prefetch_factor", "persistent_workers"),  # its workers read bytes: nothing to pin
)
