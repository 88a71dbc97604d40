"""The host budget: how much of the training thread each GPU path takes per batch, measured on any machine.

A GPU loader keeps an H100 fed only if the thread that runs the training step spends little time in ``next(loader)``:
DALI's own pipeline delivers a 256-image batch every few milliseconds on an H100 (bench/README.md: the training thread's
CPU per batch), and the model's Python needs the same thread. This measures that thread's CPU time
(``time.thread_time()`` around ``next()``: decode workers, DALI's threads, nvjpeg's decode thread and the pin thread are
other threads or processes and are not counted), with the GPU's own work left out: the loader's device side targets the
**meta device**, so every op it would launch on CUDA is dispatched (its host cost counted) and none computes. For
``nvjpeg`` the decode is a stand-in that parses each JPEG's frame header on the host and returns an empty tensor of the
decoded shape, on the loader's decode thread as the real decode. ``dali`` runs its CPU pipeline in its own threads and
hands its output over as on CUDA; the loader's own thread feeds DALI and assembles its batches. Python threads in the
training process, like that one and nvjpeg's decode thread, share its interpreter lock: their CPU time per batch is
reported beside (``loader_thread_ms``). ``pillow`` is the CPU path feeding the same device side: a thread of the
loader's own takes its batches off the workers and copies them out of their buffers (on CUDA, DataLoader's pin thread
does), and the training thread's cost is the device stage. Thread time is barely affected by other load on the machine
(unlike throughput).

    python -m gpupipe.bench.host_budget DATA [DATA ...] --sizes 224 32 --batch 256 [--device cuda]

With ``--device cuda`` (a GPU machine) the real loaders run: their GPU work is asynchronous, so it stays outside the
thread's CPU time unless something makes the host wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._options import Cache
from ..api import build_loader
from ..augment import Policy, SampleAugment
from ..backends import available_backends, get
from ..backends.held import held_loader
from ..backends.nvjpeg import NvjpegLoader
from ..data.device import DeviceStage
from ..data.loader import Batch
from ..errors import run_script
from ..plumbing.host_pack import HostPack
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
    """The nvjpeg loader with its device side on the meta device and its decode replaced by :func:`_stand_in_decode`.

    The stand-in parses each frame header in Python and makes each output tensor: work the real decoder does in one
    C++ call. The loader runs it on its decode thread, so it is no part of the training thread's time; a call made on
    the main thread (none, since the decode thread) would be kept in ``stand_in_s``, left out of the loader's time by
    :func:`thread_ms` and reported beside it (the real call's host cost is what ``--device cuda`` measures)."""

    decode_devices = ("meta",)
    stand_in_s = 0.0

    def decoder(self):
        def timed(data):
            t0 = time.thread_time()
            try:
                return _stand_in_decode(data)
            finally:
                if threading.current_thread() is threading.main_thread():
                    self.stand_in_s += time.thread_time() - t0

        return timed


def meta_loader(root: Any, backend: str, recipe: Recipe, batch: int, workers: int, cache: Cache | None = None):
    """``backend``'s loader as ``build_loader`` makes it for CUDA (augmentation on the device stage from the sample
    keys), with the device stage on the meta device; with ``cache``, the set held as ``build_loader(cache=...)``
    holds it, there (sized from the headers, nothing decoded)."""
    base = "pillow" if backend == "nvjpeg" else backend  # nvjpeg's constructor insists on CUDA: parts from pillow's
    loader = build_loader(root, base, batch_size=batch, num_workers=workers, device="cpu", recipe=recipe)
    stage = DeviceStage(META, recipe, augment=SampleAugment(Policy(recipe), loader.seed))
    parts = dataclasses.replace(loader.parts, stage=stage)
    if cache is not None:
        return held_loader(parts, get(backend), cache)
    if backend == "nvjpeg":
        return StandInNvjpegLoader(parts)
    return get(backend).make_loader(parts)


def thread_ms(loader, batches: int, warmup: int = 2) -> tuple[list[float], list[float], float]:
    """The training thread's CPU milliseconds in each ``next()``, over ``batches`` after ``warmup`` (across epochs),
    less a decode stand-in's own time (``stand_in_s``), and that stand-in time per batch; with them, the mean CPU
    milliseconds per batch of the loader's own threads in the training process (``thread_cpu``: they share its
    interpreter)."""

    def forever() -> Iterator:
        while True:
            yield from loader

    def beside() -> float:
        return loader.thread_cpu[0]

    it, out, stand_in = forever(), [], []
    for k in range(warmup + batches):
        if k == warmup:
            before = beside()
        s0, t0 = getattr(loader, "stand_in_s", 0.0), time.thread_time()
        next(it)
        spent, excluded = time.thread_time() - t0, getattr(loader, "stand_in_s", 0.0) - s0
        if k >= warmup:
            out.append((spent - excluded) * 1e3)
            stand_in.append(excluded * 1e3)
    return out, stand_in, (beside() - before) * 1e3 / batches


def make_loader(root: str, backend: str, recipe: Recipe, batch: int, workers: int, device: str):
    """On ``meta``: :func:`meta_loader`; on ``cuda``: the real loader (its GPU work is asynchronous, so outside the
    thread's CPU time unless something synchronises)."""
    if device == "meta":
        return meta_loader(root, backend, recipe, batch, workers)
    return build_loader(root, backend, batch_size=batch, num_workers=workers, device=device, recipe=recipe)


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched with a tensor on the meta device (``ops``) and those of them that are not views
    (``launches``: the kernels the device stage would launch; a view only changes a tensor's metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device == META for t in (out if isinstance(out, tuple) else (out,))):
            self.ops += 1
            self.launches += not getattr(func, "is_view", False)
        return out


def policy_ms(size: int, batch: int, batches: int) -> dict[str, float]:
    """The device stage's host cost for :data:`POLICY` per batch: drawing each sample's ops and packing their
    arguments (host work on any device: measured), and the ops the stage then dispatches to the device (counted on
    the meta device; each one that is not a view is a kernel launch on CUDA, a few microseconds of host time there:
    ``--device cuda`` on a GPU machine measures them. The meta device itself is no stand-in for their time: several
    of its kernels are Python decompositions, a millisecond each)."""
    recipe = Recipe(size, **POLICY)
    augment = SampleAugment(Policy(recipe), 0)
    stage = DeviceStage(META, recipe, augment=augment)
    images = torch.zeros(batch, 3, size, size, dtype=torch.uint8)
    draw, ops, launches = [], [], []
    for e in range(batches + 1):
        keys = torch.stack([torch.full((batch,), e), torch.arange(batch)], 1)
        t0 = time.thread_time()
        augment.prepare(keys, HostPack())
        draw.append((time.thread_time() - t0) * 1e3)
        with _OpCounter() as counter:
            stage.upload(Batch(images, torch.arange(batch), "NCHW", keys=keys))
        ops.append(counter.ops)
        launches.append(counter.launches)
    return {
        "draw_and_pack": statistics.median(draw[1:]),
        "device_ops": statistics.median(ops[1:]),
        "device_launches": statistics.median(launches[1:]),
    }


def run(
    roots: list[str], sizes: list[int], batch: int, batches: int, workers: int, backends: list[str], device: str
) -> list[dict]:
    rows = []
    for root in roots:
        for size in sizes:
            for backend in backends:
                recipe = Recipe(size)
                ms, stand_in, threads = thread_ms(make_loader(root, backend, recipe, batch, workers, device), batches)
                rows.append(_row(root, device, size, backend, batch, statistics.median(ms), max(ms)))
                rows[-1]["loader_thread_ms"] = round(threads, 3)  # beside the training thread, sharing its interpreter
                if any(stand_in):  # left out above: the real decoder's one C++ call does this work
                    rows[-1]["stand_in_ms_excluded"] = round(statistics.median(stand_in), 3)
                print(_line(rows[-1]), flush=True)
    for size in sizes:
        cost = policy_ms(size, batch, batches)
        rows.append(_row("-", "host", size, "policy: draw + pack", batch, cost["draw_and_pack"], cost["draw_and_pack"]))
        rows[-1]["device_ops"] = cost["device_ops"]
        rows[-1]["device_launches"] = cost["device_launches"]
        ops = f" + {cost['device_ops']:.0f} device ops, {cost['device_launches']:.0f} of them kernel launches on CUDA"
        print(_line(rows[-1]), ops, flush=True)
    return rows


def _row(root: str, device: str, size: int, backend: str, batch: int, med: float, top: float) -> dict:
    from ..info import machine_info  # the CPU model beside every figure: thread time depends on it

    return {
        "cpu": machine_info()["cpu"],
        "data": root,
        "device": device,
        "size": size,
        "backend": backend,
        "batch": batch,
        "ms_per_batch": round(med, 3),
        "ms_max": round(top, 3),
        "one_core_img_s": round(batch / med * 1e3) if med > 0 else None,
    }


def _line(r: dict) -> str:
    excluded = ""
    if "stand_in_ms_excluded" in r:
        excluded = f"  (decode stand-in, left out: {r['stand_in_ms_excluded']:.2f} ms)"
    if "loader_thread_ms" in r:
        excluded += f"  (the loader's own thread: {r['loader_thread_ms']:.2f} ms)"
    return (
        f"{Path(r['data']).name:>18} {r['size']:>4}px {r['backend']:>28} {r['ms_per_batch']:8.2f} ms/batch "
        f"(max {r['ms_max']:.2f})  one-core ceiling {r['one_core_img_s']} img/s{excluded}  [{r['cpu']}]"
    )


def from_cli(args, data: str) -> int:
    """``gpupipe bench --host-budget``: at each ``--image-size`` and 32 px, ``--batch-size``, on CUDA with ``--device
    cuda``, else with the GPU side on the meta device."""
    argv = [data, "--sizes", *map(str, args.image_size), "32", "--batch", str(args.batch_size)]
    argv += ["--device", "cuda" if args.device == "cuda" else "meta"]
    argv += ["--workers", str(args.workers)] if args.workers is not None else []
    argv += ["--backends", *args.backends.split(",")] if args.backends else []
    argv += ["--json", args.json] if args.json else []
    main(argv)
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="+", help="image folders (ImageNet-like photos, large photos)")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="measured per row, after 2 untimed")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backends", nargs="+", default=["pillow", "dali", "nvjpeg"])
    p.add_argument("--device", choices=["meta", "cuda"], default="meta", help="meta: the GPU's work left out")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    backends = [b for b in args.backends if (b == "nvjpeg" and args.device == "meta") or b in available_backends()]
    rows = run(args.data, args.sizes, args.batch, args.batches, args.workers, backends, args.device)
    if args.json:
        from ..info import machine_info, source_commit

        m = machine_info()
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "method": __doc__}
        meta["machine"] = f"{m['cpu']} ({m['cores_usable']} cores)"
        meta["command"] = "python -m gpupipe.bench.host_budget " + " ".join(argv if argv is not None else sys.argv[1:])
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "commit": source_commit()}, indent=1))


if __name__ == "__main__":
    run_script(main)
