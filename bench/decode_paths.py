"""Issue 24: the ways past the resize, timed side by side in one process on real photos (bench/README.md, "Four ways
past the resize").

Each variant decodes (and, where it says so, crops and resizes to 224 x 224) the same photos with the train recipe's
kind of boxes (RandomResizedCrop's scale and ratio, seeded), one thread, in interleaved rounds; the median ms per
image of the rounds. Variants whose library is missing are left out and named.

    python bench/decode_paths.py data/photos --count 300 --rounds 3 --json bench/results/decode-paths-DATE.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from turbojpeg import TJFLAG_FASTDCT, TJFLAG_FASTUPSAMPLE, TJPF_RGB, TJPF_RGBX, TurboJPEG

from gpupipe.image import _resize_into

SIZE = 224


def boxes_for(tj: TurboJPEG, datas: list[bytes], seed: int = 0) -> list[tuple[int, int, int, int]]:
    """(left, top, width, height) per photo, drawn as RandomResizedCrop(scale=(0.08, 1), ratio=(3/4, 4/3)) does."""
    rng, out = random.Random(seed), []
    for data in datas:
        w, h, _, _ = tj.decode_header(data)
        area = w * h * rng.uniform(0.08, 1)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = min(w, round(math.sqrt(area * ratio))), min(h, round(math.sqrt(area / ratio)))
        out.append((rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch))
    return out


def variants(tj: TurboJPEG, datas: list[bytes], boxes: list) -> tuple[dict[str, Callable[[], None]], list[str]]:
    """The variants to time (name -> one pass over the photos), and the libraries missing for the others."""
    pairs = list(zip(datas, boxes, strict=True))
    out = torch.empty(SIZE, SIZE, 3, dtype=torch.uint8)
    found: dict[str, Callable[[], None]] = {
        "decode (accurate IDCT, fancy upsampling: the floor's)": lambda: _decode(tj, datas),
        "decode, TJFLAG_FASTDCT": lambda: _decode(tj, datas, TJFLAG_FASTDCT),
        "decode, TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE": lambda: _decode(
            tj, datas, TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE
        ),
        "decode at scale 7/8": lambda: _decode(tj, datas, scale=(7, 8)),
        "decode, then torch resize of the crop (train's)": lambda: _torch_resize(tj, pairs, out),
        "decode to RGBX, then torch resize": lambda: _rgbx_resize(tj, pairs, out),
        "lossless crop (tj.crop), then decode": lambda: _lossless_crop(tj, pairs),
        "decode, then Pillow resize(box=)": lambda: _pillow_resize(tj, pairs, out),
    }
    missing = []
    for name, make in (("nvImageCodec", _nvimgcodec_roi), ("OpenCV", _opencv_area)):
        try:
            label, run = make(tj, pairs, out)
            found[label] = run
        except (ImportError, RuntimeError) as e:
            missing.append(f"{name}: {e}")
    return found, missing


def _decode(tj: TurboJPEG, datas: list[bytes], flags: int = 0, scale=None) -> None:
    for d in datas:
        tj.decode(d, pixel_format=TJPF_RGB, flags=flags, scaling_factor=scale)


def _torch_resize(tj: TurboJPEG, pairs: list, out: torch.Tensor) -> None:
    for d, (x, y, w, h) in pairs:
        _resize_into(tj.decode(d, pixel_format=TJPF_RGB)[y : y + h, x : x + w], out)


def _rgbx_resize(tj: TurboJPEG, pairs: list, out: torch.Tensor) -> None:
    out4 = torch.empty(SIZE, SIZE, 4, dtype=torch.uint8)
    for d, (x, y, w, h) in pairs:
        _resize_into(tj.decode(d, pixel_format=TJPF_RGBX)[y : y + h, x : x + w], out4)
        out.copy_(out4[..., :3])


def _lossless_crop(tj: TurboJPEG, pairs: list) -> None:
    for d, (x, y, w, h) in pairs:
        x0, y0 = x // 16 * 16, y // 16 * 16  # the crop's corner on the MCU grid
        tj.decode(tj.crop(d, x0, y0, w + x - x0, h + y - y0), pixel_format=TJPF_RGB)


def _pillow_resize(tj: TurboJPEG, pairs: list, out: torch.Tensor) -> None:
    for d, (x, y, w, h) in pairs:
        img = Image.fromarray(tj.decode(d, pixel_format=TJPF_RGB))
        out.numpy()[...] = np.asarray(img.resize((SIZE, SIZE), Image.BILINEAR, box=(x, y, x + w, y + h)))


def _nvimgcodec_roi(tj: TurboJPEG, pairs: list, out: torch.Tensor) -> tuple[str, Callable[[], None]]:
    from nvidia import nvimgcodec  # installed with DALI

    dec = nvimgcodec.Decoder(
        device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
        max_num_cpu_threads=1,
        backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
        options=":fancy_upsampling=1",
    )

    def roi() -> None:
        for d, (x, y, w, h) in pairs:
            region = nvimgcodec.Region(start=(y, x), end=(y + h, x + w))
            np.asarray(dec.decode(nvimgcodec.CodeStream(d).get_sub_code_stream(region=region)).cpu())

    return "decode of the crop only (nvImageCodec CPU)", roi


def _opencv_area(tj: TurboJPEG, pairs: list, out: torch.Tensor) -> tuple[str, Callable[[], None]]:
    import cv2

    cv2.setNumThreads(1)

    def area() -> None:
        for d, (x, y, w, h) in pairs:
            crop = tj.decode(d, pixel_format=TJPF_RGB)[y : y + h, x : x + w]
            cv2.resize(crop, (SIZE, SIZE), dst=out.numpy(), interpolation=cv2.INTER_AREA)

    return "decode, then OpenCV INTER_AREA (FFCV's resize)", area


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    files = sorted(f for f in args.data.rglob("*") if f.suffix.lower() in (".jpg", ".jpeg"))[: args.count]
    if not files:
        raise SystemExit(f"error: {args.data}: no JPEG files")
    tj = TurboJPEG()
    datas = [f.read_bytes() for f in files]
    found, missing = variants(tj, datas, boxes_for(tj, datas))
    times: dict[str, list[float]] = {k: [] for k in found}
    for _ in range(args.rounds):
        for name, run in found.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) / len(datas) * 1e3)
    rows = [{"variant": k, "ms_per_image": statistics.median(v), "rounds": v} for k, v in times.items()]
    for r in rows:
        print(f"{r['ms_per_image']:7.3f} ms  {r['variant']}")
    for m in missing:
        print(f"left out: {m}")
    if args.json:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "photos": f"{len(datas)} from {args.data}",
            "command": "python bench/decode_paths.py "
            + " ".join(f"{a}" for a in (args.data, "--count", args.count, "--rounds", args.rounds)),
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "left_out": missing}, indent=1))


if __name__ == "__main__":
    main()
