"""``gpupipe check DIR``: find unreadable and unusual files before a training run finds them."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from .backends.image import ARITHMETIC_SOF, Header, default_max_pixels, is_jpeg, jpeg_sof, probe
from .backends.pillow import PillowDecoder
from .errors import DecodeError

TINY = 32  # shorter side below this: valid, but a 224 crop of it is mostly interpolation
ELONGATED = 4.0  # aspect ratio above this: valid, but RandomResizedCrop falls back to a centre crop


def inspect(path: str, max_pixels: int | None = None) -> dict:
    """One file: ``{"path", "ok", "reason"?, "notes": [...]}``; ``notes`` lists what is unusual but valid."""
    limit = max_pixels or default_max_pixels()
    try:
        with open(path, "rb") as f:
            data = f.read()
        header = probe(data, path, "check", limit)
        notes = _format_notes(path, data, header) + _shape_notes(header)
        decoded = PillowDecoder(limit).decode_opened(header, path)
        decoded.getpixel((0, 0))
        h, w = header.upright_size
        return {"path": path, "ok": True, "notes": notes, "size": [w, h]}
    except DecodeError as e:
        return {"path": path, "ok": False, "reason": e.reason, "notes": []}
    except OSError as e:
        return {"path": path, "ok": False, "reason": f"cannot read the file ({e.strerror or e})", "notes": []}


def _format_notes(path: str, data: bytes, header: Header) -> list[str]:
    """What is unusual in how the file is stored: its name, colour mode, JPEG coding, orientation."""
    img = header.image
    notes = []
    suffix = path.lower().rsplit(".", 1)[-1]
    if suffix in ("jpg", "jpeg") and not is_jpeg(data):
        notes.append(f"{img.format} data under a .{suffix} name")
    if img.mode not in ("RGB",):
        notes.append(f"mode {img.mode}")
    if header.is_jpeg:
        if img.info.get("progressive") or img.info.get("progression"):
            notes.append("progressive JPEG")
        if jpeg_sof(data) in ARITHMETIC_SOF:
            notes.append("arithmetic-coded JPEG (nvJPEG falls back to Pillow)")
        if getattr(img, "layers", 3) == 4:
            notes.append("CMYK/YCCK JPEG (TurboJPEG and nvJPEG fall back to Pillow)")
    if header.orientation != 1:
        notes.append(f"EXIF orientation {header.orientation} (applied)")
    return notes


def _shape_notes(header: Header) -> list[str]:
    """What is unusual in the upright image's shape for a training crop."""
    h, w = header.upright_size
    notes = []
    if min(h, w) < TINY:
        notes.append(f"tiny ({w}x{h})")
    if max(h, w) / min(h, w) > ELONGATED:
        notes.append(f"elongated ({w}x{h})")
    return notes


def check(paths: list[str], workers: int, on_result=lambda r: None) -> list[dict]:
    results = []
    if workers <= 1:
        for p in paths:
            results.append(inspect(p))
            on_result(results[-1])
        return results
    with ProcessPoolExecutor(workers) as pool:
        for r in pool.map(inspect, paths, chunksize=16):
            results.append(r)
            on_result(r)
    return results
