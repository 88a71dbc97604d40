"""torchvision's batched nvJPEG decode on CUDA, with the recipe's crop, flip and resize as tensor ops on the GPU.

No extra package: the GPU path for users who cannot install DALI. Workers read the bytes and the header (size,
EXIF orientation, pixel limit); the main process decodes the whole batch on the GPU in one call. Files nvJPEG
cannot take (non-JPEG, CMYK) are decoded by Pillow in the worker and counted as fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ..data.loader import Batch, Loader, LoaderParts, empty_batch
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
                return _Item(path, label, index, np.frombuffer(data, np.uint8), False, header.orientation, box)
            img = self._fallback.decode_opened(header, path)  # RGB, upright
            return _Item(path, label, index, np.asarray(img), True, 1, box)
        except DecodeError as e:
            return _Item(path, label, index, None, False, 1, None, e.reason)
        except OSError as e:
            return _Item(path, label, index, None, False, 1, None, f"cannot read the file ({e.strerror or e})")


def _collate(items: list[_Item]) -> list[_Item]:
    return items


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


def _decoder_on_own_stream(device: torch.device) -> Callable[[Any], Any]:
    """torchvision's ``decode_jpeg`` to RGB on ``device``, for one tensor of bytes or a list of them.

    torchvision's CUDA decode allocates its outputs on the calling stream but writes them on a private one that does
    not wait for it (pytorch/vision#9606): called on a stream of its own, it only ever reuses blocks it wrote itself;
    the current stream then waits for it, and the outputs are recorded as used there.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    decode_stream = torch.cuda.Stream(device)

    def decode(data):
        with torch.cuda.stream(decode_stream):
            out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        current = torch.cuda.current_stream(device)
        current.wait_stream(decode_stream)
        for img in out if isinstance(out, list) else [out]:
            img.record_stream(current)
        return out

    return decode


def _bytes(item: _Item) -> torch.Tensor:
    assert item.data is not None
    return torch.from_numpy(item.data.copy())


class NvjpegLoader(Loader):
    backend = "nvjpeg"

    def __init__(self, parts: LoaderParts):
        if parts.stage.device.type != "cuda":
            raise ValueError("backend 'nvjpeg' decodes on CUDA: pass device='cuda' (or use 'dali' or 'turbojpeg')")
        super().__init__(parts)
        max_pixels = parts.max_pixels or default_max_pixels()
        self._data = _BytesDataset(parts.dataset, parts.recipe, self.train, parts.seed, max_pixels)
        self._dataloader: torch.utils.data.DataLoader | None = None

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        decode = _decoder_on_own_stream(self.stage.device)
        if self._dataloader is None:
            kwargs = {**self.parts.dataloader.kwargs(self.parts.workers), "pin_memory": False}  # bytes: no pinning
            self._dataloader = torch.utils.data.DataLoader(
                self._data, batch_sampler=self.sampler, collate_fn=_collate, **kwargs
            )
        self.sampler.set_epoch(epoch, start_batch)
        for items in self._dataloader:
            yield self._batch(epoch, items, decode)

    def _batch(self, epoch: int, items: list[_Item], decode: Callable[[Any], Any]) -> Batch:
        """The workers' items as a batch: decoded, made upright, then cropped, flipped and resized on the GPU."""
        from torchvision.transforms.v2 import functional as F

        device, size = self.stage.device, self.recipe.size
        errors = [(it.path, it.error) for it in items if it.error is not None]
        images = self._upright_images(items, decode, errors)
        if not images:
            return empty_batch(size, device, errors)
        crops = []
        for it, img, _ in images:
            assert it.box is not None
            box = it.box
            out = F.resized_crop(
                img, round(box.top), round(box.left), round(box.height), round(box.width), [size, size], antialias=True
            )
            crops.append(out.flip(-1) if box.flip else out)
        return Batch(
            torch.stack(crops),
            torch.tensor([it.label for it, _, _ in images], dtype=torch.int64),
            "NCHW",
            errors,
            sum(fallback for _, _, fallback in images),
            torch.tensor([(epoch, it.sample) for it, _, _ in images], dtype=torch.int64).view(-1, 2),
        )

    def _upright_images(
        self, items: list[_Item], decode: Callable[[Any], Any], errors: list[tuple[str, str]]
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
        self, jpegs: list[_Item], decode: Callable[[Any], Any], errors: list[tuple[str, str]]
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


def read_nvjpeg(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:
    """``read_image(backend="nvjpeg")``: decoded on CUDA (``device``, or the current CUDA device when ``device`` is
    the CPU), returned on ``device``; what nvJPEG cannot take is decoded by Pillow."""
    from torchvision.io import ImageReadMode, decode_jpeg

    header = probe(data, path, "nvjpeg", max_pixels or default_max_pixels())  # the pixel limit, before any decode
    gpu = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if not nvjpeg_can_decode(data, header):
        return chw_tensor(PillowDecoder(max_pixels).decode_opened(header, path)).to(device)
    try:
        img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device=gpu)
    except RuntimeError as e:
        raise DecodeError(path, "nvjpeg", f"nvJPEG: {e}") from None
    return _upright_chw(img, header.orientation).contiguous().to(device)


def _unavailable() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU (torchvision's nvJPEG decode runs on CUDA only)"


SPEC = BackendSpec(
    "nvjpeg",
    "torchvision's batched nvJPEG decode on CUDA; crop, flip and resize as GPU tensor ops",
    ("cuda",),
    _unavailable,
    NvjpegLoader,
    read=read_nvjpeg,
    dataloader_settings=("prefetch_factor", "persistent_workers"),  # its workers read bytes: nothing to pin
)
