"""``gpupipe check DIR``: find unreadable and unusual files before a training run finds them."""

from __future__ import annotations

from collections.abc import Iterator

from ._files import read_regular
from ._pool import ordered_map
from .backends.pillow import PillowDecoder
from .errors import DecodeError
from .image import ARITHMETIC_SOF, Header, default_max_pixels, is_jpeg, jpeg_sof, probe
from .sources.scan import ImageList

TINY = 32  # shorter side below this: valid, but a 224 crop of it is mostly interpolation
ELONGATED = 4.0  # aspect ratio above this: valid, but RandomResizedCrop falls back to a centre crop


def inspect(path: str, max_pixels: int | None = None) -> dict:
    """One file: ``{"path", "ok", "reason"?, "notes": [...]}``; ``notes`` lists what is unusual but valid."""
    try:
        data = read_regular(path)  # a fifo or a device is reported, never read
    except OSError as e:
        return {"path": path, "ok": False, "reason": f"cannot read the file ({e.strerror or e})", "notes": []}
    return inspect_bytes(data, path, max_pixels)


def inspect_bytes(data: bytes, path: str, max_pixels: int | None = None) -> dict:
    """:func:`inspect` of a sample's bytes (a file's, or a shard member's), named ``path``."""
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


_source: ImageList | None = None  # a pool worker's data set


def _init_worker(source: ImageList) -> None:
    global _source
    _source = source


def _inspect_sample(index: int) -> dict:
    """Sample ``index`` of the worker's data set, read as every loader reads it (a file, or a shard's member)."""
    assert _source is not None  # set by _init_worker
    name = _source.samples[index][0]
    if not _source.reads_files:
        try:
            return inspect_bytes(_source.read(index), name)
        except OSError as e:
            return {"path": name, "ok": False, "reason": f"cannot read the sample ({e.strerror or e})", "notes": []}
    return inspect(name)


def check(source: ImageList | list[str], workers: int, on_result=lambda r: None) -> list[dict]:
    """:func:`inspect` each sample of ``source`` (a scanned data set: a folder, a CSV list, shards; or file paths)
    with ``workers`` processes (a worker that dies is replaced: ``_pool.ordered_map``), after what the scan left out
    (``source.problems``, each unreadable)."""
    if not isinstance(source, ImageList):
        source = ImageList("", [(p, 0) for p in source], [])
    results = []
    for path, reason in source.problems:  # what the scan left out: unreadable folders, fifos, devices, links
        results.append({"path": path, "ok": False, "reason": reason, "notes": []})
        on_result(results[-1])
    if workers <= 1:
        _init_worker(source)
        found: Iterator[dict] = map(_inspect_sample, range(len(source)))
    else:
        found = ordered_map(
            _inspect_sample,
            range(len(source)),
            workers,
            initializer=_init_worker,
            initargs=(source,),
            name=lambda i: source.samples[i][0],
            what=f"{source.root}: a check worker",
        )
    for r in found:
        results.append(r)
        on_result(r)
    return results


def check_source(source: ImageList, workers: int, on_result=lambda r: None) -> list[dict]:
    """:func:`check` of every sample of any source ``open_source`` opens."""
    return check(source, workers, on_result)
