"""NVIDIA DALI: the recipe compiled into a DALI pipeline. ``device="cuda"`` decodes on the GPU ("mixed", with the
A100/H100 hardware JPEG decoders) and batches never touch the host; ``device="cpu"`` builds a CPU-only pipeline.

The file order comes from the shared :class:`ShardSampler`: each epoch's shard, already padded to equal steps,
is handed to ``readers.file`` as ``files=``, and the reader's "label" is the position in that list, mapped back
to the real label here. That one indirection gives every backend the same order, sharding and labels, and lets a
failed batch be traced to its file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from .._deps import require
from ..data.loader import Batch, Loader
from ..errors import DecodeError, GpupipeError
from ._image import default_max_pixels, header_problems
from .pillow import PillowDecoder

_PREFETCH = 2  # DALI's prefetch_queue_depth: a failure can surface this many batches after the one in flight


def dali_info() -> dict:
    """Which DALI is installed and whether it can use a GPU; never imports DALI itself when it is absent."""
    from .._deps import has_module

    if not has_module("nvidia.dali"):
        return {"installed": False}
    from importlib.metadata import PackageNotFoundError, version

    dist = None
    for name in ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110"):
        try:
            dist = f"{name} {version(name)}"
            break
        except PackageNotFoundError:
            continue
    return {"installed": True, "package": dist, "gpu": torch.cuda.is_available()}


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little") & 0x7FFFFFFF


def build_pipeline(files, recipe, *, train: bool, batch_size: int, device: str, seed: int, num_threads: int,
                   hw_decoder_load: float = 0.65):
    """The DALI graph for one list of files; labels are positions in ``files``."""
    from nvidia.dali import fn, pipeline_def, types  # defer: DALI takes a second to import

    gpu = device == "cuda"
    decode_device = "mixed" if gpu else "cpu"
    decode_kw = {"hw_decoder_load": hw_decoder_load} if gpu else {}
    S = recipe.size

    device_id = torch.cuda.current_device() if gpu else None

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  seed=seed, prefetch_queue_depth=_PREFETCH, exec_dynamic=True)
    def pipe():
        jpegs, pos = fn.readers.file(files=files, labels=list(range(len(files))), random_shuffle=False,
                                     pad_last_batch=True, name="Reader")
        if train:
            images = fn.decoders.image_random_crop(
                jpegs, device=decode_device, output_type=types.RGB, random_area=list(recipe.scale),
                random_aspect_ratio=list(recipe.ratio), num_attempts=10, **decode_kw)
            images = fn.resize(images, resize_x=S, resize_y=S, antialias=True, interp_type=types.INTERP_LINEAR)
            mirror = fn.random.coin_flip(probability=recipe.flip_p)
        else:
            # The recipe's own sizes and offsets (torchvision Resize + CenterCrop, rounding included), computed in
            # the graph from the header, so only interpolation may differ from the other backends.
            shape = fn.peek_image_shape(jpegs)  # upright (EXIF applied), HWC
            h, w = shape[0], shape[1]
            R = recipe.resize_size
            tall = fn.cast(h > w, dtype=types.INT64)
            rh = tall * ((R * h) // w) + (1 - tall) * R
            rw = tall * R + (1 - tall) * ((R * w) // h)
            images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **decode_kw)
            images = fn.resize(images, resize_x=fn.cast(rw, dtype=types.FLOAT), resize_y=fn.cast(rh, dtype=types.FLOAT),
                               antialias=True, interp_type=types.INTERP_LINEAR)
            anchor = fn.stack(_round_half_even_half(rh - S), _round_half_even_half(rw - S))
            images = fn.slice(images, fn.cast(anchor, dtype=types.INT64), types.Constant([S, S], dtype=types.INT64),
                              axis_names="HW")
            mirror = 0
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)
        return images, pos

    return pipe()


def _round_half_even_half(d):
    """Python's ``round(d / 2)`` for integer DataNodes (banker's rounding, as torchvision's CenterCrop gets)."""
    half = d // 2
    return half + (d - 2 * half) * (half - 2 * (half // 2))


class DaliLoader(Loader):
    backend = "dali"

    def __init__(self, dataset, sampler, stage, recipe, on_error, *, seed: int, num_threads: int,
                 max_pixels: int | None = None, hw_decoder_load: float = 0.65):
        require("nvidia.dali", "dali")
        super().__init__(dataset, sampler, stage, recipe, on_error)
        self.seed, self.num_threads, self.hw_decoder_load = seed, max(1, num_threads), hw_decoder_load
        self._device = "cuda" if stage.device.type == "cuda" else "cpu"
        self._labels = torch.tensor(dataset.targets, dtype=torch.int64)
        self._eval_cache = None  # eval order never changes: build once, reset between epochs
        self._bad: set[str] = set()
        self.max_pixels = max_pixels or default_max_pixels()
        self._unusable: dict[str, str] | None = None  # DALI has no pixel limit: headers are read once, up front

    def _iterator(self, files, epoch):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe = build_pipeline(files, self.recipe, train=self.train, batch_size=self.batch_size, device=self._device,
                              seed=_seed(self.seed, epoch, self.sampler.rank), num_threads=self.num_threads,
                              hw_decoder_load=self.hw_decoder_load)
        return DALIGenericIterator(pipe, ["images", "pos"], reader_name="Reader",
                                   last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        if self._unusable is None:
            from ..api import usable_cores

            paths = [p for p, _ in self.dataset.samples]
            self._unusable = header_problems(paths, self.max_pixels, usable_cores())
        indices = [i for b in self.sampler.batches(epoch, start_batch) for i in b]
        over = [(p, self._unusable[p]) for p in (self.dataset.samples[i][0] for i in indices) if p in self._unusable]
        if over:  # reported (raise, or skip and refill) before DALI could decode them
            yield Batch(torch.empty(0, 3, self.recipe.size, self.recipe.size, dtype=torch.uint8),
                        torch.empty(0, dtype=torch.int64), "NCHW", errors=over)
        excluded = self._bad | self._unusable.keys()
        indices = [i for i in indices if self.dataset.samples[i][0] not in excluded]
        done = 0  # positions in ``indices`` already delivered
        while done < len(indices):
            todo = indices[done:]
            files = [self.dataset.samples[i][0] for i in todo]
            if not self.train and done == 0 and self._eval_cache and self._eval_cache[0] == files:
                it = self._eval_cache[1]
            else:
                it = self._iterator(files, epoch)
                if not self.train:
                    self._eval_cache = (files, it)
            todo_t = torch.tensor(todo)  # once per pipeline: positions -> dataset indices
            try:
                for out in it:
                    images, pos = out[0]["images"], out[0]["pos"].view(-1).long().cpu()
                    index = todo_t[pos]
                    done += len(pos)
                    yield Batch(images, self._labels[index], "NCHW")
            except (RuntimeError, StopIteration) as e:
                if self._eval_cache and self._eval_cache[1] is it:
                    self._eval_cache = None
                bad = self._find_bad(todo, str(e))
                self._bad.update(p for p, _ in bad)
                yield Batch(torch.empty(0, 3, self.recipe.size, self.recipe.size, dtype=torch.uint8),
                            torch.empty(0, dtype=torch.int64), "NCHW", errors=bad)
                indices = indices[:done] + [i for i in todo if self.dataset.samples[i][0] not in self._bad]

    def _find_bad(self, todo: list[int], dali_message: str) -> list[tuple[str, str]]:
        """DALI reports a batch (and its reader runs ahead of it); name the file(s) by decoding the samples from
        where it stopped on the CPU: the batches in flight first, then on until a culprit turns up."""
        check = PillowDecoder()
        window = (1 + _PREFETCH) * self.batch_size
        for start in range(0, len(todo), window):
            bad = []
            for i in todo[start : start + window]:
                path = self.dataset.samples[i][0]
                try:
                    with open(path, "rb") as f:
                        check.decode(f.read(), path)
                except (DecodeError, OSError) as e:
                    bad.append((path, getattr(e, "reason", str(e))))
            if bad:
                return bad
        first = dali_message.strip().splitlines()[0] if dali_message.strip() else "unknown error"
        raise GpupipeError(f"DALI failed on a batch that Pillow decodes without error: {first}")


def dali_decode_counts(files: list[str], cfg) -> Iterator[int]:
    """``gpupipe bench``'s decode pipeline for DALI: read + decode to RGB, nothing else; yields batch sizes."""
    from nvidia.dali import fn, pipeline_def, types

    gpu = cfg.device.type == "cuda"

    @pipeline_def(batch_size=cfg.batch_size, num_threads=max(1, cfg.workers), seed=0,
                  device_id=torch.cuda.current_device() if gpu else None)
    def pipe():
        jpegs, _ = fn.readers.file(files=files, random_shuffle=False, name="Reader")
        return fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    while True:
        (out,) = p.run()
        yield len(out)
