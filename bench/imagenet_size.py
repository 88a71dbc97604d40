"""Memory and start-up at ImageNet's size: a 1.28M-file ImageFolder (1000 classes x 1281 hard links to a few small
JPEGs, so it costs inodes' directory entries, not 1.28M images' bytes), loaded with 2 workers by gpupipe (pillow)
and by torchvision's ImageFolder + DataLoader.

Per loader, in a fresh process: seconds to the first batch, the main process's RSS, and each worker's private
memory (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup: the pages it no longer shares with the main
process) after its first batch and after 200 batches. The sample list is what grows a worker: a Python list of
tuples has its reference counts written as workers read it, so its pages are copied into every worker.

    python bench/imagenet_size.py [--root /tmp/imagenet-links] [--out bench/results/imagenet_size_memory.json]
    python bench/imagenet_size.py --loaders gpupipe-pillow,gpupipe-dali --runs 2 --out ...   # issue 21's start-up

Memory figures do not depend on how busy the machine is; start-up seconds do (say so where they are quoted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES, PER_CLASS, BATCHES, BATCH = 1000, 1281, 200, 64


def make_tree(root: Path) -> None:
    """1000 class folders of 1281 hard links each (ImageNet's 1,281,000 train files), made once."""
    done = root / ".complete"
    if done.exists():
        return
    src = root.with_name(root.name + "-sources")  # outside: every folder in root is a class
    src.mkdir(parents=True, exist_ok=True)
    for c in range(CLASSES):  # one source per class: a file system caps the links to one inode (ext4: 65000)
        source = src / f"s{c}.jpg"
        if not source.exists():
            rng = np.random.default_rng(c)
            Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(source, quality=80)
        d = root / f"n{c:08d}"
        d.mkdir(exist_ok=True)
        for i in range(PER_CLASS):
            target = d / f"n{c:08d}_{i}.JPEG"
            if not target.exists():
                os.link(source, target)
    done.write_text("ok")


def private_mb(pid: int) -> float:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":"):
                fields[parts[0][:-1]] = int(parts[1])
    return (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return sorted(out)


def measure(kind: str, root: str) -> dict:
    """One loader in this process (called in a fresh child by main)."""
    import torch

    started = time.perf_counter()
    if kind.startswith("gpupipe-"):
        import gpupipe

        backend = kind.removeprefix("gpupipe-")
        loader = gpupipe.build_loader(
            root, backend, batch_size=BATCH, image_size=32, num_workers=2, device="cpu", normalize=False
        )
    else:
        from torchvision import datasets
        from torchvision import transforms as T

        tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()])
        loader = torch.utils.data.DataLoader(
            datasets.ImageFolder(root, tf), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True
        )
    it = iter(loader)
    next(it)
    first_batch_s = time.perf_counter() - started
    workers = children(os.getpid())
    at_first = {w: private_mb(w) for w in workers}
    main_first = rss_mb(os.getpid())
    for _ in range(BATCHES - 1):
        next(it)
    at_end = {w: private_mb(w) for w in workers}
    return {
        "loader": kind,
        "first_batch_s": round(first_batch_s, 2),
        "main_rss_mb": {"after_first_batch": round(main_first, 1), f"after_{BATCHES}": round(rss_mb(os.getpid()), 1)},
        "worker_private_mb": [
            {"after_first_batch": round(at_first[w], 1), f"after_{BATCHES}": round(at_end[w], 1)} for w in workers
        ],
        "worker_growth_mb": [round(at_end[w] - at_first[w], 1) for w in workers],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/imagenet-links")
    ap.add_argument("--out", default="bench/results/imagenet_size_memory.json")
    ap.add_argument(
        "--loaders",
        default="gpupipe-pillow,torchvision-imagefolder",
        help="comma-separated: gpupipe-<backend> (e.g. gpupipe-dali) or torchvision-imagefolder",
    )
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per loader (a second run sees warm caches)")
    ap.add_argument("--note", default="first_batch_s was taken on a shared, busy 2-core machine")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this loader here
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.root)))
        return
    t = time.perf_counter()
    make_tree(Path(args.root))
    print(f"tree ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    rows = []
    for kind in args.loaders.split(","):
        for n in range(args.runs):
            subprocess.run(["sync"], check=False)
            run = subprocess.run(
                [sys.executable, __file__, "--root", args.root, "--one", kind], capture_output=True, text=True
            )
            if run.returncode != 0:
                sys.exit(f"{kind}: failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
            rows.append({**json.loads(run.stdout.strip().splitlines()[-1]), "run": n + 1})
            print(json.dumps(rows[-1]), file=sys.stderr)
    from gpupipe.info import machine_info

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "data": f"{CLASSES} classes x {PER_CLASS} hard-linked 64x80 JPEGs ({CLASSES * PER_CLASS} files)",
        "settings": {"workers": 2, "batch_size": BATCH, "batches": BATCHES, "image_size": 32, "device": "cpu"},
        "note": f"memory is independent of machine load; {args.note}",
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
