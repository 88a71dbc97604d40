"""The host budget: how much of the training thread each GPU path takes per batch, measured on any machine.

A GPU loader keeps an H100 fed only if the thread that runs the training step spends little time in
``next(loader)``: DALI's own pipeline delivers a 256-image batch every ~12 ms on an H100, and the model's Python needs
the same thread. This measures that thread's CPU time (``time.thread_time()`` around ``next()``: decode workers,
DALI's threads and the pin thread are other threads or processes and are not counted), with the GPU's own work left
out: the loader's device side targets the **meta device**, so every op it would launch on CUDA is dispatched (its
host cost counted) and none computes. For ``nvjpeg`` the decode is a stand-in that parses each JPEG's frame header
on the host and returns an empty tensor of the decoded shape (the Huffman pass nvJPEG's hybrid backend may run on
the host is not counted). ``dali`` runs its CPU pipeline in its own threads and hands its output over as on CUDA.
``pillow`` is the CPU path feeding the same device side: its training-thread cost is taking finished batches from
the workers and the device stage. Thread time is barely affected by other load on the machine (unlike throughput).

    python -m gpupipe.bench.host_budget DATA [DATA ...] --sizes 224 32 --batch 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..api import build_loader
from ..augment import Policy, SampleAugment
from ..backends import available_backends, get
from ..backends.nvjpeg import NvjpegLoader
from ..data.device import DeviceStage
from ..recipe import Recipe

META = torch.device("meta")
POLICY: dict[str, Any] = {
    "auto_augment": "rand-m9-mstd0.5-inc1",
    "re_prob": 0.25,
}  # timm's ImageNet recipe: RandAugment + erasing
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def jpeg_shape(data) -> tuple[int, int]:
    """(height, width) from a JPEG's frame header: the host's share of an nvJPEG decode, done by the stand-in."""
    pos = 2
    while pos + 9 < len(data):
        if data[pos] != 0xFF:
            pos += 1
            continue
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _SOF:
            return int.from_bytes(data[pos + 5 : pos + 7], "big"), int.from_bytes(data[pos + 7 : pos + 9], "big")
        pos += 2 + (length if marker not in (0xD8, 0x01) and not 0xD0 <= marker <= 0xD7 else 0)
    raise ValueError("no JPEG frame header")


def _stand_in_decode(data):
    """nvJPEG's call, answered with empty meta tensors of the shapes it would decode."""
    if not isinstance(data, list):
        return _stand_in_decode([data])[0]
    out = []
    for d in data:
        h, w = jpeg_shape(memoryview(d.numpy()))
        out.append(torch.empty(3, h, w, dtype=torch.uint8, device=META))
    return out


class StandInNvjpegLoader(NvjpegLoader):
    """The nvjpeg loader with its device side on the meta device and its decode replaced by :func:`_stand_in_decode`."""

    decode_devices = ("meta",)

    def decoder(self):
        return _stand_in_decode


def meta_loader(root: str, backend: str, recipe: Recipe, batch: int, workers: int):
    """``backend``'s loader as ``build_loader`` makes it for CUDA (augmentation on the device stage from the sample
    keys), with the device stage on the meta device."""
    base = "pillow" if backend == "nvjpeg" else backend  # nvjpeg's constructor insists on CUDA: parts from pillow's
    loader = build_loader(root, base, batch_size=batch, num_workers=workers, device="cpu", recipe=recipe)
    stage = DeviceStage(META, recipe, augment=SampleAugment(Policy(recipe), loader.seed))
    parts = dataclasses.replace(loader.parts, stage=stage)
    if backend == "nvjpeg":
        return StandInNvjpegLoader(parts)
    return get(backend).make_loader(parts)


def thread_ms(loader, batches: int, warmup: int = 2) -> list[float]:
    """The training thread's CPU milliseconds in each ``next()``, over ``batches`` after ``warmup`` (across epochs)."""

    def forever() -> Iterator:
        while True:
            yield from loader

    it, out = forever(), []
    for k in range(warmup + batches):
        t0 = time.thread_time()
        next(it)
        if k >= warmup:
            out.append((time.thread_time() - t0) * 1e3)
    return out


def run(roots: list[str], sizes: list[int], batch: int, batches: int, workers: int, backends: list[str]) -> list[dict]:
    rows = []
    for root in roots:
        for size in sizes:
            for backend in backends:
                for policy in (False, True):
                    recipe = Recipe(size, **(POLICY if policy else {}))
                    ms = thread_ms(meta_loader(root, backend, recipe, batch, workers), batches)
                    med = statistics.median(ms)
                    rows.append(
                        {
                            "data": root,
                            "size": size,
                            "backend": backend,
                            "policy": "rand-m9-mstd0.5-inc1 + re_prob 0.25" if policy else "",
                            "batch": batch,
                            "ms_per_batch": round(med, 3),
                            "ms_max": round(max(ms), 3),
                            "one_core_img_s": round(batch / med * 1e3) if med > 0 else None,
                        }
                    )
                    print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    pol = " +policy" if r["policy"] else ""
    return (
        f"{Path(r['data']).name:>14} {r['size']:>4}px {r['backend']:>8}{pol:<8} {r['ms_per_batch']:8.2f} ms/batch "
        f"(max {r['ms_max']:.2f})  one-core ceiling {r['one_core_img_s']} img/s"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="+", help="image folders (ImageNet-like photos, large photos)")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="measured per row, after 2 untimed")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backends", nargs="+", default=["pillow", "dali", "nvjpeg"])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    backends = [b for b in args.backends if b == "nvjpeg" or b in available_backends()]
    rows = run(args.data, args.sizes, args.batch, args.batches, args.workers, backends)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "method": __doc__}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
