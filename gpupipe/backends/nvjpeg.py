"""Batched nvJPEG decode on CUDA (torchcodec's ``decode_jpeg``, or torchvision's where torchcodec is missing), with
the recipe's crop, resize and flip as a few batched ops on the GPU.

The GPU path for users who cannot install DALI. Workers read the bytes and the header (size, EXIF orientation,
pixel limit); the main process decodes the whole batch on the GPU in one call, on the loader's own stream, then
crops and resizes every image in one ``roi_align`` (its adaptive sampling averages each output pixel's footprint:
an antialiased resize) and flips them in one ``where``. Files nvJPEG cannot take (non-JPEG, CMYK) are decoded by
Pillow in the worker and counted as fallbacks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ..data.loader import Batch, Loader, LoaderParts, empty_batch
from ..data.upload import HostPack, Reaper
from ..errors import DecodeError
from ..recipe import Box, Recipe
from .image import ARITHMETIC_SOF, ORIENT_STEPS, chw_tensor, default_max_pixels, is_jpeg, jpeg_sof, probe
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
    box: Box | None  # the recipe's crop, in upright pixels
    error: str | None = None  # why the file could not be read
    stored: tuple[int, int] = (0, 0)  # (height, width) as stored, before the orientation: what nvJPEG will output


class _BytesDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int):
        self.dataset, self.recipe, self.train, self.seed = dataset, recipe, train, seed
        self.max_pixels = max_pixels
        self._fallback = PillowDecoder(max_pixels)  # for what nvJPEG cannot take; made once, not per sample

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> _Item:
        epoch, index = key
        path, label = self.dataset.samples[index]
        try:
            data = self.dataset.read(index)
            header = probe(data, path, "nvjpeg", self.max_pixels)
            uh, uw = header.upright_size
            box = self.recipe.plan(self.train, self.seed, epoch, index)(uh, uw)
            if nvjpeg_can_decode(data, header):
                w, h = header.image.size
                stored = (h, w)
                return _Item(
                    path, label, index, np.frombuffer(data, np.uint8), False, header.orientation, box, None, stored
                )
            img = self._fallback.decode_opened(header, path)  # RGB, upright
            return _Item(path, label, index, np.asarray(img), True, 1, box)
        except DecodeError as e:
            return _Item(path, label, index, None, False, 1, None, e.reason)
        except OSError as e:
            return _Item(path, label, index, None, False, 1, None, f"cannot read the file ({e.strerror or e})")


class _Collated(NamedTuple):
    """A worker's batch: the items, the JPEGs' bytes moved into one tensor (one shared-memory transfer instead of a
    pickled array per image), ``moved[k]``: item k's bytes are there, ``lengths`` in order."""

    items: list[_Item]
    encoded: torch.Tensor | None
    moved: list[bool]
    lengths: list[int]

    def restore(self) -> list[_Item]:
        """The items with their bytes back, as views of the one tensor (no copy)."""
        if self.encoded is None:
            return self.items
        views = iter(np.split(self.encoded.numpy(), np.cumsum(self.lengths)[:-1]))
        return [it._replace(data=next(views)) if m else it for it, m in zip(self.items, self.moved, strict=True)]


def _collate(items: list[_Item]) -> _Collated:
    moved = [it.data is not None and not it.decoded_on_cpu for it in items]
    chunks = [it.data for it, m in zip(items, moved, strict=True) if m and it.data is not None]
    if not chunks:
        return _Collated(items, None, moved, [])
    encoded = torch.from_numpy(np.concatenate(chunks))
    kept = [it._replace(data=None) if m else it for it, m in zip(items, moved, strict=True)]
    return _Collated(kept, encoded, moved, [len(c) for c in chunks])


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


def _batched_jpeg_decode() -> Callable[..., Any]:
    """``decode(data, device)``: torchcodec's ``decode_jpeg`` (>= 0.16: batched on CUDA), else torchvision's (deprecated
    since torchvision 0.29, the fallback where torchcodec is missing or does not load against this torch)."""
    try:
        from torchcodec.decoders import decode_jpeg as codec_decode  # defer: loads torchcodec's C++ ops

        return lambda data, device: codec_decode(data, mode="RGB", device=device)
    except (ImportError, OSError, RuntimeError):
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv_decode

        return lambda data, device: tv_decode(data, mode=ImageReadMode.RGB, device=device)


def decoder_on_stream(device: torch.device, stream: torch.cuda.Stream) -> Decode:
    """The batched nvJPEG decode to RGB on ``device``, for one tensor of bytes or a list of them, run on ``stream``.

    The CUDA decoders allocate their outputs on the calling stream but may write them on a private one that does not
    wait for it (pytorch/vision#9606): called on a stream of their own, they only ever reuse blocks they wrote
    themselves; the current stream then waits for it, and the outputs are recorded as used there.
    """
    decode_jpeg = _batched_jpeg_decode()

    def decode(data):
        with torch.cuda.stream(stream):
            out = decode_jpeg(data, device)
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        for img in out if isinstance(out, list) else [out]:
            img.record_stream(current)
        return out

    return decode


# The padded float copy one roi_align call reads: at most this many elements (1 GiB), so 1-8 MP photos go in chunks.
_PAD_ELEMENTS = 1 << 28


def _padded(images: list[torch.Tensor]) -> torch.Tensor:
    """(N,3,Hmax,Wmax) uint8, each image at the top left, from one nested-tensor copy (not a copy per image)."""
    device = images[0].device
    if device.type not in ("cpu", "cuda"):  # no nested tensors there (the meta device: the benchmark's stand-in)
        return torch.zeros(len(images), 3, *(max(im.shape[d] for im in images) for d in (1, 2)), device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors is in prototype stage")
        return torch.nested.as_nested_tensor(images).to_padded_tensor(0)


def _chunks(images: list[torch.Tensor]) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges whose padded batch stays under ``_PAD_ELEMENTS``."""
    lo, hmax, wmax = 0, 0, 0
    for k, im in enumerate(images):
        h, w = max(hmax, im.shape[1]), max(wmax, im.shape[2])
        if k > lo and (k + 1 - lo) * 3 * h * w > _PAD_ELEMENTS:
            yield lo, k
            lo, h, w = k, im.shape[1], im.shape[2]
        hmax, wmax = h, w
    yield lo, len(images)


def crop_resize_flip(images: list[torch.Tensor], boxes: list[Box], size: int) -> torch.Tensor:
    """Each (3,H,W) uint8 image's box resized to ``size`` and flipped where the box says, as (N,3,S,S) uint8: the
    boxes go to the device in one pinned non-blocking copy, then a handful of ops per chunk, none per image."""
    from torchvision.ops import roi_align  # defer: loads torchvision's C++ ops

    device = images[0].device
    pack, starts = HostPack(), list(_chunks(images))
    rows = [
        (k - lo, b.left, b.top, b.left + b.width, b.top + b.height, b.flip)
        for lo, hi in starts
        for k, b in zip(range(lo, hi), boxes[lo:hi], strict=True)
    ]
    slot = pack.add(rows, torch.float32)
    pack.send(device)
    rois = pack.get(slot)
    out = torch.cat(
        [
            roi_align(_padded(images[lo:hi]).float(), rois[lo:hi, :5].contiguous(), (size, size), 1.0, -1, True)
            for lo, hi in starts
        ]
    )
    out = torch.where(rois[:, 5].view(-1, 1, 1, 1) > 0.5, out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _bytes(item: _Item) -> torch.Tensor:
    assert item.data is not None
    data = item.data  # from a worker: unpickled, writable, used as it is; from this process: the file's own bytes
    return torch.from_numpy(data if data.flags.writeable else data.copy())


class NvjpegLoader(Loader):
    backend = "nvjpeg"
    decode_devices: tuple[str, ...] = ("cuda",)  # the host-budget benchmark adds the meta device, with a stand-in

    def __init__(self, parts: LoaderParts):
        if parts.stage.device.type not in self.decode_devices:
            raise ValueError("backend 'nvjpeg' decodes on CUDA: pass device='cuda' (or use 'dali' or 'turbojpeg')")
        super().__init__(parts)
        max_pixels = parts.max_pixels or default_max_pixels()
        self._data = _BytesDataset(parts.dataset, parts.recipe, self.train, parts.seed, max_pixels)
        self._dataloader: torch.utils.data.DataLoader | None = None
        self._decode: Decode | None = None  # on the loader's own stream, for its life (made at the first batch)
        self._reaper = Reaper()

    def decoder(self) -> Decode:
        return decoder_on_stream(self.stage.device, torch.cuda.Stream(self.stage.device))

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        if self._decode is None:
            self._decode = self.decoder()
        decode = self._decode
        if self._dataloader is None:
            kwargs = {**self.parts.dataloader.kwargs(self.parts.workers), "pin_memory": False}  # bytes: no pinning
            self._dataloader = torch.utils.data.DataLoader(
                self._data, batch_sampler=self.sampler, collate_fn=_collate, **kwargs
            )
        # the DataLoader's batch sampler yields the keys from the position on, read now: this pass's start
        assert self.position.state_dict() == {"epoch": epoch, "batch": start_batch}
        for collated in self._dataloader:
            batch = self._batch(epoch, collated.restore(), decode)
            self._reaper.drop(collated)  # its shared-memory buffer, unmapped off this thread
            del collated
            yield batch

    def _batch(self, epoch: int, items: list[_Item], decode: Decode) -> Batch:
        """The workers' items as a batch: decoded, made upright, then cropped, flipped and resized on the GPU."""
        device, size = self.stage.device, self.recipe.size
        errors = [(it.path, it.error) for it in items if it.error is not None]
        images = self._upright_images(items, decode, errors)
        if not images:
            return empty_batch(size, device, errors)
        boxes = [it.box for it, _, _ in images]
        assert all(b is not None for b in boxes)
        crops = crop_resize_flip([img for _, img, _ in images], boxes, size)  # type: ignore[arg-type]
        return Batch(
            crops,
            torch.tensor([it.label for it, _, _ in images], dtype=torch.int64),
            "NCHW",
            errors,
            sum(fallback for _, _, fallback in images),
            torch.tensor([(epoch, it.sample) for it, _, _ in images], dtype=torch.int64).view(-1, 2),
        )

    def _upright_images(
        self, items: list[_Item], decode: Decode, errors: list[tuple[str, str]]
    ) -> list[tuple[_Item, torch.Tensor, bool]]:
        """Each decodable item, in batch order, with its upright (3,H,W) uint8 image on the GPU and whether Pillow
        decoded it (a fallback). A file neither nvJPEG nor Pillow decodes is added to ``errors``."""
        device = self.stage.device
        jpegs = [it for it in items if it.data is not None and not it.decoded_on_cpu]
        from_gpu = self._decode_jpegs(jpegs, decode, errors)
        images = []
        for it in items:
            if it.decoded_on_cpu:
                assert it.data is not None
                images.append((it, torch.from_numpy(it.data).to(device, non_blocking=True).permute(2, 0, 1), True))
            elif id(it) in from_gpu:
                images.append((it, *from_gpu[id(it)]))
        return images

    def _decode_jpegs(
        self, jpegs: list[_Item], decode: Decode, errors: list[tuple[str, str]]
    ) -> dict[int, tuple[torch.Tensor, bool]]:
        """``id(item)`` -> (upright image, decoded by Pillow): the whole batch in one nvJPEG call; when that fails,
        one by one to find the culprits, which Pillow then tries."""
        if not jpegs:
            return {}
        try:
            out = decode([_bytes(it) for it in jpegs])
        except RuntimeError:  # nvJPEG reports the batch, not the file
            pass
        else:
            return {id(it): (_upright_chw(img, it.orientation), False) for it, img in zip(jpegs, out, strict=False)}
        images = {}
        for it in jpegs:
            try:
                images[id(it)] = (_upright_chw(decode(_bytes(it)), it.orientation), False)
            except RuntimeError as e:  # a variant nvJPEG rejects may still be valid: Pillow decides
                img = self._pillow_retry(it, e, errors)
                if img is not None:
                    images[id(it)] = (img, True)
        return images

    def _pillow_retry(
        self, it: _Item, nvjpeg_error: RuntimeError, errors: list[tuple[str, str]]
    ) -> torch.Tensor | None:
        assert it.data is not None
        try:
            img = self._data._fallback.decode(it.data.tobytes(), it.path)  # RGB, upright
        except DecodeError as e:
            errors.append((it.path, f"nvJPEG: {nvjpeg_error}; Pillow: {e.reason}"))
            return None
        return chw_tensor(img).to(self.stage.device)


_READ_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def read_nvjpeg(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:
    """``read_image(backend="nvjpeg")``: decoded on CUDA (``device``, or the current CUDA device when ``device`` is
    the CPU) on a stream of its own, returned on ``device``; what nvJPEG cannot take is decoded by Pillow."""
    header = probe(data, path, "nvjpeg", max_pixels or default_max_pixels())  # the pixel limit, before any decode
    gpu = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if gpu.index is None:
        gpu = torch.device("cuda", torch.cuda.current_device())
    if not nvjpeg_can_decode(data, header):
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
