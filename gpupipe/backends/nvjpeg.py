"""torchvision's batched nvJPEG decode on CUDA, with the recipe's crop, flip and resize as tensor ops on the GPU.

No extra package: the GPU path for users who cannot install DALI. Workers read the bytes and the header (size,
EXIF orientation, pixel limit); the main process decodes the whole batch on the GPU in one call. Files nvJPEG
cannot take (non-JPEG, CMYK) are decoded by Pillow in the worker and counted as fallbacks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..data.loader import Batch, Loader, LoaderParts, empty_batch
from ..errors import DecodeError
from ..recipe import Recipe
from ._image import ARITHMETIC_SOF, ORIENT_STEPS, chw_tensor, default_max_pixels, is_jpeg, jpeg_sof, probe
from .pillow import PillowDecoder
from .registry import BackendSpec

_GPU_MODES = ("RGB", "L")


def nvjpeg_can_decode(data: bytes, header) -> bool:
    """A JPEG nvJPEG decodes: not CMYK/YCCK, not arithmetic-coded; the rest falls back to Pillow (counted)."""
    return is_jpeg(data) and header.image.mode in _GPU_MODES and jpeg_sof(data) not in ARITHMETIC_SOF


class _BytesDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, recipe: Recipe, train: bool, seed: int, max_pixels: int):
        self.dataset, self.recipe, self.train, self.seed = dataset, recipe, train, seed
        self.max_pixels = max_pixels
        self._fallback = PillowDecoder(max_pixels)  # for what nvJPEG cannot take; made once, not per sample

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        path, label = self.dataset.samples[index]
        try:
            data = self.dataset.read(index)
            header = probe(data, path, "nvjpeg", self.max_pixels)
            uh, uw = header.upright_size
            box = self.recipe.plan(self.train, self.seed, epoch, index)(uh, uw)
            if nvjpeg_can_decode(data, header):
                return path, label, np.frombuffer(data, np.uint8), header.orientation, box, None
            img = self._fallback.decode_opened(header, path)
            return path, label, np.asarray(img), 0, box, None  # orientation 0: already decoded, on the CPU
        except DecodeError as e:
            return path, label, None, 0, None, e.reason
        except OSError as e:
            return path, label, None, 0, None, f"cannot read the file ({e.strerror or e})"


def _collate(items):
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


class NvjpegLoader(Loader):
    backend = "nvjpeg"

    def __init__(self, parts: LoaderParts):
        if parts.stage.device.type != "cuda":
            raise ValueError("backend 'nvjpeg' decodes on CUDA: pass device='cuda' (or use 'dali' or 'turbojpeg')")
        super().__init__(parts)
        max_pixels = parts.max_pixels or default_max_pixels()
        self._data = _BytesDataset(parts.dataset, parts.recipe, self.train, parts.seed, max_pixels)
        self._kwargs = parts.dataloader_kwargs
        self._dataloader = None

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as _decode_jpeg
        from torchvision.transforms.v2 import functional as F

        # torchvision's CUDA decode allocates its outputs on the calling stream but writes them on a private one
        # that does not wait for it (pytorch/vision#9606): called on a stream of its own, it only ever reuses blocks
        # it wrote itself; the current stream then waits for it, and the outputs are recorded as used there.
        decode_stream = torch.cuda.Stream(self.stage.device)

        def decode_jpeg(data, **kw):
            with torch.cuda.stream(decode_stream):
                out = _decode_jpeg(data, **kw)
            current = torch.cuda.current_stream(self.stage.device)
            current.wait_stream(decode_stream)
            for img in out if isinstance(out, list) else [out]:
                img.record_stream(current)
            return out

        if self._dataloader is None:
            kwargs = {**self._kwargs, "pin_memory": False}
            self._dataloader = torch.utils.data.DataLoader(
                self._data, batch_sampler=self.sampler, collate_fn=_collate, **kwargs
            )
        self.sampler.set_epoch(epoch, start_batch)
        device, S = self.stage.device, self.recipe.size
        for items, idx in zip(self._dataloader, self.sampler.batches(epoch, start_batch), strict=True):
            index_of = {id(it): i for it, i in zip(items, idx, strict=True)}
            errors = [(p, r) for p, _, a, _, _, r in items if a is None]
            good = [it for it in items if it[2] is not None]
            gpu = [it for it in good if it[3] != 0]
            decoded, on_cpu = {}, set()
            if gpu:
                try:
                    out = decode_jpeg(
                        [torch.from_numpy(it[2].copy()) for it in gpu], mode=ImageReadMode.RGB, device=device
                    )
                    decoded = {id(it): img for it, img in zip(gpu, out, strict=False)}
                except RuntimeError:  # find the culprit one by one: nvJPEG reports the batch
                    for it in gpu:
                        try:
                            decoded[id(it)] = decode_jpeg(
                                torch.from_numpy(it[2].copy()), mode=ImageReadMode.RGB, device=device
                            )
                        except RuntimeError as e:  # a variant nvJPEG rejects may still be valid: Pillow decides
                            try:
                                img = self._data._fallback.decode(it[2].tobytes(), it[0])  # RGB, upright
                            except DecodeError as e2:
                                errors.append((it[0], f"nvJPEG: {e}; Pillow: {e2.reason}"))
                                continue
                            decoded[id(it)] = chw_tensor(img).to(device)
                            on_cpu.add(id(it))
            crops, labels, keys, fallbacks = [], [], [], 0
            for it in good:
                _path, label, arr, orientation, box, _ = it
                if orientation == 0:
                    img = torch.from_numpy(arr).to(device, non_blocking=True).permute(2, 0, 1)
                    fallbacks += 1
                elif id(it) in on_cpu:
                    img = decoded[id(it)]
                    fallbacks += 1
                elif id(it) in decoded:
                    img = _upright_chw(decoded[id(it)], orientation)
                else:
                    continue
                out = F.resized_crop(
                    img, round(box.top), round(box.left), round(box.height), round(box.width), [S, S], antialias=True
                )
                crops.append(out.flip(-1) if box.flip else out)
                labels.append(label)
                keys.append((epoch, index_of[id(it)]))
            if not crops:
                yield empty_batch(S, device, errors)
                continue
            yield Batch(
                torch.stack(crops),
                torch.tensor(labels, dtype=torch.int64),
                "NCHW",
                errors,
                fallbacks,
                torch.tensor(keys, dtype=torch.int64).view(-1, 2),
            )


def nvjpeg_decode_counts(dataset, cfg) -> Iterator[int]:
    """``gpupipe bench``'s decode pipeline for nvJPEG: batched decode on CUDA from bytes held in memory."""
    from torchvision.io import ImageReadMode, decode_jpeg

    data = []
    for i in range(len(dataset)):
        raw = dataset.read(i)
        if is_jpeg(raw):
            data.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if not data:
        raise ValueError("no JPEG files to decode with nvjpeg")
    while True:
        for i in range(0, len(data), cfg.batch_size):
            out = decode_jpeg(data[i : i + cfg.batch_size], mode=ImageReadMode.RGB, device=cfg.device)
            yield len(out)


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
    decode_job=nvjpeg_decode_counts,
)
