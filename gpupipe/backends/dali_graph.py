"""DALI's graphs: the one pipeline a dali loader runs (:func:`build_pipeline`), the one-image pipeline of
``read_image(backend="dali")``, the device id DALI takes, and the hand-over of a DALI batch to torch. Kept apart from
:mod:`.dali` (the loader: feeding, failures, epochs) so that each reads on its own."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from .._system import resolve_device
from ..errors import DecodeError
from ..image import (
    PILLOW_ONLY_MODES,
    PIPELINE_FORMATS,
    chw_tensor,
    decode_failure,
    default_max_pixels,
    jpeg_header_sound,
    probe,
)
from .dali_fifos import InFlight, on_watch_thread
from .pillow import PillowDecoder

_log = logging.getLogger(__name__)


def dali_device_id(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return resolve_device(device).index  # the one rule: a bare "cuda" is this rank's GPU, as the loader's


def consumer_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream DALI's outputs are handed to: torch's current one on ``device`` (CUDA), ``None`` elsewhere (a CPU
    pipeline's outputs are host memory)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def build_pipeline(
    recipe,
    *,
    train: bool,
    batch_size: int,
    device: torch.device,
    num_threads: int,
    hw_decoder_load: float = 0.65,
    normalize: bool = False,
    files: bool = False,
    pixels: bool = False,
    queue_depth: int = 1,
):
    """The DALI graph of one loader, fed per batch with ``enc`` (encoded bytes) and the crop's inputs
    (:func:`crop_inputs`: train, the crop ``anchor`` and ``shape``, decoded alone, then resized to ``side`` x ``side``
    and mirrored where ``flip``: the side is an input, so one pipeline serves every epoch of a resolution schedule;
    eval, the window decoded and, in it, the crop of torchvision's Resize + CenterCrop to the recipe's eval side,
    :func:`.gpu_feed.eval_windows`). Output (N, 3, S, S) uint8, or
    float32 normalized with the recipe's mean/std (``normalize``: DALI's ``crop_mirror_normalize`` does it in the
    same pass, in DALI's threads, instead of a separate step after). ``files``: fed ``paths`` (each row a path's bytes,
    then NULs) instead of ``enc`` (:mod:`.dali_files`), and DALI reads the files itself.
    ``pixels``: fed ``pix`` instead of ``enc``, (H, W, 3) uint8 samples that need no decode (a dataset of arrays),
    cropped, resized and mirrored by the same ops as decoded images, so that this work is DALI's (on the GPU where the
    pipeline runs there), not the feed workers'. ``queue_depth``: DALI's prefetch queue depth, which is also the
    number of outputs each of its operators may hold: at 1, an operator waits, batch after batch, until the next one
    has let go of its last output; 2 (DALI's default) where the pipeline is driven a batch at a time by
    :class:`Driver` (the wrapper's first ``schedule_run`` would run as many batches as the depth, fed or not)."""
    from nvidia.dali import fn, pipeline_def, types  # defer: DALI takes a second to import

    gpu = device.type == "cuda"
    decode_kw = {"device": "mixed", "hw_decoder_load": hw_decoder_load} if gpu else {"device": "cpu"}
    source = _Source(pixels, decode_kw)

    @pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=dali_device_id(device),
        prefetch_queue_depth=queue_depth,
        exec_dynamic=True,
    )
    def pipe():
        # copied as fed (tens of bytes a sample): an input read in place holds the fed array, which DALI drops in its
        # own threads, taking the GIL, idle while any Python runs (bench/README.md, "DALI's threads and the GIL")
        crop_in = {
            name: fn.external_source(name=name, dtype=getattr(types, kind), ndim=ndim, no_copy=False)
            for name, (_, _, kind, ndim) in _inputs(recipe, train)
        }
        # no_copy: DALI reads the feed's samples where they are (each kept alive until its batch is fetched)
        if pixels:  # copied to the GPU as they are: its ops crop and resize them there
            enc = fn.external_source(name="pix", dtype=types.UINT8, ndim=3, layout="HWC", no_copy=True)
            enc = enc.gpu() if gpu else enc
        elif files:
            enc = _read_files()
        else:
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1, no_copy=True)
        if train:
            crop = _pad_crop(recipe) if recipe.crop == "pad" else _train_crop
            images, mirror = crop(enc, crop_in, source), crop_in["flip"]
        else:
            images, mirror = _eval_crop(enc, crop_in, recipe.eval_side, source), 0
        if normalize:
            return fn.crop_mirror_normalize(
                images,
                dtype=types.FLOAT,
                output_layout="CHW",
                mirror=mirror,
                mean=[m * 255 for m in recipe.mean],
                std=[s * 255 for s in recipe.std],
            )
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)

    p = pipe()
    p.build()
    return p


def crop_inputs(recipe, train: bool, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The crop's inputs of :func:`build_pipeline`'s graph for a batch's ``rows`` (:class:`.gpu_feed.Work`'s layout:
    train int64 ``[top, left, height, width, flip, S]``, eval float32 ``[window top, left, height, width, y0, x0, y1,
    x1]``), each typed as the operator that reads it takes it, C-contiguous (DALI copies them as they are fed). No
    operator of the graph derives them: each subscript or cast was one more CPU operator per batch, and DALI's threads
    sleep and wake at each (bench/README.md)."""
    inputs = {
        name: np.ascontiguousarray(rows[:, columns], dtype) for name, (columns, dtype, _, _) in _inputs(recipe, train)
    }
    if train and recipe.crop == "pad" and recipe.padding_mode != "zero":  # cut from the image reflected on each side
        inputs["anchor"] = inputs["anchor"] + recipe.padding
    return inputs


# each crop input of a graph: its columns of the rows, its numpy dtype, its DALI type and dimensions per sample
_TRAIN_INPUTS = {
    "anchor": (slice(0, 2), np.int64, "INT64", 1),
    "shape": (slice(2, 4), np.int64, "INT64", 1),
    "flip": (4, np.int32, "INT32", 0),
    "side": (5, np.float32, "FLOAT", 0),  # the random-resized crop's output side (the pad crop's window is its size)
}
_EVAL_INPUTS = {
    name: (slice(k, k + 2), np.float32, "FLOAT", 1)
    for k, name in zip((0, 2, 4, 6), ("anchor", "shape", "roi_start", "roi_end"), strict=True)
}


def _inputs(recipe, train: bool) -> list[tuple[str, tuple]]:
    if not train:
        return list(_EVAL_INPUTS.items())
    return [(name, spec) for name, spec in _TRAIN_INPUTS.items() if name != "side" or recipe.crop != "pad"]


def _read_files():
    """The encoded bytes of the files named by ``paths`` (each row a path's bytes, then NULs: DALI takes it as a C
    string), read in DALI's own threads. Plain reads, not a mapping: a file truncated while mapped would kill the
    process (SIGBUS) where a read fails and the batch is narrowed to it. The rows are copied as they are fed, as the
    crop's inputs are (see :func:`build_pipeline`)."""
    from nvidia.dali import fn, types

    paths = fn.external_source(name="paths", dtype=types.UINT8, ndim=1, no_copy=False)
    return fn.io.file.read(paths, dont_use_mmap=True)


class _Source(NamedTuple):
    """Where a crop's images come from: encoded bytes decoded (``decode_kw``: on the CPU, or "mixed" onto the GPU),
    or, with ``pixels``, samples that are pixels already, which only need the window cut out."""

    pixels: bool
    decode_kw: dict

    def whole(self, enc):
        """The whole image, RGB."""
        from nvidia.dali import fn, types

        return enc if self.pixels else fn.decoders.image(enc, output_type=types.RGB, **self.decode_kw)

    def window(self, enc, anchor, shape):
        """The (top, left) ``anchor``, (height, width) ``shape`` window, in pixels; a JPEG decodes only its rows."""
        from nvidia.dali import fn, types

        if self.pixels:
            return fn.slice(enc, anchor, shape, axis_names="HW", normalized_anchor=False, normalized_shape=False)
        return fn.decoders.image_slice(
            enc,
            anchor,
            shape,
            output_type=types.RGB,
            axis_names="HW",
            normalized_anchor=False,
            normalized_shape=False,
            **self.decode_kw,
        )


def _pad_crop(recipe):
    """The ``"pad"`` crop's graph (the window S x S at ``anchor``, ``shape``): the whole image decoded, then the window
    cut with zeros past the edges, or cut from the image reflected by ``recipe.padding`` on each side (the anchor fed
    shifted by it, :func:`crop_inputs`)."""
    from nvidia.dali import fn

    def crop(enc, crop_in, source: _Source):
        images = source.whole(enc)
        if recipe.padding_mode == "zero":
            policy = "pad"
        else:  # cut from the reflected image: never past its edges
            images = _reflected(_reflected(images, 0, recipe.padding), 1, recipe.padding)
            policy = "error"
        return fn.slice(
            images,
            crop_in["anchor"],
            crop_in["shape"],
            axis_names="HW",
            normalized_anchor=False,
            normalized_shape=False,
            out_of_bounds_policy=policy,
            fill_values=0,
        )

    return crop


def _reflected(images, axis: int, pad: int):
    """``images`` (HWC) reflected by ``pad`` rows (``axis`` 0) or columns (1) past each edge, the edge not repeated."""
    from nvidia.dali import fn, types

    vertical, horizontal = int(axis == 0), int(axis == 1)
    names, length = "HW"[axis], types.Constant([pad], dtype=types.INT64)
    head = fn.slice(images, types.Constant([1], dtype=types.INT64), length, axis_names=names)
    last = fn.reshape(fn.cast(images.shape()[axis], dtype=types.INT64) - 1 - pad, shape=[1])
    tail = fn.slice(images, last, length, axis_names=names)
    head, tail = (fn.flip(edge, vertical=vertical, horizontal=horizontal) for edge in (head, tail))
    return fn.cat(head, images, tail, axis=axis)


def _train_crop(enc, crop_in, source: _Source):
    """The train crop: the window at ``anchor``, ``shape`` decoded alone, resized to ``side`` x ``side``."""
    from nvidia.dali import fn, types

    images = source.window(enc, crop_in["anchor"], crop_in["shape"])
    side = crop_in["side"]
    return fn.resize(images, resize_x=side, resize_y=side, antialias=True, interp_type=types.INTERP_LINEAR)


def _eval_crop(enc, crop_in, size: int, source: _Source):
    """The eval crop (:func:`.gpu_feed.eval_windows`): the window (``anchor``, ``shape``) that the resize reads,
    decoded alone (a JPEG's rows below it not at all), and the crop in it resized to
    size x size, as torchvision's Resize + CenterCrop cut it from the whole image resized (DALI's region of interest
    maps the crop onto the output with the whole resize's scale; the two agree to a level in 255, float rounding)."""
    from nvidia.dali import fn, types

    images = source.window(enc, crop_in["anchor"], crop_in["shape"])
    return fn.resize(
        images,
        size=[size, size],
        roi_start=crop_in["roi_start"],
        roi_end=crop_in["roi_end"],
        antialias=True,
        interp_type=types.INTERP_LINEAR,
    )


class Driver:
    """A built pipeline run a batch at a time (feed, run, share, release) through DALI's C++ pipeline object, which
    its Python ``Pipeline`` wraps. The wrapper's per-call work (``feed_input`` scans every op for the input's name,
    the scheduled-API calls make a context-manager class each, inputs go through a converter for every kind of
    array) cost the training thread more than the calls themselves (bench/README.md); the checks it makes
    hold once the pipeline is built (one ``external_source`` per name, fed only here, numpy arrays in). Where the C++
    object is not there as expected (another DALI), the wrapper's public calls are used."""

    _CALLS = ("SetExternalTLInput", "SetExternalTensorInput", "Run", "ShareOutputs", "ReleaseOutputs")

    @classmethod
    def drives_directly(cls) -> bool:
        """Whether the installed DALI's C++ pipeline object has the calls :class:`Driver` makes (known before a
        pipeline is built: its queue depth depends on it)."""
        from nvidia.dali import backend

        return cls._has_calls(getattr(backend, "Pipeline", None))

    @classmethod
    def _has_calls(cls, handle) -> bool:
        return handle is not None and all(callable(getattr(handle, c, None)) for c in cls._CALLS)

    def __init__(self, pipe):
        from nvidia.dali import types
        from nvidia.dali.backend import TensorCPU, TensorListCPU

        self.pipe = pipe
        handle = getattr(pipe, "_pipe", None)
        self.direct = handle if self._has_calls(handle) else None
        self._as_list, self._as_sample = TensorListCPU, TensorCPU
        self._stream_ptr = types._raw_cuda_stream_ptr if self.direct is not None else None
        # the scheduled batches: their paths (a fifo among them is opened while a wait is long) and what holds the
        # inputs DALI reads in place
        self.in_flight = InFlight()
        # let go without a shut-down (its loader collected), batches in flight: shut down then, the wait watched, and
        # only then are those inputs let go. A weak reference's callback, not a ``__del__``: the collector calls those
        # before any finalizer of its garbage, which may hold the inputs' holders (whose own finalizers hand a feed
        # worker's buffer back) but not the pipeline, held here until the callback has run
        weakref.finalize(self, _collected, pipe, self.in_flight).atexit = False
        self._paths: np.ndarray | None = None  # the batch being fed's

    def feed(self, name: str, data) -> None:
        """One batch of input ``name``: a numpy array whose first axis is the batch, a ``TensorListCPU``, or a list of
        samples, numpy arrays or ``TensorCPU`` objects. The encoded samples and pixels are read where they are (their
        inputs are ``no_copy``: kept alive by the caller until the batch is fetched), the small inputs copied."""
        if name == "paths":
            self._paths = data
        if self.direct is None:
            self.pipe.feed_input(name, data)
        elif isinstance(data, list):
            samples = [x if isinstance(x, self._as_sample) else self._as_sample(x, "") for x in data]
            self.direct.SetExternalTensorInput(name, samples, None, False)
        else:
            listed = data if isinstance(data, self._as_list) else self._as_list(data, "")
            self.direct.SetExternalTLInput(name, listed, None, False)

    def run(self, hold: object = None) -> None:
        """The batch fed scheduled; ``hold``: what must stay alive until DALI is done with the inputs it reads in place
        (let go once the batch is fetched or the pipeline shut down, :class:`.dali_fifos.InFlight`)."""
        if self.direct is None:
            self.pipe.schedule_run()
        else:
            self.direct.Run()
        self.in_flight.add(self._paths, hold)
        self._paths = None

    def share(self, stream: torch.cuda.Stream | None):
        """The oldest scheduled batch's outputs, bound to ``stream`` (None: a CPU pipeline's)."""
        self.in_flight.wait()
        try:
            if self.direct is None:
                return self.pipe.share_outputs(cuda_stream=stream)
            assert self._stream_ptr is not None  # looked up with ``direct``
            return self.direct.ShareOutputs(None if stream is None else self._stream_ptr(stream))
        finally:
            self.in_flight.done()

    def shutdown(self) -> None:
        """DALI's pipeline shut down now, its threads with it (a thread waiting on a fifo in flight is let go), and
        then what held the inputs of the batches in flight let go."""
        _shut_down(self.pipe, self.in_flight)

    def release(self) -> None:
        if self.direct is None:
            self.pipe.release_outputs()
        else:
            self.direct.ReleaseOutputs()


def _shut_down(pipe, flight: InFlight) -> None:
    if flight.shut or (hasattr(pipe, "_pipe") and pipe._pipe is None):  # (or a forked child's copy)
        flight.done(-1)
        return
    flight.wait()
    try:
        pipe._shutdown()
    finally:
        flight.shut = True
        flight.done(-1)


def _collected(pipe, flight: InFlight) -> None:
    """A driver collected with batches in flight (its loader dropped, not closed): its pipeline shut down here, as
    DALI's own ``Pipeline.__del__`` would, on the collector's thread, but before the inputs DALI reads are let go
    (their holders' finalizers may otherwise come first: a feed worker's buffer written again while DALI decodes it).
    With nothing in flight, DALI's ``__del__`` shuts it down once this callback lets go of it. Collected on the fifo
    watch thread, the shut-down is handed to a thread of its own: a fifo among the paths in flight would hold it until
    that watch opened it, for ever."""
    if not flight.batches:
        return
    if on_watch_thread():
        with contextlib.suppress(RuntimeError):  # (no thread can start at exit: shut down here, as before)
            threading.Thread(target=_collected, args=(pipe, flight), name="gpupipe-dali-shut-down").start()
            return
    try:
        _shut_down(pipe, flight)
    except RuntimeError as e:  # (as DALI's ``__del__``, which made this call before)
        _log.debug("DALI's pipeline, collected, failed to shut down: %s", e)


def to_torch(out, device: torch.device) -> torch.Tensor:
    """A DALI batch of equal-shaped images as a torch tensor, without a copy or a host wait: through DLPack on CUDA,
    numpy's buffer view on the host. The dynamic
    executor counts references to its buffers, so the tensor keeps DALI's output alive after ``release_outputs``;
    torch asks DALI, through the protocol's stream argument, to order the hand-over on the consumer's stream."""
    tensor = out.as_tensor()
    if device.type != "cuda":  # host memory: numpy's buffer view (it holds the tensor) is half DLPack's cost
        return torch.from_numpy(np.asarray(tensor))
    with torch.cuda.device(device):
        return torch.from_dlpack(tensor)


_DALI_LOG = re.compile(r"^\[(FATAL|ERROR|WARNING)\] \[([^\]]*)\] ?(.*)$")  # nvImageCodec's lines, colours removed
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def dali_log_kept() -> Iterator[list[str]]:
    """DALI's C++ log lines (nvImageCodec's ``[ERROR] [libjpeg_turbo_decoder] ...``, written to file descriptor 2;
    ``DALI_NVIMGCODEC_LOG_LEVEL`` silences at most its warnings) kept for gpupipe's own message instead of printed
    beside it: each line's text (``decoder: cause``) is appended to the list when the block ends. Whatever else the
    process wrote to fd 2 meanwhile is passed on."""
    kept: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield kept
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                m = _DALI_LOG.match(_COLOUR.sub("", line).strip())
                if m:
                    kept.append(f"{m[2]}: {m[3]}")
                else:
                    os.write(2, line.encode())


def _dali_failure(data: bytes, path: str, max_pixels: int | None, logged: list[str]) -> str:
    """Why DALI could not decode ``data``, worded as the other backends word it: Pillow's reason when Pillow cannot
    decode it either (a truncated file is one cause, one wording), else what DALI's decoder logged."""
    try:
        PillowDecoder(max_pixels).decode(data, path)
    except DecodeError as e:
        return e.reason
    return f"DALI: {decode_failure(logged[-1])}" if logged else "DALI could not decode it (Pillow can)"


def read_dali(data: bytes, path: str, max_pixels: int | None, device: torch.device) -> torch.Tensor:
    """``read_image(backend="dali")``: a one-image pipeline on ``device`` (slow to start: for checks, not loops)."""
    from nvidia.dali import fn, pipeline_def, types  # defer: heavy

    header = probe(data, path, "dali", max_pixels or default_max_pixels())  # the pixel limit, before any decode
    if header.image.format not in PIPELINE_FORMATS or header.image.mode in PILLOW_ONLY_MODES:
        return chw_tensor(PillowDecoder(max_pixels).decode_opened(header, path)).to(device)
    if not jpeg_header_sound(data):  # as the loader: DALI's decoder would print it (libjpeg's words) before failing
        try:
            return chw_tensor(PillowDecoder(max_pixels).decode_opened(header, path)).to(device)
        except DecodeError as e:
            raise DecodeError(path, "dali", e.reason) from None
    gpu = device.type == "cuda"

    @pipeline_def(batch_size=1, num_threads=1, device_id=dali_device_id(device), prefetch_queue_depth=1)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    p.feed_input("enc", [np.frombuffer(data, dtype=np.uint8)])
    with dali_log_kept() as logged:
        try:
            (out,) = p.run()
        except RuntimeError:
            out = None
    if out is None:
        raise DecodeError(path, "dali", _dali_failure(data, path, max_pixels, logged))
    arr = (out.as_cpu() if gpu else out).at(0)
    return chw_tensor(np.array(arr)).to(device)
