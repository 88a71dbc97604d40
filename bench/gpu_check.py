"""The measurements of bench/run_gpu.sh, one per process (each prints one JSON row; ``collect`` makes the part's file).

    python bench/gpu_check.py loader DATA BACKEND [--device cuda]        # the loader alone: images/s
    python bench/gpu_check.py e2e DATA BACKEND --model resnet50          # the model trained fed by it, bf16,
                                                                          # channels-last: images/s and data-wait
    python bench/gpu_check.py dali-own DATA [--model resnet50]           # DALI's own pipeline, alone or feeding
    python bench/gpu_check.py memory DATA dali                           # the GPU memory a loader holds
    python bench/gpu_check.py train-wait OUT                             # `gpupipe train`'s data-wait, from OUT
    python bench/gpu_check.py collect ROWS.jsonl OUT.json                # the rows, with device, date and versions

Every figure is from a fresh process (no loader, pipeline or cuDNN state left by another), after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import gpupipe
from gpupipe.bench.end_to_end import _train_rate
from gpupipe.bench.records import Config
from gpupipe.sources.open import open_source


def _loader(args, backend: str):
    return gpupipe.build_loader(
        args.data,
        backend,
        batch_size=args.batch,
        train=True,
        image_size=args.size,
        device=args.device,
        num_workers=args.workers,
        channels_last=True,
        drop_last=True,
        on_error="skip",
    )


def _rate(batches: Iterator, seconds: float, device: torch.device) -> tuple[float, int]:
    """images/s over ``seconds`` after a warm-up of a quarter of that (at least 2 s), the GPU's work included."""
    until = time.perf_counter() + max(2.0, seconds / 4)
    while time.perf_counter() < until:
        next(batches)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0, images = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        images += next(batches)
    sync()
    return images / (time.perf_counter() - t0), images


def _forever(loader) -> Iterator[int]:
    while True:
        for _, labels in loader:
            yield len(labels)


def loader_alone(args) -> dict:
    rate, images = _rate(_forever(_loader(args, args.backend)), args.seconds, torch.device(args.device))
    return {"what": "loader", "backend": args.backend, "images_per_s": rate, "images": images}


def end_to_end(args) -> dict:
    import timm

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    classes = len(open_source(args.data).classes)
    model = timm.create_model(args.model, num_classes=classes).to(device, memory_format=torch.channels_last).train()
    cfg = Config(args.data, [args.backend], ["train"], args.workers, device, args.batch, args.seconds, 1, args.size)
    rate, wait = _train_rate(cfg, args.backend, model)  # bf16 autocast on CUDA, SGD, channels-last
    return {"what": f"train:{args.model}", "backend": args.backend, "images_per_s": rate, "data_wait": wait}


def dali_own(args) -> dict:
    """DALI's ResNet-50 training pipeline as its documentation writes it (the "ResNet-50 ... DALI" example:
    readers.file -> decoders.image_random_crop on "mixed" -> resize -> crop_mirror_normalize), fed to the model or
    timed alone."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    device_id = 0 if args.device == "cuda" else None
    decode_device = "mixed" if device_id is not None else "cpu"
    out_device = "gpu" if device_id is not None else "cpu"

    @pipeline_def(batch_size=args.batch, num_threads=max(args.workers, 1), device_id=device_id, seed=0)
    def resnet50_pipeline():
        jpegs, labels = fn.readers.file(file_root=args.data, random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs,
            device=decode_device,
            output_type=types.RGB,
            random_aspect_ratio=[0.75, 4 / 3],
            random_area=[0.08, 1.0],
            num_attempts=100,
        )
        images = fn.resize(images, device=out_device, resize_x=args.size, resize_y=args.size)
        mirror = fn.random.coin_flip(probability=0.5)
        images = fn.crop_mirror_normalize(
            images.gpu() if device_id is not None else images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(args.size, args.size),
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
            mirror=mirror,
        )
        return images, labels.gpu() if device_id is not None else labels

    pipe = resnet50_pipeline()
    pipe.build()
    it = DALIGenericIterator(
        pipe, ["data", "label"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )
    loader = _DaliBatches(it)
    if args.model is None:
        rate, images = _rate(_forever(loader), args.seconds, torch.device(args.device))
        return {"what": "loader", "backend": "dali-own", "images_per_s": rate, "images": images}
    args.backend = "dali-own"
    import gpupipe.bench.end_to_end as e2e

    e2e.build_loader = lambda *a, **k: loader  # _train_rate's loader: DALI's own pipeline
    return end_to_end(args)


class _DaliBatches:
    """DALI's iterator as (images, labels) batches, channels-last as the model takes them."""

    def __init__(self, it):
        self.it = it

    def __iter__(self):
        for out in self.it:
            images = out[0]["data"].contiguous(memory_format=torch.channels_last)
            yield images, out[0]["label"].squeeze(-1).long()


def memory(args) -> dict:
    """The GPU memory a loader holds after 20 batches: the device's free memory before and after (DALI allocates
    outside torch's allocator), and what torch's caching allocator reserved."""
    torch.cuda.init()
    free_before, total = torch.cuda.mem_get_info()
    it = _forever(_loader(args, args.backend))
    for _ in range(20):
        next(it)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    held = free_before - free_after
    return {
        "what": "gpu_memory",
        "backend": args.backend,
        "held_mib": held / 2**20,
        "torch_reserved_mib": torch.cuda.memory_reserved() / 2**20,
        "total_mib": total / 2**20,
    }


def train_wait(args) -> dict:
    """The last epoch of `gpupipe train` in ``out``: its images/s and data-wait."""
    last = json.loads((Path(args.out) / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "what": "gpupipe train",
        "run": Path(args.out).name,
        **{k: last.get(k) for k in ("epoch", "images_per_s", "data_wait", "train_loss", "fp16_skipped_steps")},
    }


def collect(args) -> dict:
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    versions = {}
    for name in (
        "torch",
        "torchvision",
        "nvidia-dali-cuda130",
        "nvidia-dali-cuda120",
        "timm",
        "torchcodec",
        "PyTurboJPEG",
    ):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu: {_cpu_model()}"
    out = {
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "versions": versions,
        "python": platform.python_version(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return {"what": "collected", "rows": len(rows), "file": args.out}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["loader", "e2e", "dali-own", "memory", "train-wait", "collect"])
    p.add_argument("paths", nargs="*", help="DATA [BACKEND], OUT, or ROWS.jsonl OUT.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=None, help="default: gpupipe's (every usable core)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    if args.command == "collect":
        args.rows, args.out = args.paths
    elif args.command == "train-wait":
        (args.out,) = args.paths
    else:
        args.data, args.backend = [*args.paths, None][:2]
    run = {
        "loader": loader_alone,
        "e2e": end_to_end,
        "dali-own": dali_own,
        "memory": memory,
        "train-wait": train_wait,
        "collect": collect,
    }[args.command]
    if args.workers is None:
        from gpupipe._system import usable_cores

        args.workers = usable_cores()
    print(json.dumps({**run(args), "device": args.device}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
