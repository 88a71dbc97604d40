"""The benchmark jobs that are not a loader: each yields the sizes of the batches it delivers, forever, and
``gpupipe bench`` (:mod:`.suite`) times them. The ``decode`` pipeline's jobs (bytes in, RGB at full size out, nothing
else) for the backends that decode batches themselves, keyed by backend name in :data:`DECODE_JOBS` (the CPU decoders
need none: the suite runs their ``decoder`` in DataLoader workers), and DALI's own reference pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..backends.dali_files import dali_decodes
from ..backends.dali_graph import dali_device_id
from ..backends.nvjpeg import decoder_on_stream
from ..image import default_max_pixels, is_jpeg
from ..recipe import IMAGENET_MEAN, IMAGENET_STD
from ..sources.scan import ImageList

_DALI_PREFETCH = 2  # batches in flight in DALI's decode job


def dali_decode_counts(dataset, cfg) -> Iterator[int]:
    """``gpupipe bench``'s decode pipeline for DALI: bytes in, RGB at full size out, nothing else; yields batch
    sizes."""
    from nvidia.dali import fn, pipeline_def, types

    gpu = cfg.device.type == "cuda"
    blobs = map(dataset.read, range(len(dataset)))
    # what the dali backend hands DALI (one unreadable file would stop DALI's pipeline; the loaders skip such files
    # and name them), judged from each header once: within the loaders' pixel limit, an image DALI decodes
    data = [np.frombuffer(b, dtype=np.uint8) for b in blobs if dali_decodes(b, default_max_pixels())]

    @pipeline_def(
        batch_size=cfg.batch_size,
        num_threads=max(1, cfg.workers),
        device_id=dali_device_id(cfg.device),
        prefetch_queue_depth=1,
        exec_dynamic=True,
    )
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    batches = [data[i : i + cfg.batch_size] for i in range(0, len(data), cfg.batch_size)]
    k = 0
    for _ in range(_DALI_PREFETCH):
        p.feed_input("enc", batches[k % len(batches)])
        p.schedule_run()
        k += 1
    while True:
        (out,) = p.outputs()
        p.feed_input("enc", batches[k % len(batches)])
        p.schedule_run()
        k += 1
        yield len(out)


def dali_reference_counts(dataset, cfg, train: bool) -> Iterator[int]:
    """DALI's own pipeline, as its documentation writes it (``readers.file`` -> ``decoders.image_random_crop`` ->
    ``resize`` -> ``crop_mirror_normalize``; eval: ``decoders.image`` -> ``resize`` -> centre crop), normalized
    float32 CHW batches on ``cfg.device``, as the dali backend delivers them: what it is measured against, side by
    side. Its crops are DALI's own, not the recipe's."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    gpu = cfg.device.type == "cuda"
    S = cfg.image_size
    decode_device = "mixed" if gpu else "cpu"

    @pipeline_def(
        batch_size=cfg.batch_size, num_threads=max(1, cfg.workers), device_id=dali_device_id(cfg.device), seed=0
    )
    def pipe():
        # DALI's reader stops at a bad file (a truncated JPEG too): only those the dali backend hands DALI
        readable = [(p, label) for p, label in dataset.samples if dali_decodes(p, default_max_pixels())]
        jpegs, labels = fn.readers.file(
            files=[p for p, _ in readable], labels=[label for _, label in readable], random_shuffle=train, name="Reader"
        )
        if train:
            images = fn.decoders.image_random_crop(
                jpegs,
                device=decode_device,
                output_type=types.RGB,
                random_area=[0.08, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3],
            )
            images = fn.resize(images, resize_x=S, resize_y=S)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(S / 0.875))
            mirror = 0
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(S, S),
            mirror=mirror,
            mean=[m * 255 for m in IMAGENET_MEAN],
            std=[s * 255 for s in IMAGENET_STD],
        )
        return images, labels

    it = DALIGenericIterator(
        pipe(), ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True
    )
    while True:
        for out in it:
            yield len(out[0]["labels"])


def nvjpeg_decode_counts(dataset, cfg) -> Iterator[int]:
    """``gpupipe bench``'s decode pipeline for nvJPEG: batched decode on CUDA from bytes held in memory, on a stream
    of its own (as the nvjpeg loader decodes)."""
    data = []
    for i in range(len(dataset)):
        raw = dataset.read(i)
        if is_jpeg(raw):
            data.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if not data:
        raise ValueError("no JPEG files to decode with nvjpeg")
    decode = decoder_on_stream(cfg.device, torch.cuda.Stream(cfg.device))
    while True:
        for i in range(0, len(data), cfg.batch_size):
            yield len(decode(data[i : i + cfg.batch_size]))


# backend name -> its ``decode`` pipeline job ``(dataset, bench config) -> iterator of batch sizes``
DECODE_JOBS: dict[str, Callable[[ImageList, Any], Iterator[int]]] = {
    "dali": dali_decode_counts,
    "nvjpeg": nvjpeg_decode_counts,
}
