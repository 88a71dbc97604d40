"""The writer of tar shards in the WebDataset layout, beside their reader (:mod:`.shards`): one shard at a time to a
hidden temporary file, renamed when complete, with its manifest (the members' offsets and sizes, the sha256 of its
bytes), so that a run stopped anywhere resumes after the last complete shard (:func:`complete_shards`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections import Counter
from itertools import count
from pathlib import Path
from typing import Protocol

from .._files import create_exclusive, naming, write_atomic

SHARD_NAME = "shard-{:06d}"
BLOCK = 512
END = b"\0" * (2 * BLOCK)  # a tar's end-of-archive marker


class Stored(Protocol):
    """A sample to store: its JPEG bytes, its upright size, what was changed to store it."""

    @property
    def data(self) -> bytes | None: ...
    @property
    def height(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def changes(self) -> tuple[str, ...]: ...


def _member(name: str, data: bytes) -> bytes:
    """One tar member, header and padded data, with fixed metadata (mtime 0, root, 0644): the same bytes every run."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    return info.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % BLOCK)


def write_durably(path: Path, data: bytes) -> None:
    write_atomic(path, data)  # an exclusive temp file: no link planted at a predictable name is followed


class ShardWriter:
    """One shard: written to a hidden temporary file, renamed when complete, then its manifest written."""

    def __init__(self, out: Path, number: int, source_start: int, first: int, left_out: list[dict]):
        self.out, self.name = out, SHARD_NAME.format(number)
        self.tmp = out / f".{self.name}.tar.tmp"
        self.tmp.unlink(missing_ok=True)  # an earlier run's, or a link someone put there
        self.file = create_exclusive(self.tmp)  # closed in close(), once the shard is complete
        self.sha, self.bytes = hashlib.sha256(), 0
        self.source_start, self.first, self.left_out = source_start, first, left_out
        self.rows: dict[str, list] = {k: [] for k in ("offset", "size", "label", "height", "width", "source")}
        self.changes: Counter = Counter()
        self.copied = 0

    def __len__(self) -> int:
        return len(self.rows["label"])

    def fits(self, size: int, limit: int) -> bool:
        return not len(self) or self.bytes + _sample_bytes(size) + len(END) <= limit

    def add(self, sample: Stored, label: int, source: str) -> None:
        assert sample.data is not None  # a sample left out is never added
        key = f"{self.first + len(self):08d}"
        for k, v in zip(
            self.rows, (self.bytes + BLOCK, len(sample.data), label, sample.height, sample.width, source), strict=True
        ):
            self.rows[k].append(v)
        self.changes.update(sample.changes)
        self.copied += not sample.changes
        self._write(_member(f"{key}.jpg", sample.data) + _member(f"{key}.cls", str(label).encode()))

    def _write(self, data: bytes) -> None:
        with naming(self.tmp):
            self.file.write(data)
        self.sha.update(data)
        self.bytes += len(data)

    def close(self, source_end: int) -> dict:
        self._write(END)
        with naming(self.tmp):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        os.replace(self.tmp, self.out / f"{self.name}.tar")
        manifest = {
            "shard": f"{self.name}.tar",
            "bytes": self.bytes,
            "sha256": self.sha.hexdigest(),
            "source_start": self.source_start,
            "source_end": source_end,
            "first": self.first,
            "count": len(self),
            "copied": self.copied,
            "reencoded": dict(sorted(self.changes.items())),
            "left_out": self.left_out,
            **self.rows,
        }
        write_durably(self.out / f"{self.name}.json", json.dumps(manifest).encode())
        return manifest


def _sample_bytes(size: int) -> int:
    return BLOCK + size + (-size % BLOCK) + 2 * BLOCK  # .jpg header + padded data, .cls header + one block


def complete_shards(out: Path) -> list[dict]:
    """The manifests of the shards an earlier run finished (each checked against its bytes), in order; every later
    or partial shard file of that run is removed, so it is written again."""
    done = []
    for k in count():
        tar, man = out / f"{SHARD_NAME.format(k)}.tar", out / f"{SHARD_NAME.format(k)}.json"
        if not (tar.is_file() and man.is_file()):
            break
        m = json.loads(man.read_text())
        if tar.stat().st_size != m["bytes"] or _sha256(tar) != m["sha256"]:
            break
        done.append(m)
    for p in out.glob("shard-*"):
        if re.fullmatch(r"shard-(\d{6})\.(tar|json)", p.name) and int(p.name[6:12]) >= len(done):
            p.unlink()
    for p in out.glob(".shard-*.tmp"):
        p.unlink()
    return done


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
