"""Shards on object storage: ``s3://``, ``gs://`` or any fsspec URL, for a folder written by ``gpupipe prepare`` or
for foreign WebDataset ``.tar`` shards (a list, a glob, or WebDataset's brace notation ``shard-{000..099}.tar``).

Nothing is downloaded before training but the small files: a prepared set's metadata and the index columns it
needs (read out of ``index.npz`` by range, never its per-sample ``source`` column), or a foreign shard's header
index (built once, by streaming the shard, several shards in parallel, then cached on the local disk). Each sample is
then ``size`` bytes at ``offset`` of its shard, the same bytes a local shard's mmap gives, so every backend reads the
same samples, labels and order from a URL as from a disk; a batch's samples are read together in few requests
(:mod:`.ranges`).

The client (fsspec) and its retries: :mod:`.objstore`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .._system import local_ranks
from .._warn import warn_user
from ..errors import GpupipeError, SourceError, StorageError
from .cache import ShardCache, etag_of, parse_limit
from .cache_folder import cache_folder
from .cached import CachedShards, ReadAhead, plan
from .objstore import Remote, Store
from .ranges import BatchReader
from .shards import (
    FORMAT,
    INDEX,
    META,
    VERSION,
    ShardImageList,
    _save_npz,
    combine_indexes,
    expand_braces,
    index_tar,
)

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_INDEX_VERSION = 1


def is_url(root) -> bool:
    """A URL (``scheme://...``), a :class:`Remote`, or a list of URLs."""
    if isinstance(root, Remote):
        return True
    if isinstance(root, (list, tuple)):
        return bool(root) and all(isinstance(p, str) and _URL.match(p) for p in root)
    return isinstance(root, str) and bool(_URL.match(root))


def as_remote(root) -> Remote:
    return root if isinstance(root, Remote) else Remote(list(root) if isinstance(root, (list, tuple)) else root)


class RemoteShardImageList(ShardImageList):
    """Shards at URLs, read through the node's shard cache (:mod:`.cache`: each fetched whole once per node, read
    ahead), or by range a batch at a time (:class:`~.ranges.BatchReader`: few requests per batch) where the cache is
    off or a shuffled epoch cannot use it."""

    def __init__(
        self, store: Store, root: str, urls: list[str], *args, listed: dict[str, dict] | None = None, **kwargs
    ):
        super().__init__(root, urls, *args, **kwargs)
        self.store = store
        ends = np.zeros(len(urls), np.int64)
        np.maximum.at(ends, self._shard.astype(np.intp), (self._offset + self._size).astype(np.int64))
        self.reader = BatchReader(store, urls, ends, store.remote.memory_cache)
        self.cache = _shard_cache(store, urls, listed)  # None: no cache folder
        self.cached = self.cache is not None and plan(self.cache.sizes, self.cache.cache.limit, True, None).cached
        self.read_ahead: ReadAhead | None = None

    def __getstate__(self):  # a spawned worker reads; the read ahead is its parent's
        return {**super().__getstate__(), "read_ahead": None}

    def plan_reads(self, sampler) -> None:
        """Read as a loader's order (``sampler``) suits: through the cache when the set fits it, or the
        ``shuffle_window``'s shards do (a limit smaller than ``K`` shards is refused), or the pass is sequential,
        with the coming shards read ahead; else by range, with blocks kept in memory when they fit
        (:meth:`~.ranges.BatchReader.set_window`). A shuffled epoch that will cost about a request per sample is
        worth a warning, once, with the fix."""
        self.reader.set_window(sampler.window)
        why = None
        if self.cache is not None:
            how = plan(self.cache.sizes, self.cache.cache.limit, sampler.shuffle, sampler.window, local_ranks())
            self.cached, self.cache.keep, why = how.cached, how.keep, how.why
            if how.cached:
                self.read_ahead = ReadAhead(self.cache, sampler, self._shard, how.ahead) if how.ahead else None
                return
        if self.reader.keeps_blocks or (why is None and (why := self.reader.advice(sampler.shuffle)) is None):
            return
        warn_user(f"{self.root}: {why}")

    def read_many(self, indices: Sequence[int]) -> list[bytes | Exception]:
        """A batch's bytes: from the cache folder, or in few concurrent range reads."""
        if self.cached:
            assert self.cache is not None  # cached: there is one
            out = super().read_many(indices)
            self.cache.release(set(self._shard[indices].tolist()))  # what the epoch left behind may be evicted
            return out
        return self.reader.read(
            self._shard[indices].tolist(), self._offset[indices].tolist(), self._size[indices].tolist()
        )

    def read(self, index: int) -> bytes:
        if not self.cached:
            data = self.read_many([index])[0]
            if isinstance(data, Exception):
                raise data
            return data
        assert self.cache is not None  # cached: there is one
        s = int(self._shard[index])
        start, size = int(self._offset[index]), int(self._size[index])
        data = self.cache.read(s, start, size)
        if len(data) != size:
            raise StorageError(f"{self.shard_paths[s]} ends before its member at byte {start}: truncated?")
        return data


def _shard_cache(store: Store, urls: list[str], listed: dict[str, dict] | None) -> CachedShards | None:
    """The node's cache of these shards, each keyed by its object's size and ETag (from one listing of their
    folder, or asked per object where it cannot be listed); None when ``cache_limit`` is 0."""
    limit = parse_limit(store.remote.cache_limit)
    if limit == 0:
        return None
    folder = Path(store.remote.cache_dir) if store.remote.cache_dir else cache_folder()
    listed = listed if listed is not None else _listed(store, urls)
    missing = [u for u in urls if u not in listed]
    if missing:
        with ThreadPoolExecutor(min(8, len(missing))) as pool:
            listed = {**listed, **dict(zip(missing, pool.map(store.info, missing), strict=True))}
    infos = [listed[u] for u in urls]
    cache = ShardCache(folder, ShardCache.default_limit(folder) if limit is None else limit)
    return CachedShards(store, cache, urls, [int(i.get("size") or 0) for i in infos], [etag_of(i) for i in infos])


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


class NotPrepared(StorageError):
    """A folder at a URL without a prepared set's metadata (:func:`~.open.open_source` then looks for Parquet)."""


def load_prepared_remote(store: Store, url: str) -> RemoteShardImageList:
    """A prepared folder at ``url``: its metadata, and the index columns start-up needs, read by range."""
    try:
        meta = json.loads(store.cat(f"{url}/{META}"))
    except StorageError as e:
        if "no such object" not in str(e):
            raise
        raise NotPrepared(
            f"{url}: neither a folder written by gpupipe prepare (no {META}) nor .tar shards nor .parquet files"
        ) from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise GpupipeError(
            f"{url}/{META}: format {meta.get('format')!r} version {meta.get('version')!r}; this gpupipe reads "
            f"{FORMAT!r} version {VERSION}: prepare the data again"
        )
    shards = _confined(url, meta.get("shards"))
    index_url = f"{url}/{INDEX}"

    def columns() -> dict[str, np.ndarray]:
        store.fs.invalidate_cache(store.path(index_url))  # a set prepared again in place: not the old ETag's info
        with store.fs.open(store.path(index_url), "rb", block_size=1 << 20) as f, np.load(f) as z:
            return {k: z[k] for k in ("shard", "offset", "size", "label", "height", "width")}

    cols = store.call(index_url, columns)
    return RemoteShardImageList(
        store,
        url,
        shards,
        cols["shard"],
        cols["offset"],
        cols["size"],
        cols["label"],
        meta["classes"],
        heights=cols["height"],
        widths=cols["width"],
    )


def _confined(url: str, names) -> list[str]:
    """A prepared folder's shard URLs, each inside the folder: a name that climbs out (``..``), is absolute or a URL
    of its own, or holds what a URL reads otherwise (``?``, ``#``, ``%``, ``\\``) is refused, as on a local disk (an
    HTTP client would fetch ``folder/../x.tar`` as ``x.tar``, outside it)."""
    if not isinstance(names, list):
        raise GpupipeError(f"{url}/{META}: 'shards' must be a list of file names, got {type(names).__name__}")
    for name in names:
        if (
            not isinstance(name, str)
            or any(part in ("", ".", "..") for part in name.split("/"))
            or re.search(r"[?#%\\]|^[a-zA-Z][a-zA-Z0-9+.-]*:", name)
        ):
            raise GpupipeError(
                f"{url}/{META}: shard {name!r} lies outside {url}; a prepared folder names its own shards"
            )
    return [f"{url}/{n}" for n in names]


def load_tars_remote(store: Store, urls: list[str], threads: int = 8) -> RemoteShardImageList:
    """Foreign shards at ``urls``, in that order, each indexed from its tar headers on first use (several at once)
    and the index cached on this machine."""
    listed = _listed(store, urls)
    with ThreadPoolExecutor(min(threads, len(urls))) as pool:
        parts = list(pool.map(lambda u: remote_shard_index(store, u, listed.get(u)), urls))
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
        listed=listed,
    )


def _listed(store: Store, urls: list[str]) -> dict[str, dict]:
    """Each shard's size and ETag from one listing of its folder (a request per 1,000 objects, where asking each
    object would be a request each); {} for a folder that cannot be listed (then each object is asked)."""
    out: dict[str, dict] = {}
    for folder in dict.fromkeys(os.path.dirname(u) for u in urls):

        def listing(folder: str = folder) -> list[dict]:
            return store.fs.ls(store.path(folder), detail=True, refresh=True)

        try:
            found = store.call(folder, listing)
        except StorageError:
            continue  # not listable (a permission, an HTTP server): info() per object instead
        out.update({f"{folder}/{os.path.basename(f['name'])}": f for f in found if f.get("type") == "file"})
    return out


def remote_shard_index(store: Store, url: str, info: dict | None = None) -> dict[str, np.ndarray]:
    """The header index of a foreign shard at ``url`` (:func:`remote_index` of its tar headers)."""
    return remote_index(store, url, info, _index_local, ("member", "offset", "size", "label"))


def remote_index(
    store: Store,
    url: str,
    info: dict | None,
    build: Callable[[Path, str], dict[str, np.ndarray]],
    keys: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The index ``build(local copy, url)`` makes of the object at ``url`` (its ``keys``), cached under
    ``$XDG_CACHE_HOME/gpupipe/shard-index/remote`` and rebuilt when the object's size or ETag (``info``, else asked)
    changes. Building it streams the object once (into the node's shard cache when there is one: the reads that
    follow then stay local)."""
    info = info or store.info(url)
    tag = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    stamp = np.array([_INDEX_VERSION, int(info.get("size") or 0), digest], np.int64)
    cached = _index_cache() / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{os.path.basename(url)}.npz"
    try:
        with np.load(cached) as z:
            if np.array_equal(z["stamp"], stamp):
                return {k: z[k] for k in keys}
    except (OSError, KeyError, ValueError):
        pass  # absent, unreadable or stale: build it
    cache = _shard_cache(store, [url], {url: info})
    if cache is not None:
        pinned = cache.cache.pin(store, url, cache.sizes[0], cache.etags[0])
        try:
            index = build(pinned.path, url)
        finally:
            pinned.close()
    else:
        tmp = _index_cache() / f".{os.getpid()}-{os.path.basename(url)}.download"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            store.get(url, tmp)
            index = build(tmp, url)
        finally:
            tmp.unlink(missing_ok=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    _save_npz(cached, stamp=stamp, **index)
    return index


def _index_local(path: Path, url: str) -> dict[str, np.ndarray]:
    try:
        return index_tar(str(path))
    except GpupipeError as e:  # name the URL, not the downloaded copy
        raise SourceError(str(e).replace(str(path), url)) from None


def _index_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupipe" / "shard-index" / "remote"


__all__ = ["Remote", "RemoteShardImageList", "StorageError", "expand_braces", "is_url", "scan_remote"]
