"""Time to accuracy: a resolution schedule (progressive resizing) against a fixed size, the same epochs, several seeds
(bench/README.md, "Progressive resizing").

Runs ``gpupipe train`` (one process per run, in turns: fixed, schedule, fixed, schedule, ...) and records each run's
wall time, the train images per second of each epoch, the held-out accuracy after each epoch and the machine's load
average before and after the run, into one JSON file.

    python bench/progressive_resize.py --data data/sample --val data/sample-val --seeds 0 1 \\
        --json bench/results/progressive-resize-sample-DATE.json -- --model resnet10t --image-size 96 --epochs 8 \\
        --batch-size 32 --lr 0.2 --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpupipe.info import machine_info


def one_run(data: str, val: str, seed: int, common: list[str], schedule: list[str], out: Path) -> dict:
    """One ``gpupipe train`` run; its wall time (the whole command, start-up included) and metrics per epoch."""
    cmd = [sys.executable, "-m", "gpupipe", "train", "--data", data, "--val", val, "--seed", str(seed)]
    cmd += ["--out", str(out), *common, *schedule]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "schedule": " ".join(schedule) or "fixed",
        "wall_s": wall,
        "val_acc": [e.get("val_acc") for e in epochs],
        "image_size": [e.get("image_size") for e in epochs],
        "images_per_s": [e["images_per_s"] for e in epochs],
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/sample")
    p.add_argument("--val", default="data/sample-val")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--schedule",
        default="--res-start 64 --res-end 96 --res-start-epoch 2 --res-end-epoch 6 --res-step 16",
        help="the schedule's flags (against the fixed --image-size of the common flags)",
    )
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("common", nargs=argparse.REMAINDER, help="-- then the flags every run shares")
    args = p.parse_args(argv)
    common = [a for a in args.common if a != "--"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, schedule in (("fixed", []), ("schedule", args.schedule.split())):
                runs.append(one_run(args.data, args.val, seed, common, schedule, Path(tmp) / f"{name}-{seed}"))
                print(json.dumps(runs[-1]), flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": {"data": args.data, "val": args.val, "common": common, "schedule": args.schedule},
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
