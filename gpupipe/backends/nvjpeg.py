"""Batched nvJPEG decode on CUDA (torchcodec's ``decode_jpeg``, or torchvision's where torchcodec is missing), with
the recipe's crop, resize and flip as a few batched ops on the GPU.

The GPU path for users who cannot install DALI. DataLoader workers (one stream of batches across epochs, as the CPU
backends': :mod:`.cpu_stream`) run the feed the batched GPU decoders share (:mod:`.gpu_feed`): they read the bytes,
judge each header (size, EXIF orientation, pixel limit) and plan the crops, and hand each batch over as named arrays:
the bytes in one shared-memory tensor; per JPEG its crop box, orientation and stored size. A decode thread splits the
bytes into views and decodes the whole batch on the GPU in one call, on streams of its own, one batch ahead
(:mod:`.decode_ahead`: the decoder's host work, nvJPEG's Huffman pass, stays off the training thread); the training
thread crops, resizes, turns upright and flips it in a handful of batched ops (:mod:`.gpu_crop`). What nvJPEG cannot
take (non-JPEG, CMYK), or refuses when decoding, goes to the feed's one fallback: Pillow decodes and crops it (in the
worker, or on the decode thread), counted as a fallback. A source that holds pixels (a dataset of arrays) is not
decoded: the worker hands its samples over raw, the decode thread copies them to the device, and the same batched ops
crop them."""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from .._system import resolve_device
from ..data.loader import Batch, LoaderParts, empty_batch
from ..errors import DecodeError
from ..image import (
    ARITHMETIC_SOF,
    ORIENT_STEPS,
    chw_tensor,
    default_max_pixels,
    ends_whole,
    is_jpeg,
    jpeg_sof,
    probe,
)
from ..plumbing.carry import Carry
from ..plumbing.decode_ahead import DecodeAhead
from ..recipe import Recipe
from .cpu_stream import Gate, Stream, StreamedLoader, Task
from .gpu_crop import PadSize, crop_resize_flip, pad_crop_flip, stored_rois
from .gpu_feed import Feed, Work, nvjpeg_takes
from .pillow import PillowDecoder
from .registry import BackendSpec

_GPU_MODES = ("RGB", "L")


def nvjpeg_can_decode(data: bytes, header) -> bool:
    """A JPEG nvJPEG decodes: not CMYK/YCCK, not arithmetic-coded; the rest falls back to Pillow (counted)."""
    return is_jpeg(data) and header.image.mode in _GPU_MODES and jpeg_sof(data) not in ARITHMETIC_SOF


class NvjpegFeed(Feed, torch.utils.data.Dataset):
    """The GPU decoders' feed (:class:`~.gpu_feed.Feed`) as the dataset of the loader's DataLoader: a batch's keys
    (``(epoch, index)`` each) -> its :class:`~.gpu_feed.Work`, once the stream's gate lets it (see ``Gate.let_in``),
    with nvJPEG's crop layout: each image's box, EXIF orientation and stored size."""

    decoder = "nvjpeg"
    takes = staticmethod(nvjpeg_takes)
    pad = False  # nvJPEG takes one view per file: no padded rows

    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int, pixels: bool = False):
        super().__init__(dataset, recipe, train, seed, max_pixels, pixels)
        self.gate = Gate()  # when a Task of the loader's stream may be made, or is skipped

    def __getitems__(self, keys: list[tuple[int, int]]) -> Work | None:
        """A batch (the DataLoader's fetcher calls this): a stream's task once its gate lets it (see Gate.let_in)."""
        made, stamps = self.gate.let_in(keys, self.dataset)
        if not made:
            return None
        work = self.remake(keys)
        work.stamps = stamps
        return work

    def remake(self, keys: list[tuple[int, int]]) -> Work:
        """A batch's samples (of one epoch) read, judged and planned; numbered as its stream's task says."""
        number = keys.batch if isinstance(keys, Task) else 0
        return self.work(keys[0][0] if len(keys) else 0, [key[1] for key in keys], number)

    def crops(self, work: Work, heights: np.ndarray, widths: np.ndarray, orientation: np.ndarray) -> None:
        work.boxes = self.boxes(work, heights, widths)
        work.orientation = orientation
        turned = orientation >= 5  # stored (height, width): the upright size transposed back
        work.stored = np.stack([np.where(turned, widths, heights), np.where(turned, heights, widths)], 1)
        work.rois, work.steps = stored_rois(work.boxes, orientation, work.stored)


def _as_made(work: Work | None) -> Work | None:
    """The DataLoader's collate: a batch as :meth:`NvjpegFeed.__getitems__` made it (None: skipped)."""
    return work


class _Decoded(NamedTuple):
    """A worker's batch after the decode thread: ``work`` without its bytes (the samples nvJPEG refused gone: Pillow's
    crops or errors), each GPU sample's image on the device as stored, and their crops in stored pixels (the worker's
    :func:`~.gpu_crop.stored_rois`)."""

    work: Work
    images: list[torch.Tensor]
    rois: np.ndarray
    steps: np.ndarray
    cpu: dict[int, torch.Tensor]  # position -> Pillow's (3, S, S) crop, on the device


def _tensors(decoded: _Decoded) -> list[torch.Tensor]:
    return [*decoded.images, *decoded.cpu.values()]


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


def _peeked(stream: Stream, epoch: int) -> Iterator[Work]:
    """On the decode thread, once the pass's works are taken: batch 0 of ``epoch``, if the workers were sent it."""
    work = stream.peek(epoch)
    if work is not None:
        yield work  # type: ignore[misc]  # the workers' Work


_LEFT_OVER = 2  # batches a pass may leave (an accumulation's remainder) and the next still goes on from the last's


class NvjpegLoader(StreamedLoader):
    backend = "nvjpeg"
    decode_devices: tuple[str, ...] = ("cuda",)  # the host-budget benchmark adds the meta device, with a stand-in

    def __init__(self, parts: LoaderParts):
        if parts.stage.device.type not in self.decode_devices:
            raise ValueError("backend 'nvjpeg' decodes on CUDA: pass device='cuda' (or use 'dali' or 'turbojpeg')")
        super().__init__(parts)
        max_pixels = parts.max_pixels or default_max_pixels()
        # a source of pixels (a dataset of arrays): uploaded as they are and cropped by the batched ops, never decoded
        pixels = parts.dataset.holds_pixels()
        self._data = NvjpegFeed(parts.dataset, parts.recipe, self.train, parts.seed, max_pixels, pixels)
        self._decode: Decode | None = None  # on the loader's own stream, for its life (made at the first batch)
        self._pad = PadSize()  # one padded size for every batch once the largest images were seen
        # the batches the decode thread made past what the pass took: the next epoch's first, and a pass's rest
        self._carry: Carry[_Decoded] = Carry(lambda d: d.work.tag, _LEFT_OVER, lambda d: d.work.read_as_now())

    def decoder(self) -> Decode:
        return decoder_on_stream(self.stage.device, torch.cuda.Stream(self.stage.device))

    def _open_stream(self) -> Stream:
        """The workers' batches, one stream across epochs; the workers below the training thread (batches go to a
        GPU); bytes: nothing to pin."""
        return self._streaming(self._data, _as_made, self._data.remake, nicer=True, pin_memory=False)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        """The pass's batches, decoded on the loader's decode thread one batch ahead. The thread runs on past the
        pass's last batch into the next epoch's first (read ahead by the workers, :meth:`.cpu_stream.Stream.peek`), so
        the next pass, when it starts there, finds it decoded in the carry (:meth:`_hand_over`), also after a pass left
        a few batches short of its end: no epoch starts cold."""
        self._decode = self._decode or self.decoder()
        count = len(self._batches(epoch, start_batch))  # the last pass's thread handed over (see _hand_over)
        replanned = self.sampler.resplit(epoch) is not None
        begun = self._carry.begin((epoch, start_batch), count, replanned=replanned)
        if begun.changed:  # decoded before its files changed: the workers read it again
            self._carry.drop_from(begun.changed[0])
        # the batches carried are the pass's first: the workers' take on after them
        works: Iterator[Work] = self._taken(epoch, start_batch + len(self._carry))  # type: ignore[assignment]

        # the thread may outlive the pass: it must not keep a dropped loader alive (nor its decode, which may hold it)
        loader = weakref.ref(self)

        def decoded(work: Work) -> _Decoded:
            me = loader()
            if me is None or me._decode is None:  # dropped: its DecodeAhead closed, so this ends the thread
                raise RuntimeError("the loader was dropped")
            return me._decoded(work, me._decode)

        chained = itertools.chain(works, _peeked(self._stream(), epoch + 1))
        ahead = self._ahead = DecodeAhead(chained, decoded, self.device, _tensors, cpu=self.thread_cpu, turn=self.turn)
        # left early, the thread goes on: the next pass may go on from what it makes (see _hand_over)
        while (batch := self._carry.take(ahead.next)) is not None:
            yield self._cropped(epoch, batch)

    def _shut(self) -> None:
        """close(): the stream and the decode thread as every streamed loader's, and the decode's CUDA stream and the
        batches carried dropped."""
        super()._shut()
        self._decode = None

    def _abandon(self) -> None:
        """An error ended the pass: as every streamed loader's, and nothing is carried (its thread is gone)."""
        super()._abandon()
        self._carry.clear()

    def _hand_over(self) -> None:
        """Before the last pass's thread is joined: what it made that may lead the next pass (the batches it owes its
        pass, then the next epoch's first) taken into the carry, which decides at the pass's start whether it goes
        on from them. The batch that thread peeked is never handed to a pass by the stream again: decoded, its bytes
        went back to its worker; it is carried, or made again."""
        ahead = self._ahead
        if ahead is None:
            return
        self._carry.collect(ahead.next)
        super()._hand_over()
        self._ahead = None
        self._stream().drop_peeked()

    def _batch(self, epoch: int, work: Work, decode: Decode) -> Batch:
        """A worker's batch decoded and cropped on this thread (what the decode thread and this one do in turn)."""
        return self._cropped(epoch, self._decoded(work, decode))

    def _decoded(self, work: Work, decode: Decode) -> _Decoded:
        """A worker's batch decoded in one call (on the decode thread), what nvJPEG refuses handed to the feed's
        fallback, Pillow's crops sent to the device; its bytes are dropped."""
        images = self._uploaded(work) if self._data.pixels else self._decode_jpegs(work, decode)
        assert work.rois is not None and work.steps is not None  # the feed's
        device = self.stage.device
        cpu = {pos: torch.from_numpy(img).to(device, non_blocking=True) for pos, img in work.cpu.items()}
        work.encoded, work.data, work.cpu = None, None, {}
        if work.lease is not None:  # nvJPEG has read the bytes: the worker may write its buffer again
            work.lease.give_back()
        return _Decoded(work, images, work.rois, work.steps, cpu)

    def _cropped(self, epoch: int, decoded: _Decoded) -> Batch:
        """A decoded batch cropped, resized, turned upright and flipped on the GPU in a few batched ops, with Pillow's
        crops in their places. No tensor op per image on this thread."""
        size = self.recipe.side(self._data.train, epoch)  # the epoch's (a resolution schedule's)
        work, images, rois, steps, cpu = decoded
        assert work.index is not None and work.labels is not None and work.stored is not None  # the feed's
        if not images and not cpu:
            return empty_batch(size, self.stage.device, work.errors)
        positions = work.gpu
        crops = self._crops(images, rois, steps, work.stored, size) if images else None
        if cpu:  # in the batch's order
            parts = dict(zip(work.gpu, crops, strict=True)) if crops is not None else {}
            parts.update(cpu)
            positions = sorted(parts)
            crops = torch.stack([parts[pos] for pos in positions])
        assert crops is not None  # images or Pillow's
        index, labels = torch.from_numpy(work.index[positions]), torch.from_numpy(work.labels[positions])
        keys = torch.stack([torch.full_like(index, epoch), index], 1)
        return Batch(crops, labels, "NCHW", work.errors, work.fallbacks, keys)

    def _crops(self, images: list[torch.Tensor], rois, steps, stored, size: int) -> torch.Tensor:
        """The batch's crops on the GPU: the ``"pad"`` crop gathered (its windows reach past the edges, and are not
        resized), any other cropped and resized."""
        if self._data.train and self.recipe.crop == "pad":
            return pad_crop_flip(images, rois, steps, stored, size, self.recipe.padding_mode)
        return crop_resize_flip(images, rois, steps, stored, size, self._pad)

    def _uploaded(self, work: Work) -> list[torch.Tensor]:
        """A batch of pixels copied to the device in one copy (a copy on the CPU too: the worker reuses the buffer),
        each (3, H, W) as nvJPEG stores a decoded image, for the same batched crop."""
        if work.encoded is None or work.shapes is None:
            return []
        flat = work.encoded.to(self.stage.device, non_blocking=True, copy=True)
        if flat.dim() == 4:  # one shape: one layout change for the batch
            return list(flat.permute(0, 3, 1, 2).contiguous())
        parts = torch.split(flat, work.lengths.tolist()) if work.lengths is not None else ()
        return [p.view(*shape).permute(2, 0, 1) for p, shape in zip(parts, work.shapes.tolist(), strict=True)]

    def _decode_jpegs(self, work: Work, decode: Decode) -> list[torch.Tensor]:
        """Each GPU sample's image as stored: the whole batch in one nvJPEG call; when that fails, one by one to find
        the culprits, which the feed's fallback (Pillow, cropped) then takes, leaving ``work`` without them."""
        data = [torch.from_numpy(view) for view in work.samples()]  # views, no copy
        if not data:
            return []
        try:
            return list(decode(data))
        except RuntimeError:  # nvJPEG reports the batch, not the file
            pass
        images, refused, why = [], [], []
        for pos, one in zip(work.gpu, data, strict=True):
            try:
                images.append(decode(one))
            except RuntimeError as e:  # a variant nvJPEG rejects may still be valid: Pillow decides
                refused.append(pos)
                why.append(f"nvJPEG: {e}")
        self._data.fallback(work, refused, [data[work.gpu.index(pos)].numpy().tobytes() for pos in refused], why)
        return images


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
