"""The "speed up training" write-up's CIFAR-10 experiment as a benchmark: its loader beside gpupipe's on the same
dataset object, at its 227 px and batch 64, alone and under a simulated training step.

The write-up trains AlexNet on ``torchvision.datasets.CIFAR10(root, transform=Compose([Resize(227), ToTensor()]))``
through a ``DataLoader`` (batch 64, shuffled, its default 0 workers). Here, side by side in one run, on CIFAR-10-format
data made from photo-like images (:mod:`gpupipe.bench.cifar`, written first when ``DATA`` holds none):

- ``torchvision``: that loader, with each of ``--workers`` (default ``0,all``: none, then every usable core);
- ``pillow``, ``turbojpeg``, ``dali``: ``build_loader`` on the same dataset object (``transform=None``), the plain
  resize to 227 px (``Recipe(crop="resize", flip_p=0)``), normalised float batches, with the same workers;
- ``cache=device``: ``build_loader(..., cache="device")``, the set held on the device, no workers.

Each is timed twice: the **loader alone** (images a second over ``--seconds``, after its first two batches; the
time to the first batch beside it: the held set's one decode is there) and the **simulated step**: after each batch
a fixed step of ``--step-ms`` (a quarter of it CPU time on the training thread, the rest a wait that takes no CPU:
the GPU's compute, as in :mod:`gpupipe.bench.sim_step`), over ``--steps`` steps; the **data-wait** is the share of
that run spent in ``next()``. On the CPU the simulated step's gpupipe loaders hand
their batches to the meta device (every op dispatched, none computed, as a GPU's training thread only launches them);
with ``--device cuda`` they are real. A loader that cannot be built or fails is a row saying why, and the rest go on.
The report (``--json``) holds the machine, versions, date, settings, rows and ratios; the last line printed is its
rows and ratios as one JSON line.

    python -m gpupipe.bench.cifar_alexnet DATA [--count 10000] [--workers 0,all] [--backends pillow,turbojpeg,dali]
        [--device cpu] [--seconds 10] [--steps 20] [--step-ms 30] [--json bench/results/cifar-alexnet-DATE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .._options import Cache
from .._system import usable_cores
from ..api import build_loader
from ..backends import available_backends
from ..errors import run_script
from ..recipe import Recipe
from .cifar import BASE, CIFAR10Files, make_cifar10
from .host_budget import meta_loader
from .sim_step import forever, spin

META = torch.device("meta")


def _setting(default: float, text: str) -> Any:
    """A setting's default and its ``--help`` line."""
    return field(default=default, metadata={"help": f"{text} (default {default})"})


@dataclass(frozen=True)
class Settings:
    batch: int = _setting(64, "images per batch, every loader's (the write-up's)")
    size: int = _setting(227, "the side in pixels each image is resized to (the write-up's Resize)")
    seconds: float = _setting(10.0, "the loader alone: seconds of batches timed after its first 2, at least 3 batches")
    steps: int = _setting(20, "under the simulated step: steps timed, after 2 that start the loader")
    # AlexNet's forward and backward at batch 64 on a GPU stands here
    step_ms: float = _setting(30.0, "milliseconds of the simulated training step after each batch")
    cpu_share: float = _setting(0.25, "the step's share on the training thread's CPU, the rest a wait taking none")


def recipe(s: Settings) -> Recipe:
    """The write-up's ``Resize(227)`` of a square image: the whole image resized, no crop, no flip."""
    return Recipe(s.size, crop="resize", flip_p=0.0)


Batches = Generator[tuple[torch.Tensor, torch.Tensor]]


def writeup_batches(root: Path, s: Settings, workers: int, device: torch.device) -> Batches:
    """The write-up's loader: torchvision's CIFAR10 with ``Resize`` and ``ToTensor``, a shuffled ``DataLoader``; each
    batch moved to ``device``; yields the batches, epoch after epoch."""
    from torchvision import transforms as T

    dataset = CIFAR10Files(root, train=True, transform=T.Compose([T.Resize(s.size), T.ToTensor()]))
    cuda = device.type == "cuda"
    loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
        dataset, batch_size=s.batch, shuffle=True, num_workers=workers, pin_memory=cuda, persistent_workers=workers > 0
    )
    for images, labels in forever(loader):
        yield (images.to(device, non_blocking=cuda) if device.type != "meta" else images), labels


def gpupipe_batches(root: Path, backend: str, s: Settings, workers: int, device: torch.device) -> Batches:
    """gpupipe's loader on the same dataset object (no transform): ``backend``'s, or the set held on the device when
    ``backend`` is ``cache=device``; yields its batches as they come, epoch after epoch (what a loop over it runs after
    each is the step's)."""
    dataset = CIFAR10Files(root, train=True)
    cache: Cache | None = "device" if backend == "cache=device" else None
    name = "pillow" if cache else backend  # the held set decoded once by Pillow
    if device == META:
        loader = meta_loader(dataset, name, recipe(s), s.batch, workers, cache)
    else:
        r, batch = recipe(s), s.batch
        loader = build_loader(
            dataset, name, batch_size=batch, recipe=r, device=device, num_workers=workers, cache=cache
        )
    with loader:
        yield from forever(loader)


def images_per_second(batches: Batches, s: Settings, device: torch.device) -> tuple[float, float]:
    """The loader alone: images a second over at least ``s.seconds`` and 3 batches, after the first 2; and the
    seconds to the first batch (the loader built: a held set decoded, workers started)."""
    t0 = time.perf_counter()
    next(batches)
    first = time.perf_counter() - t0
    next(batches)
    t0, images, count = time.perf_counter(), 0, 0
    while count < 3 or time.perf_counter() - t0 < s.seconds:
        images += len(next(batches)[1])
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - t0), first


def data_wait(batches: Batches, s: Settings) -> dict:
    """The simulated step after each batch, over ``s.steps`` steps after 2: the share of the run in ``next()``."""
    step_cpu, step_wait = s.step_ms * s.cpu_share / 1e3, s.step_ms * (1 - s.cpu_share) / 1e3
    next(batches), next(batches)
    waits, t_run = [], time.perf_counter()
    for _ in range(s.steps):
        t0 = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - t0)
        spin(step_cpu)
        time.sleep(step_wait)
    total = time.perf_counter() - t_run
    return {"data_wait": round(sum(waits) / total, 4), "next_median_ms": round(statistics.median(waits) * 1e3, 2)}


def measure(make: Callable[[torch.device], Batches], s: Settings, device: torch.device) -> dict:
    """One loader's row: alone on ``device``, then under the simulated step (on the meta device for the CPU), each
    after a pause in which the last one's processes end and its memory goes back."""
    gc.collect()
    time.sleep(1.0)
    with contextlib.closing(make(device)) as batches:
        img_s, first = images_per_second(batches, s, device)
    gc.collect()
    time.sleep(1.0)
    with contextlib.closing(make(META if device.type == "cpu" else device)) as batches:
        waited = data_wait(batches, s)
    return {"img_s": round(img_s, 1), "first_batch_s": round(first, 4), **waited}


def contenders(root: Path, s: Settings, workers: list[int], backends: list[str]) -> Iterator[tuple[dict, Callable]]:
    """Each row's name and how its batches are made, in the order they run."""
    for w in workers:
        yield {"loader": "torchvision", "workers": w}, lambda d, w=w: writeup_batches(root, s, w, d)
        for b in backends:
            yield {"loader": b, "workers": w}, lambda d, b=b, w=w: gpupipe_batches(root, b, s, w, d)
    yield {"loader": "cache=device", "workers": 0}, lambda d: gpupipe_batches(root, "cache=device", s, 0, d)


def ratios(rows: list[dict]) -> dict:
    """Each gpupipe row's img/s over the write-up's loader's with the same workers, and ``cache=device``'s over the
    write-up's with each worker count."""
    base = {r["workers"]: r["img_s"] for r in rows if r["loader"] == "torchvision" and "img_s" in r}
    out = {}
    for r in rows:
        if r["loader"] == "torchvision" or "img_s" not in r:
            continue
        against = base.items() if r["loader"] == "cache=device" else [(r["workers"], base.get(r["workers"]))]
        for w, b in against:
            if b:
                out[f"{r['loader']} ({r['workers']} workers) / torchvision ({w} workers)"] = round(r["img_s"] / b, 2)
    return out


def _line(row: dict) -> str:
    name = f"{row['loader']:>12} {row['workers']:>2} workers"
    if "failed" in row:
        return f"{name}: failed: {row['failed']}"
    wait = f"data-wait {row['data_wait']:.1%} (median next() {row['next_median_ms']:.1f} ms)"
    return f"{name}: {row['img_s']:8.1f} img/s alone, {wait}"


def run(root: Path, s: Settings, workers: list[int], backends: list[str], device: torch.device) -> dict:
    """Every row, printed as it is measured, and the report: machine, versions, date, settings, rows, ratios."""
    from ..info import machine_info, source_commit  # the machine and the code beside every figure

    rows = []
    for name, make in contenders(root, s, workers, backends):
        try:
            rows.append({**name, **measure(make, s, device)})
        except Exception as e:  # a row saying why, and the rest go on
            rows.append({**name, "failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        print(_line(rows[-1]), flush=True)
    return {
        "kind": "cifar-alexnet",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": source_commit(),
        "machine": machine_info(),
        "data": str(root),
        "images": len(CIFAR10Files(root, train=True)),
        "device": str(device),
        "config": asdict(s),
        "results": rows,
        "ratios": ratios(rows),
    }


def _workers(text: str) -> list[int]:
    return [usable_cores() if w == "all" else int(w) for w in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path, help=f"a folder holding {BASE}/ (made there when it is not)")
    p.add_argument(
        "--count", type=int, default=10_000, help="train images to make when DATA holds none (default 10000)"
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default="0,all",
        help="comma-separated worker counts; all: every core (default 0,all)",
    )
    p.add_argument(
        "--backends",
        default="pillow,turbojpeg,dali",
        help="comma-separated gpupipe backends timed beside torchvision's loader, those available here (default "
        "pillow,turbojpeg,dali)",
    )
    p.add_argument(
        "--device", type=torch.device, default=torch.device("cpu"), help="where batches go: cpu or cuda (default cpu)"
    )
    defaults = Settings()
    for f in fields(Settings):
        value = getattr(defaults, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value, help=f.metadata["help"])
    p.add_argument("--json", type=Path, help="write the report here (bench/results/cifar-alexnet-*.json)")
    args = p.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in asdict(defaults)})
    if not (args.data / BASE / "batches.meta").is_file():
        make_cifar10(args.data, args.count)
    backends = [b for b in args.backends.split(",") if b in available_backends()]
    report = run(args.data, s, args.workers, backends, args.device)
    for what, ratio in report["ratios"].items():
        print(f"{what}: {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    row = {"what": "cifar-alexnet", "device": report["device"], "results": report["results"], **report["ratios"]}
    print(json.dumps(row))  # the last line: one JSON row, as bench/run_gpu.sh collects


if __name__ == "__main__":
    run_script(main)
