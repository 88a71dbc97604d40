"""Shards on object storage: ``s3://``, ``gs://`` or any fsspec URL, for a folder written by ``gpupipe prepare`` or
for foreign WebDataset ``.tar`` shards (a list, a glob, or WebDataset's brace notation ``shard-{000..099}.tar``).

Nothing is downloaded before training but the small files: a prepared set's metadata and the index columns it
needs (read out of ``index.npz`` by range, never its per-sample ``source`` column), or a foreign shard's header
index (built once, by streaming the shard, several shards in parallel, then cached on the local disk). Each sample is
then one range read of ``size`` bytes at ``offset`` of its shard, the same bytes a local shard's mmap gives, so
every backend reads the same samples, labels and order from a URL as from a disk.

The client is fsspec (s3fs for ``s3://``, gcsfs for ``gs://``, adlfs, HTTP...), chosen over obstore and boto3:
one interface for every store the users name (boto3 speaks S3 only; obstore covers S3, GCS, Azure and HTTP but no
other fsspec URL, and the local paths and ``memory://`` stores tests and users also pass through the same code);
range reads (``cat_file(start, end)``), glob and listing; credentials and the endpoint from the standard places
(s3fs goes through botocore's chain: the ``AWS_*`` variables incl. ``AWS_ENDPOINT_URL``, ``~/.aws/config`` and
``credentials``, instance roles) or ``storage_options``; and it is fork-aware (a forked DataLoader worker gets a
fresh event loop and instance cache) and picklable for spawned ones. Its per-request overhead (an asyncio hop) is
small beside a JPEG decode. Retries are ours, one layer with exponential backoff and jitter (botocore's own are
turned off unless ``storage_options`` set them), so the time to give up is known and the error names the URL.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from .._deps import require
from ..errors import GpupipeError, StorageError
from .shards import FORMAT, INDEX, META, VERSION, ShardImageList, _save_npz, combine_indexes, index_tar

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_INDEX_VERSION = 1
_T = TypeVar("_T")


def is_url(root) -> bool:
    """A URL (``scheme://...``), a :class:`Remote`, or a list of URLs."""
    if isinstance(root, Remote):
        return True
    if isinstance(root, (list, tuple)):
        return bool(root) and all(isinstance(p, str) and _URL.match(p) for p in root)
    return isinstance(root, str) and bool(_URL.match(root))


@dataclass(frozen=True)
class Remote:
    """Shards at a URL, with how to reach them. A plain URL string stands for ``Remote(url)``.

    Args:
        url: a prepared folder (``s3://bucket/imagenet/train``), a shard, a glob or brace pattern, or a list of them.
        storage_options: passed to the fsspec file system (s3fs: ``key``, ``secret``, ``endpoint_url``,
            ``client_kwargs``...); by default credentials and endpoint come from the environment and config files.
        cache_dir: a local folder that keeps every shard once read (whole, on first use): later epochs read the disk.
        retries: attempts per read on transient errors (connection lost, 5xx, throttling) before a StorageError.
        backoff: the first wait in seconds; it doubles per attempt (with jitter), capped at 30 s.
    """

    url: str | Sequence[str]
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    retries: int = 6
    backoff: float = 0.5

    def __post_init__(self):
        if self.retries < 1:
            raise ValueError(f"retries must be >= 1, got {self.retries}")
        if self.backoff < 0:
            raise ValueError(f"backoff must be >= 0, got {self.backoff}")

    def __repr__(self) -> str:  # storage_options may hold secrets: never shown
        return f"Remote({self.url!r}, cache_dir={self.cache_dir!r})"


def as_remote(root) -> Remote:
    return root if isinstance(root, Remote) else Remote(list(root) if isinstance(root, (list, tuple)) else root)


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: ``a-{000..012}.tar`` (zero-padded as written) and ``{train,val}``, nested."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m[1], pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi, width = int(rng[1]), int(rng[2]), len(rng[1])
        if hi < lo:
            raise ValueError(f"{pattern}: range {{{body}}} runs backwards")
        choices = [f"{i:0{width}d}" for i in range(lo, hi + 1)]
    else:
        choices = body.split(",")
    return [p for c in choices for p in expand_braces(head + c + tail)]


class Store:
    """Reads from one object store with retries; opens its file system lazily, once per process (a forked worker
    does not share its parent's connections)."""

    def __init__(self, remote: Remote, protocol_url: str):
        self.remote = remote
        self._url = protocol_url
        self._fs: Any = None
        self._pid = -1

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            for scheme, module in (("s3", "s3fs"), ("gs", "gcsfs")):
                if self._url.startswith(f"{scheme}://"):
                    require(module, scheme)
            import fsspec  # defer: only remote sources need it

            self._fs = fsspec.url_to_fs(self._url, **_options(self._url, self.remote.storage_options))[0]
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self):  # a spawned worker opens its own
        return {**self.__dict__, "_fs": None, "_pid": -1}

    def path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def call(self, url: str, what: Callable[[], _T]) -> _T:
        """``what()`` with retries on transient errors; permanent ones (no such object, access denied) at once."""
        started = time.monotonic()
        for attempt in range(self.remote.retries):
            try:
                return what()
            except Exception as e:
                permanent = _permanent(url, e)
                if permanent is not None:
                    raise permanent from None
                last = e
            self._wait(attempt)
        raise self._gave_up(url, started, last)

    def _wait(self, attempt: int) -> None:
        if attempt + 1 < self.remote.retries:
            delay = min(30.0, self.remote.backoff * 2**attempt)
            time.sleep(delay * random.uniform(0.5, 1.0))

    def _gave_up(self, url: str, started: float, last: Exception) -> StorageError:
        return StorageError(
            f"{url}: unreachable after {self.remote.retries} attempts over {time.monotonic() - started:.1f} s "
            f"({_cause(last)})"
        )

    def read_many(self, urls: list[str], starts: list[int], sizes: list[int]) -> list[bytes | Exception]:
        """Several range reads at once (a batch: concurrent requests, one round trip's latency for all), each its
        bytes or its :class:`StorageError`; the ones that fail transiently are retried together."""
        out: list[bytes | Exception | None] = [None] * len(urls)
        pending, started = list(range(len(urls))), time.monotonic()
        for attempt in range(self.remote.retries):
            got = self.fs.cat_ranges(
                [self.path(urls[k]) for k in pending],
                [starts[k] for k in pending],
                [starts[k] + sizes[k] for k in pending],
                on_error="return",
            )
            retry = []
            for k, r in zip(pending, got, strict=True):
                if isinstance(r, Exception):
                    out[k] = _permanent(urls[k], r)
                    if out[k] is None:
                        retry.append(k)
                        last = r
                else:
                    out[k] = r if len(r) == sizes[k] else _truncated(urls[k], starts[k], sizes[k])
            pending = retry
            if not pending:
                break
            self._wait(attempt)
        for k in pending:
            out[k] = self._gave_up(urls[k], started, last)
        return cast(list[bytes | Exception], out)

    def read(self, url: str, start: int, size: int) -> bytes:
        """``size`` bytes at ``start``: a range read; a short answer means the object is shorter than its index."""
        data = self.call(url, lambda: self.fs.cat_file(self.path(url), start=start, end=start + size))
        if len(data) != size:
            raise _truncated(url, start, size)
        return data

    def cat(self, url: str) -> bytes:
        return self.call(url, lambda: self.fs.cat_file(self.path(url)))

    def info(self, url: str) -> dict:
        return self.call(url, lambda: self.fs.info(self.path(url)))

    def get(self, url: str, target: Path) -> None:
        """The whole object into ``target``, atomically."""
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        self.call(url, lambda: self.fs.get_file(self.path(url), str(tmp)))
        os.replace(tmp, target)

    def put(self, local: Path, url: str) -> None:
        """One upload: an object appears whole or not at all (S3 PUTs are atomic)."""
        self.call(url, lambda: self.fs.put_file(str(local), self.path(url)))

    def sizes(self, url: str) -> dict[str, int]:
        """The byte size of each object directly under the folder ``url``, by name; empty when there is none."""
        try:
            found = self.call(url, lambda: self.fs.ls(self.path(url), detail=True, refresh=True))
        except StorageError as e:
            if "no such object" in str(e):
                return {}
            raise
        return {os.path.basename(f["name"].rstrip("/")): int(f.get("size") or 0) for f in found if f["type"] == "file"}

    def rm(self, url: str) -> None:
        self.call(url, lambda: self.fs.rm_file(self.path(url)))

    def glob(self, pattern: str) -> list[str]:
        return sorted(self.fs.unstrip_protocol(p) for p in self.call(pattern, lambda: self.fs.glob(self.path(pattern))))


def _options(url: str, given: dict[str, Any]) -> dict[str, Any]:
    """The user's options; for S3, botocore's own retries off (ours are the one layer) unless they were set."""
    options = dict(given)
    if url.startswith(("s3://", "s3a://")):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
    return options


def _permanent(url: str, e: Exception) -> StorageError | None:
    """The error to raise at once for ``e``; None when ``e`` is worth another try."""
    if isinstance(e, FileNotFoundError):
        return StorageError(f"{url}: no such object")
    if isinstance(e, PermissionError):
        return StorageError(f"{url}: access denied ({_cause(e)}); check the credentials")
    if "range is not satisfiable" in str(e):  # a range past the end: the object is shorter than its index says
        return StorageError(f"{url} ends before its member: truncated? ({_cause(e)})")
    return None if _transient(e) else StorageError(f"{url}: {_cause(e)}")


def _truncated(url: str, start: int, size: int) -> StorageError:
    return StorageError(f"{url} ends before its member at byte {start} of {size} bytes: truncated?")


def _transient(e: Exception) -> bool:
    """Connection lost or refused, timeouts, 5xx, throttling: worth another try. Anything else is permanent."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    name = type(e).__name__
    if any(k in name for k in ("Connection", "Timeout", "Throttl", "IncompleteRead", "ClientPayload")):
        return True
    text = str(e)
    return isinstance(e, OSError) and bool(
        re.search(r"\b5\d\d\b|SlowDown|Throttl|InternalError|ServiceUnavailable|Reset|temporar", text, re.I)
    )


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class RemoteShardImageList(ShardImageList):
    """Shards at URLs: :meth:`read` is one range read (or a local read from the cache folder)."""

    def __init__(self, store: Store, root: str, urls: list[str], *args, **kwargs):
        super().__init__(root, urls, *args, **kwargs)
        self.store = store

    def read_many(self, indices: Sequence[int]) -> list[bytes | Exception]:
        """A batch's bytes by concurrent range reads (from the cache folder when there is one)."""
        if self.store.remote.cache_dir is not None:
            return super().read_many(indices)
        shards = self._shard[indices]
        return self.store.read_many(
            [self.shard_paths[int(s)] for s in shards],
            self._offset[indices].tolist(),
            self._size[indices].tolist(),
        )

    def read(self, index: int) -> bytes:
        s = int(self._shard[index])
        url, start, size = self.shard_paths[s], int(self._offset[index]), int(self._size[index])
        cache = self.store.remote.cache_dir
        if cache is None:
            return self.store.read(url, start, size)
        local = _cached_shard(self.store, url, Path(cache))
        with open(local, "rb") as f:
            data = os.pread(f.fileno(), size, start)
        if len(data) != size:
            raise StorageError(f"{url} (cached as {local}) ends before its member at byte {start}: truncated?")
        return data


def _cached_shard(store: Store, url: str, cache: Path) -> Path:
    local = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{os.path.basename(url)}"
    if not local.exists():
        cache.mkdir(parents=True, exist_ok=True)
        store.get(url, local)
    return local


def scan_remote(root) -> RemoteShardImageList:
    """The data set at ``root`` (a URL, a list of them, or a :class:`Remote`)."""
    remote = as_remote(root)
    urls = [remote.url] if isinstance(remote.url, str) else list(remote.url)
    if not urls:
        raise ValueError("the list of shards is empty")
    store = Store(remote, urls[0])
    if len(urls) == 1 and not urls[0].endswith(".tar") and not _has_pattern(urls[0]):
        return load_prepared_remote(store, urls[0].rstrip("/"))
    return load_tars_remote(store, _expand(store, urls))


def _has_pattern(url: str) -> bool:
    return bool(re.search(r"[*?\[]|\{[^{}]*\}", url))


def _expand(store: Store, urls: list[str]) -> list[str]:
    out = []
    for u in urls:
        for p in expand_braces(u):
            if re.search(r"[*?\[]", p):
                found = store.glob(p)
                if not found:
                    raise StorageError(f"{p}: no object matches this pattern")
                out.extend(found)
            else:
                out.append(p)
    return out


def load_prepared_remote(store: Store, url: str) -> RemoteShardImageList:
    """A prepared folder at ``url``: its metadata, and the index columns start-up needs, read by range."""
    try:
        meta = json.loads(store.cat(f"{url}/{META}"))
    except StorageError as e:
        if "no such object" in str(e):
            raise StorageError(
                f"{url}: neither a folder written by gpupipe prepare (no {META}) nor .tar shards"
            ) from None
        raise
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise GpupipeError(
            f"{url}/{META}: format {meta.get('format')!r} version {meta.get('version')!r}; this gpupipe reads "
            f"{FORMAT!r} version {VERSION}: prepare the data again"
        )
    index_url = f"{url}/{INDEX}"

    def columns() -> dict[str, np.ndarray]:
        with store.fs.open(store.path(index_url), "rb", block_size=1 << 20) as f, np.load(f) as z:
            return {k: z[k] for k in ("shard", "offset", "size", "label", "height", "width")}

    cols = store.call(index_url, columns)
    return RemoteShardImageList(
        store,
        url,
        [f"{url}/{n}" for n in meta["shards"]],
        cols["shard"],
        cols["offset"],
        cols["size"],
        cols["label"],
        meta["classes"],
        heights=cols["height"],
        widths=cols["width"],
    )


def load_tars_remote(store: Store, urls: list[str], threads: int = 8) -> RemoteShardImageList:
    """Foreign shards at ``urls``, in that order, each indexed from its tar headers on first use (several at once)
    and the index cached on this machine."""
    with ThreadPoolExecutor(min(threads, len(urls))) as pool:
        parts = list(pool.map(lambda u: remote_shard_index(store, u), urls))
    labels, classes, shard = combine_indexes(parts, urls)
    return RemoteShardImageList(
        store,
        os.path.dirname(urls[0]),
        urls,
        shard,
        np.concatenate([p["offset"] for p in parts]),
        np.concatenate([p["size"] for p in parts]),
        labels,
        classes,
        members=np.concatenate([p["member"] for p in parts]),
    )


def remote_shard_index(store: Store, url: str) -> dict[str, np.ndarray]:
    """The header index of a foreign shard at ``url``, cached under ``$XDG_CACHE_HOME/gpupipe/shard-index`` and
    rebuilt when the object's size or ETag changes. Building it streams the shard once (into the cache folder when
    there is one: the reads that follow then stay local)."""
    info = store.info(url)
    tag = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    stamp = np.array([_INDEX_VERSION, int(info.get("size") or 0), digest], np.int64)
    cached = _index_cache() / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{os.path.basename(url)}.npz"
    try:
        with np.load(cached) as z:
            if np.array_equal(z["stamp"], stamp):
                return {k: z[k] for k in ("member", "offset", "size", "label")}
    except (OSError, KeyError, ValueError):
        pass  # absent, unreadable or stale: build it
    if store.remote.cache_dir is not None:
        index = _index_local(_cached_shard(store, url, Path(store.remote.cache_dir)), url)
    else:
        tmp = _index_cache() / f".{os.getpid()}-{os.path.basename(url)}.download"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            store.get(url, tmp)
            index = _index_local(tmp, url)
        finally:
            tmp.unlink(missing_ok=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    _save_npz(cached, stamp=stamp, **index)
    return index


def _index_local(path: Path, url: str) -> dict[str, np.ndarray]:
    try:
        return index_tar(str(path))
    except GpupipeError as e:  # name the URL, not the downloaded copy
        raise GpupipeError(str(e).replace(str(path), url)) from None


def _index_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupipe" / "shard-index" / "remote"


def read_bytes(url: str) -> bytes:
    """One whole object (``gpupipe check`` on a URL, ``read_image``)."""
    return Store(Remote(url), url).cat(url)


__all__ = ["Remote", "RemoteShardImageList", "StorageError", "expand_braces", "is_url", "read_bytes", "scan_remote"]
