"""Build a benchmark folder of JPEGs cut from real photographs, for machines that cannot download ImageNet.

Decode speed depends on what is in the pixels (Huffman coding of real texture, noise and edges), so the generated
sample data are a poor stand-in for timing. This takes real colour photographs (by default the ones shipped
inside the scikit-image and scikit-learn wheels and matplotlib, fetched with ``pip download`` from the package
registry; or ``--source DIR`` with your own) and writes varied JPEGs from them:

- ``--kind imagenet``: random crops (50-100 % of the area), resized so the long side is 300-640 px, quality 75-95,
  4:2:0 chroma subsampling, as most of ImageNet;
- ``--kind large``: mosaics of 2x2 to 4x3 crops at full resolution, 1.3-8 MP, quality 85-95, as camera photos;
- ``--kind mixed``: ImageNet-like sizes written as a web crawl's are: quality 60-98, a third progressive, a third
  4:4:4 (the rest 4:2:0), half with optimised Huffman tables, one in ten with an EXIF orientation (stored turned),
  one in fifty greyscale: another encoder mix for the same decoders, where one set could hide a cost.

    python bench/real_photos.py --out data/photos --kind imagenet --count 1000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

WHEEL_PHOTOS = {  # real colour photographs shipped inside wheels (not charts, not grey textures)
    "scikit-image": [
        "skimage/data/astronaut.png",
        "skimage/data/chelsea.png",
        "skimage/data/coffee.png",
        "skimage/data/motorcycle_left.png",
        "skimage/data/motorcycle_right.png",
        "skimage/data/rocket.jpg",
        "skimage/data/hubble_deep_field.jpg",
        "skimage/data/retina.jpg",
        "skimage/data/ihc.png",
    ],
    "scikit-learn": ["sklearn/datasets/images/china.jpg", "sklearn/datasets/images/flower.jpg"],
}


def fetch_sources(dest: Path) -> list[Path]:
    """Photos from the wheels above (downloaded, not installed) and matplotlib's grace_hopper.jpg."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp]
        subprocess.run([*cmd, *WHEEL_PHOTOS], check=True)
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if any(name in members for members in WHEEL_PHOTOS.values()):
                        (dest / Path(name).name).write_bytes(z.read(name))
    try:
        import matplotlib

        hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        if hopper.exists():
            (dest / hopper.name).write_bytes(hopper.read_bytes())
    except ImportError:
        pass
    return sorted(dest.iterdir())


def _crop(rng: np.random.Generator, img: Image.Image, min_area: float) -> Image.Image:
    w, h = img.size
    area = rng.uniform(min_area, 1.0)
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw = min(w, round(float(np.sqrt(w * h * area * ratio))))
    ch = min(h, round(float(np.sqrt(w * h * area / ratio))))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    out = img.crop((x, y, x + cw, y + ch))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out


def imagenet_like(rng: np.random.Generator, photos: list[Image.Image]) -> tuple[Image.Image, int]:
    img = _crop(rng, photos[int(rng.integers(len(photos)))], 0.5)
    long_side = int(rng.integers(300, 641))
    scale = long_side / max(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.LANCZOS)
    return img, int(rng.integers(75, 96))


def large(rng: np.random.Generator, photos: list[Image.Image]) -> tuple[Image.Image, int]:
    cols, rows = int(rng.integers(2, 5)), int(rng.integers(2, 4))
    tw, th = int(rng.integers(500, 900)), int(rng.integers(450, 800))
    canvas = Image.new("RGB", (cols * tw, rows * th))
    for r in range(rows):
        for c in range(cols):
            src = photos[int(rng.integers(len(photos)))]
            tile = _crop(rng, src, 0.3).resize((tw, th), Image.Resampling.LANCZOS)
            canvas.paste(tile, (c * tw, r * th))
    return canvas, int(rng.integers(85, 96))


def _save_mixed(rng: np.random.Generator, img: Image.Image, path: Path) -> None:
    """``--kind mixed``: the image written with one of the encoder settings a crawl of the web collects."""
    kw: dict = {"quality": int(rng.integers(60, 99)), "optimize": bool(rng.random() < 0.5)}
    kw["progressive"] = bool(rng.random() < 1 / 3)
    kw["subsampling"] = "4:4:4" if rng.random() < 1 / 3 else "4:2:0"
    if rng.random() < 0.02:
        img = img.convert("L")
    if rng.random() < 0.1:  # stored turned, with the EXIF tag that turns it upright
        orientation = int(rng.choice([3, 6, 8]))
        turn = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
        img = img.transpose(turn[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    img.save(path, **kw)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kind", choices=["imagenet", "large", "mixed"], default="imagenet")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--classes", type=int, default=10, help="folders, so ImageFolder-style tools accept the set")
    p.add_argument("--source", type=Path, help="a folder of your own photos instead of the wheels' ones")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.source:
        sources = sorted(f for f in args.source.iterdir() if f.is_file())
    else:
        sources = fetch_sources(args.out.parent / f".{args.out.name}-sources")
    photos = []
    for f in sources:
        with Image.open(f) as im:
            if im.mode in ("RGB", "RGBA", "P", "CMYK", "YCbCr"):
                photos.append(im.convert("RGB"))
    if not photos:
        raise SystemExit(f"no colour photos among {len(sources)} source files")
    make = large if args.kind == "large" else imagenet_like
    ours = {f"class_{i % args.classes:02d}/img_{i:05d}.jpg" for i in range(args.count)}
    others = [f for f in args.out.glob("*/*") if f.relative_to(args.out).as_posix() not in ours]
    if others:  # never deleted: they are somebody's files, but they would be timed as part of the set
        print(
            f"warning: {args.out} already holds {len(others)} other files (e.g. {others[0]}); they stay, and "
            "gpupipe bench will time them too: use a new --out for a clean set"
        )
    rng = np.random.default_rng(args.seed)
    pixels = 0
    for i in range(args.count):
        d = args.out / f"class_{i % args.classes:02d}"
        d.mkdir(parents=True, exist_ok=True)
        img, quality = make(rng, photos)
        if args.kind == "mixed":
            _save_mixed(rng, img, d / f"img_{i:05d}.jpg")
        else:
            img.save(d / f"img_{i:05d}.jpg", quality=quality, subsampling="4:2:0")
        pixels += img.width * img.height
    mean_mp = pixels / args.count / 1e6
    print(f"{args.out}: {args.count} {args.kind} JPEGs from {len(photos)} photos, mean {mean_mp:.2f} MP")


if __name__ == "__main__":
    main()
