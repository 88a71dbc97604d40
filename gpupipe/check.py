"""``gpupipe check DIR``: find unreadable and unusual files before a training run finds them."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from .backends.image import ARITHMETIC_SOF, Header, default_max_pixels, is_jpeg, jpeg_sof, probe
from .backends.pillow import PillowDecoder
from .data.scan import ImageList
from .errors import DecodeError

TINY = 32  # shorter side below this: valid, but a 224 crop of it is mostly interpolation
ELONGATED = 4.0  # aspect ratio above this: valid, but RandomResizedCrop falls back to a centre crop


def inspect(path: str, max_pixels: int | None = None) -> dict:
    """One file: ``{"path", "ok", "reason"?, "notes": [...]}``; ``notes`` lists what is unusual but valid."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return {"path": path, "ok": False, "reason": f"cannot read the file ({e.strerror or e})", "notes": []}
    return inspect_bytes(data, path, max_pixels)


def inspect_bytes(data: bytes, path: str, max_pixels: int | None = None) -> dict:
    """:func:`inspect` of a sample's bytes (a shard member, an object), named ``path``."""
    limit = max_pixels or default_max_pixels()
    try:
        header = probe(data, path, "check", limit)
        notes = _format_notes(path, data, header) + _shape_notes(header)
        decoded = PillowDecoder(limit).decode_opened(header, path)
        decoded.getpixel((0, 0))
        h, w = header.upright_size
        return {"path": path, "ok": True, "notes": notes, "size": [w, h]}
    except DecodeError as e:
        return {"path": path, "ok": False, "reason": e.reason, "notes": []}


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


_source: ImageList | None = None  # a pool worker's data set


def _init_worker(source: ImageList) -> None:
    global _source
    _source = source


def _inspect_sample(index: int) -> dict:
    """One sample of a data set whose samples are not files (shards, a URL): read by the data set itself. A store
    that fails (``StorageError``) is raised, not reported as a bad sample."""
    assert _source is not None  # set by _init_worker
    path = _source.samples[index][0]
    try:
        data = _source.read(index)
    except OSError as e:
        return {"path": path, "ok": False, "reason": f"cannot read the sample ({e.strerror or e})", "notes": []}
    return inspect_bytes(data, path)


def check_source(source: ImageList, workers: int, on_result=lambda r: None) -> list[dict]:
    """:func:`check` of every sample of any source ``open_source`` opens."""
    if source.reads_files:
        return check([p for p, _ in source.samples], workers, on_result)
    results = []
    if workers <= 1:
        _init_worker(source)
        for i in range(len(source)):
            results.append(_inspect_sample(i))
            on_result(results[-1])
        return results
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(source,)) as pool:
        for r in pool.map(_inspect_sample, range(len(source)), chunksize=16):
            results.append(r)
            on_result(r)
    return results
