"""``gpupipe prepare SRC OUT``: convert a data set to tar shards in the WebDataset layout, with an index and
metadata, so that loading needs no directory scan, no header reads and no slow JPEG variants.

Every file is decoded once on the way (``gpupipe check``'s test): bad ones are reported and left out. JPEGs that
already fit are copied byte for byte; the rest (not JPEG, progressive, arithmetic-coded, CMYK, EXIF-rotated, with a
damaged header, over ``max_side``, 4:4:4/4:2:2 with ``subsampling="420"``) are re-encoded to baseline RGB JPEG with
Pillow.

Layout of ``OUT`` (see :mod:`gpupipe.sources.shards` for the reader)::

    shard-000000.tar   members {index:08d}.jpg and {index:08d}.cls (the label as ASCII digits), index = sample
    shard-000000.json  the shard's manifest: byte size, sha256, its samples' rows and source range, files left out
    index.npz          per sample: shard, offset, size (of the .jpg member's data), label, height, width, source
    gpupipe.json       format, version, source, options, classes, class_to_idx, shards, counts, files left out

A shard is written to a hidden temporary name and renamed once complete, then its manifest; ``gpupipe.json`` is
written last. An interrupted run resumes after the last shard whose manifest matches its bytes, and gives the same
files as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from PIL import Image, JpegImagePlugin

from ._files import read_regular
from ._options import PREPARE_DEFAULTS
from ._pool import ordered_map
from ._runlock import LOCK_NAME, RunLock
from .backends.pillow import PillowDecoder
from .errors import DecodeError, GpupipeError
from .image import ARITHMETIC_SOF, Header, default_max_pixels, jpeg_header_sound, jpeg_sof, probe
from .sources.named import is_named_dataset
from .sources.open import open_source
from .sources.remote import is_url
from .sources.scan import ImageList
from .sources.shard_writer import BLOCK, ShardWriter, complete_shards, write_durably
from .sources.shards import FORMAT, INDEX, META, VERSION

PLAN = ".prepare-plan.json"  # what an unfinished prepare in this folder was asked to do
_SAMPLINGS = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}  # Pillow's JpegImagePlugin.get_sampling codes


@dataclass(frozen=True)
class PrepareOptions:
    """What the shards hold. ``max_side``: longer side cap (None keeps the size); ``quality``: JPEG quality of
    re-encoded images; ``shard_size``: bytes per shard at most (one sample more when it alone is larger);
    ``subsampling``: ``"keep"`` the source's chroma subsampling, or re-encode 4:4:4/4:2:2 JPEGs to ``"420"``;
    ``order``: the samples in the ``"source"``'s order (an ImageFolder's: class by class), or ``"shuffled"`` (one fixed
    random order, seed 0), so that every shard holds a random part of the data set, as WebDataset's tools advise:
    what ``build_loader(shuffle_window=K)`` needs to mix classes in a batch. The set's sample numbers follow it."""

    max_side: int | None = None
    quality: int = PREPARE_DEFAULTS.quality
    shard_size: int = PREPARE_DEFAULTS.shard_size
    subsampling: Literal["keep", "420"] = PREPARE_DEFAULTS.subsampling
    order: Literal["source", "shuffled"] = PREPARE_DEFAULTS.order

    def __post_init__(self):
        if self.max_side is not None and self.max_side < 1:
            raise ValueError(f"max_side must be >= 1, got {self.max_side}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {self.quality}")
        if self.shard_size < 4 * BLOCK:
            raise ValueError(f"shard_size must be at least {4 * BLOCK} bytes, got {self.shard_size}")
        if self.subsampling not in ("keep", "420"):
            raise ValueError(f"subsampling must be 'keep' or '420', got {self.subsampling!r}")
        if self.order not in ("source", "shuffled"):
            raise ValueError(f"order must be 'source' or 'shuffled', got {self.order!r}")

    def sample_order(self, count: int) -> np.ndarray:
        """The source's sample indices in the order the shards hold them."""
        if self.order == "source":
            return np.arange(count)
        return np.random.default_rng(0).permutation(count)


class Converted(NamedTuple):
    """One source file's fate: the JPEG to store and its upright size, or why it is left out."""

    data: bytes | None
    height: int
    width: int
    changes: tuple[str, ...]  # why it was re-encoded; empty when copied as it is
    reason: str | None = None  # why it is left out (``gpupipe check``'s words)


@dataclass
class Summary:
    out: Path | str  # a folder, or the URL prepared into
    samples: int
    shards: int
    copied: int
    reencoded: dict[str, int]  # per cause (a file may have several)
    left_out: list[dict] = field(default_factory=list)  # {"path", "reason"}, as ``gpupipe check --json`` lists them
    resumed_at: int = 0  # source samples already done by an earlier, interrupted run
    up_to_date: bool = False  # ``out`` already held this prepared set: nothing was done


def parse_size(text: str) -> int:
    """``"512MB"``, ``"2GiB"``, ``"100k"`` or a byte count; units are powers of 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"expected a size such as 512MB or 2GB, got {text!r}")
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))


def convert(data: bytes, path: str, options: PrepareOptions, max_pixels: int | None = None) -> Converted:
    """Check one file by decoding it, and return what to store: the bytes as they are when they already fit, else a
    baseline RGB JPEG of the decoded image (upright, at most ``max_side``)."""
    limit = max_pixels or default_max_pixels()
    try:
        header = probe(data, path, "prepare", limit)
        changes = _changes(data, header, options)
        h, w = header.upright_size
        th, tw = _fit(h, w, options.max_side)
        if (th, tw) != (h, w):
            changes.append("larger than max-side")
            if header.is_jpeg:  # decode at the DCT scale that still covers the target: far less work on big photos
                header.image.draft(None, (th, tw) if header.orientation in (5, 6, 7, 8) else (tw, th))
        sampling = JpegImagePlugin.get_sampling(header.image) if header.is_jpeg else -1
        decoded = PillowDecoder(limit).decode_opened(header, path)  # RGB, upright; raises on truncated data
    except DecodeError as e:  # PIL names the in-memory buffer by its address: not a word worth keeping
        return Converted(None, 0, 0, (), re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", e.reason))
    if not changes:
        return Converted(data, h, w, ())
    if decoded.size != (tw, th):
        decoded = decoded.resize((tw, th), Image.Resampling.LANCZOS)
    keep = options.subsampling == "keep" and sampling in _SAMPLINGS
    buf = io.BytesIO()
    decoded.save(buf, "JPEG", quality=options.quality, subsampling=sampling if keep else 2)
    return Converted(buf.getvalue(), th, tw, tuple(changes))


def _changes(data: bytes, header: Header, options: PrepareOptions) -> list[str]:
    """Why a file cannot be stored as it is (size aside): what is slow or unusual for the decoders."""
    img, changes = header.image, []
    if not header.is_jpeg:
        changes.append(f"{img.format} (not JPEG)")
    else:
        if img.info.get("progressive") or img.info.get("progression"):
            changes.append("progressive")
        if jpeg_sof(data) in ARITHMETIC_SOF:
            changes.append("arithmetic-coded")
        if img.mode not in ("RGB", "L"):
            changes.append(f"{img.mode} JPEG")
        if not jpeg_header_sound(data):  # overwritten bytes that Pillow decodes past and DALI's parser does not
            changes.append("damaged header")
        sampling = JpegImagePlugin.get_sampling(img)
        if options.subsampling == "420" and sampling in (0, 1):
            changes.append(_SAMPLINGS[sampling])
    if header.orientation != 1:
        changes.append("EXIF orientation")
    return changes


def _fit(h: int, w: int, max_side: int | None) -> tuple[int, int]:
    if max_side is None or max(h, w) <= max_side:
        return h, w
    scale = max_side / max(h, w)
    return max(1, round(h * scale)), max(1, round(w * scale))


_job: tuple[ImageList, PrepareOptions, np.ndarray] | None = None  # a pool worker's source, options and order


def _init_worker(source: ImageList, options: PrepareOptions) -> None:
    global _job
    _job = (source, options, options.sample_order(len(source)))


def _convert_sample(place: int) -> Converted:
    """The sample at ``place`` of the shards' order."""
    assert _job is not None  # set by _init_worker
    source, options, order = _job
    index = int(order[place])
    path = source.samples[index][0]
    try:
        data = read_regular(path) if source.reads_files else source.read(index)  # never a fifo or a device
    except OSError as e:
        return Converted(None, 0, 0, (), f"cannot read the file ({e.strerror or e})")
    return convert(data, path, options)


def _results(
    source: ImageList, options: PrepareOptions, order: np.ndarray, start: int, workers: int
) -> Iterator[Converted]:
    """Converted samples from place ``start`` of ``order`` (the source's indices in the shards' order) on, in that
    order, from ``workers`` processes."""
    indices = range(start, len(source))
    if workers <= 1:
        _init_worker(source, options)
        yield from map(_convert_sample, indices)
        return
    yield from ordered_map(  # a worker that dies is replaced and its samples done again
        _convert_sample,
        indices,
        workers,
        initializer=_init_worker,
        initargs=(source, options),
        name=lambda place: source.samples[int(order[place])][0],
        what=f"{source.root}: a prepare worker",
    )


def _fingerprint(source: ImageList) -> str:
    """Which samples, labels and classes the source holds: a resumed run must read the same data set."""
    h = hashlib.sha256(json.dumps(source.classes).encode())
    for name, label in source.samples:
        h.update(os.fsencode(name) + f"\t{label}\n".encode())  # a name's own bytes: it need not be UTF-8
    return h.hexdigest()


def _absolute(src) -> str | list[str]:
    if isinstance(src, (list, tuple)):
        return [os.path.abspath(p) for p in src]
    return os.path.abspath(src)


def prepare(
    src,
    out: str | os.PathLike,
    options: PrepareOptions | None = None,
    *,
    workers: int = 1,
    on_progress: Callable[[int, int], None] | None = None,
    allow_outside_root: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Summary:
    """Write ``src`` (anything ``build_loader`` reads) to ``out`` as tar shards, index and metadata.

    Args:
        src: an ImageFolder, a CSV list, shards, Parquet files, or a dataset named ``module:callable`` or
            ``module.Class:ROOT``.
        out: an empty folder (made if missing), or one this function was interrupted in, with the same source and
            options: it then resumes. Or a URL (``s3://bucket/prefix``): see :mod:`gpupipe.sources.publish`.
        workers: processes that read, check and re-encode; the shards are written in dataset order by this one.
        on_progress: called with (source samples done, total) as the work advances.
        storage_options: for a URL ``out``, passed to its fsspec file system (credentials, endpoint).
    """
    options = options or PrepareOptions()
    if not is_url(src) and not (isinstance(src, str) and is_named_dataset(src)):  # a dataset's name is kept as is
        src = _absolute(src)  # the same sample names (so fingerprint) from any working directory
    source = open_source(src, allow_outside_root=allow_outside_root)
    if is_url(out):
        return _prepare_to_url(source, src, str(out), options, workers, on_progress, storage_options)
    out = Path(out)
    if isinstance(src, str) and os.path.isdir(src) and Path(src).resolve() in (out.resolve(), *out.resolve().parents):
        raise ValueError(f"{out}: inside the source folder {src}; write the shards elsewhere (a rescan would see them)")
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out, "output folder"):  # a second prepare into it would delete this one's temp shards
        return _prepare_locked(source, src, out, options, workers, on_progress)


def _prepare_locked(
    source: ImageList,
    src,
    out: Path,
    options: PrepareOptions,
    workers: int,
    on_progress: Callable[[int, int], None] | None,
) -> Summary:
    """:func:`prepare` into a local folder this process holds."""
    plan = _plan(source, src, options)
    if (out / META).exists():
        return _up_to_date(out, plan)
    try:
        _start_or_resume(out, plan)
        manifests = complete_shards(out)
        start = manifests[-1]["source_end"] if manifests else 0
        pending = _write_shards(out, source, options, manifests, start, workers, on_progress)
        return _finish(out, source, plan, manifests, pending, start)
    except OSError as e:  # a full disk, a quota: one line, and the complete shards stay for the resume
        if e.errno is None:  # one of this module's own refusals (FileExistsError with a message)
            raise
        raise GpupipeError(
            f"{e.filename or out}: cannot write it ({e.strerror or e}); the complete shards are kept: run the same "
            "command again to resume"
        ) from None


def _plan(source: ImageList, src, options: PrepareOptions) -> dict:
    settings = asdict(options)
    if settings["order"] == "source":  # what every set prepared before the option was written with: theirs match
        del settings["order"]
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": getattr(src, "url", src),  # a Remote is recorded by its URL (never its storage options)
        "options": settings,
        "fingerprint": _fingerprint(source),
    }


def _prepare_to_url(
    source: ImageList,
    src,
    url: str,
    options: PrepareOptions,
    workers: int,
    on_progress: Callable[[int, int], None] | None,
    storage_options: dict[str, Any] | None,
) -> Summary:
    """:func:`prepare` into object storage, through a local staging folder that holds one shard at a time."""
    from .sources.publish import Upload  # defer: fsspec and its store are needed only here

    upload, plan = Upload(url, storage_options), _plan(source, src, options)
    meta = upload.json(META)
    if meta is not None:
        return _up_to_date(url, plan, meta)
    upload.start_or_resume(plan)
    manifests = upload.complete_shards()
    start = manifests[-1]["source_end"] if manifests else 0
    pending = _write_shards(upload.staging, source, options, manifests, start, workers, on_progress, upload.shard_done)
    summary = _finish(upload.staging, source, plan, manifests, pending, start)
    upload.finish()
    summary.out = url
    return summary


def _up_to_date(out: Path | str, plan: dict, meta: dict | None = None) -> Summary:
    """The summary of the set ``out`` already holds, when it was prepared with this plan."""
    meta = meta or json.loads((Path(out) / META).read_text())
    if {k: meta.get(k) for k in plan} != plan:
        raise FileExistsError(
            f"{out}: holds a data set prepared with other settings ({_differ(meta, plan)}); "
            "remove it or choose another folder"
        )
    return Summary(
        out, meta["samples"], len(meta["shards"]), meta["copied"], meta["reencoded"], meta["left_out"], up_to_date=True
    )


def _differ(held: dict, plan: dict) -> str:
    """The settings of ``plan`` that ``held`` (a folder's) has otherwise, as ``--option held -> asked``."""
    out = []
    for key, asked in plan.items():
        was = held.get(key)
        if was == asked:
            continue
        if key == "options" and isinstance(was, dict):
            default = asdict(PrepareOptions())  # a plan leaves out an option at its default (order)
            old, new = {**default, **was}, {**default, **asked}
            out += [f"--{o.replace('_', '-')} {old[o]} -> {new[o]}" for o in new if old.get(o) != new[o]]
        else:
            out.append("the source's files changed" if key == "fingerprint" else f"{key} {was} -> {asked}")
    return "; ".join(out)


def _start_or_resume(out: Path, plan: dict) -> None:
    """Write the plan into an empty ``out``; in a folder that holds one, go on only when it is this plan."""
    if (out / PLAN).exists():
        if (held := json.loads((out / PLAN).read_text())) != plan:
            raise FileExistsError(
                f"{out}: holds an interrupted prepare with other settings ({_differ(held, plan)}); "
                "remove it or choose another folder"
            )
    elif any(p.name != LOCK_NAME for p in out.iterdir()):
        raise FileExistsError(f"{out}: not empty; prepare writes into an empty folder (or resumes its own)")
    else:
        write_durably(out / PLAN, json.dumps(plan).encode())


def _write_shards(
    out: Path,
    source: ImageList,
    options: PrepareOptions,
    manifests: list[dict],
    start: int,
    workers: int,
    on_progress: Callable[[int, int], None] | None,
    on_shard: Callable[[dict], None] = lambda manifest: None,
) -> list[dict]:
    """Convert the samples from place ``start`` of ``options.sample_order`` on and write them in that order into shards
    of at most ``options.shard_size``,
    appending each closed shard's manifest to ``manifests`` (and handing it to ``on_shard``). Returns the files left
    out after the last shard."""
    total = len(source)
    if on_progress:
        on_progress(start, total)
    writer: ShardWriter | None = None
    pending: list[dict] = []  # files left out before the next shard opens
    first = sum(m["count"] for m in manifests)
    order = options.sample_order(total)
    for index, sample in enumerate(_results(source, options, order, start, workers), start):  # index: place in order
        name, label = source.samples[int(order[index])]
        if sample.reason is not None:
            (pending if writer is None else writer.left_out).append({"path": name, "reason": sample.reason})
        else:
            assert sample.data is not None  # left out when there is no data, stored otherwise
            if writer is not None and not writer.fits(len(sample.data), options.shard_size):
                manifests.append(writer.close(source_end=index))
                on_shard(manifests[-1])
                first += len(writer)
                writer = None
            if writer is None:
                writer, pending = ShardWriter(out, len(manifests), index, first, pending), []
            writer.add(sample, label, name)
        if on_progress:
            on_progress(index + 1, total)
    if writer is not None:
        manifests.append(writer.close(source_end=total))
        on_shard(manifests[-1])
    return pending


def _finish(
    out: Path, source: ImageList, plan: dict, manifests: list[dict], trailing: list[dict], resumed_at: int
) -> Summary:
    """Write the index and then the metadata (whose presence marks the set complete) from the shards' manifests."""
    scan_problems = [{"path": path, "reason": reason} for path, reason in source.problems]  # fifos, links...
    left_out = scan_problems + [r for m in manifests for r in m["left_out"]] + trailing
    if not manifests:
        first = f", e.g. {left_out[0]['path']}: {left_out[0]['reason']}" if left_out else ""
        raise GpupipeError(f"{plan['source']}: no file could be read as an image ({len(left_out)} left out){first}")
    col = lambda k, dtype: np.array([v for m in manifests for v in m[k]], dtype)
    index: dict[str, Any] = {
        "shard": np.concatenate([np.full(m["count"], i, np.uint32) for i, m in enumerate(manifests)]),
        "offset": col("offset", np.uint64),
        "size": col("size", np.uint64),
        "label": col("label", np.int64),
        "height": col("height", np.uint32),
        "width": col("width", np.uint32),
        "source": col("source", str),
    }
    buf = io.BytesIO()
    np.savez(buf, **index)
    write_durably(out / INDEX, buf.getvalue())
    reencoded: Counter[str] = Counter()
    for m in manifests:
        reencoded.update(m["reencoded"])
    samples = len(index["label"])
    meta = {
        **plan,
        "classes": source.classes,
        "class_to_idx": {c: i for i, c in enumerate(source.classes)},
        "samples": samples,
        "shards": [m["shard"] for m in manifests],
        "copied": sum(m["copied"] for m in manifests),
        "reencoded": dict(sorted(reencoded.items())),
        "left_out": left_out,
    }
    write_durably(out / META, json.dumps(meta, indent=1).encode())
    (out / PLAN).unlink()
    return Summary(out, samples, len(manifests), meta["copied"], meta["reencoded"], left_out, resumed_at)
