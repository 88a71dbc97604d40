"""The turbojpeg eval crop, decoded whole or only where its resize reads (``TurboJpegDecoder._cut_reads``), on one
thread, the same files in alternating rounds: milliseconds per image, the median of the rounds.

    python bench/eval_cut.py data/photos data/photos-mixed data/photos-large --json bench/results/eval-cut-DATE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gpupipe.backends import turbojpeg as tj
from gpupipe.recipe import Recipe


def per_image_ms(blobs: list[tuple[bytes, str]], size: int, cut: bool) -> float:
    decoder, out, plan = tj.TurboJpegDecoder(), np.empty((size, size, 3), np.uint8), Recipe(size).eval_box
    if not cut:
        decoder._cut_reads = lambda *args: None  # the whole decode, then the cut (the fallback's path)
    t = time.thread_time()
    for data, path in blobs:
        decoder.crop(data, path, plan, size, out)
    return (time.thread_time() - t) / len(blobs) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+")
    p.add_argument("--files", type=int, default=300)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for data in args.data:
        paths = sorted(q for q in Path(data).rglob("*") if q.suffix.lower() in (".jpg", ".jpeg"))[: args.files]
        blobs = [(q.read_bytes(), str(q)) for q in paths]
        times: dict[str, list[float]] = {"whole": [], "cut": []}
        for r in range(args.rounds):
            for mode in ("cut", "whole") if r % 2 == 0 else ("whole", "cut"):
                times[mode].append(per_image_ms(blobs, args.size, mode == "cut"))
        whole, cut = statistics.median(times["whole"]), statistics.median(times["cut"])
        rows.append(
            {"data": data, "files": len(blobs), "whole_ms": whole, "cut_ms": cut, "ratio": whole / cut, "rounds": times}
        )
        print(f"{data}: whole decode {whole:.2f} ms, the cut's reads {cut:.2f} ms per image: {whole / cut:.2f}x")
    if args.json:
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "size": args.size,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
