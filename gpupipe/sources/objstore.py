"""Object storage through fsspec: a :class:`Remote` (a URL and how to reach it) and the :class:`Store` that reads
it with retries.

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

import errno
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from .._deps import require
from ..errors import StorageError
from .cache import parse_limit

_log = logging.getLogger(__name__)  # each retry, at DEBUG: what failed and how often

_T = TypeVar("_T")


@dataclass(frozen=True)
class Remote:
    """Shards at a URL, with how to reach them. A plain URL string stands for ``Remote(url)``.

    Args:
        url: a prepared folder (``s3://bucket/imagenet/train``), a shard, a glob or brace pattern, or a list of them.
        storage_options: passed to the fsspec file system (s3fs: ``key``, ``secret``, ``endpoint_url``,
            ``client_kwargs``...); by default credentials and endpoint come from the environment and config files.
        cache_dir: the node's shard cache folder (:mod:`gpupipe.sources.cache`), shared by every worker, rank and run
            of the user on the node: each shard is fetched whole once per node, read ahead, checked against the
            object's size, ETag and digest. Default: ``$GPUPIPE_CACHE``, else ``$XDG_CACHE_HOME/gpupipe/shards``
            (``~/.cache/...``, the user's own, mode 0700). Users share a folder of a group they belong to (mode
            2770); one every user may write is refused (:mod:`gpupipe.sources.cache_folder`).
        cache_limit: bytes the cache folder may hold (``"50GB"``, or a number), least recently used shards evicted
            first; default half the free space of its disk (plus what it holds). 0: no cache folder (range reads).
        memory_cache: bytes of shards each process (each DataLoader worker) may keep in memory. When the data set's
            shards fit, or a train loader's ``shuffle_window`` of K shards does, they are read in 8 MiB blocks, each
            once (per epoch, with the window), and kept; otherwise a batch's samples are read by range, those of one
            shard less than 256 KiB apart in one request (:mod:`gpupipe.sources.ranges`). 0: never keep.
        retries: attempts per read on transient errors (connection lost, 5xx, throttling) before a StorageError.
        backoff: the first wait in seconds; it doubles per attempt (with jitter), capped at 30 s.
        deadline: seconds one read may take, its attempts and waits included, before a StorageError that says so (an
            endpoint that accepts a connection and never answers would otherwise hold it through the client's own
            timeouts and retries, each attempt). A shard copied whole into ``cache_dir`` is one read.
    """

    url: str | Sequence[str]
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    cache_limit: int | str | None = None
    memory_cache: int = 256 << 20
    retries: int = 6
    backoff: float = 0.5
    deadline: float = 300.0

    def __post_init__(self):
        if self.retries < 1:
            raise ValueError(f"retries must be >= 1, got {self.retries}")
        parse_limit(self.cache_limit)  # a bad one is refused here, once
        if self.memory_cache < 0:
            raise ValueError(f"memory_cache must be >= 0 bytes, got {self.memory_cache}")
        if self.backoff < 0:
            raise ValueError(f"backoff must be >= 0, got {self.backoff}")
        if not 0 < self.deadline < float("inf"):
            raise ValueError(f"deadline must be > 0 seconds, got {self.deadline}")

    def __repr__(self) -> str:  # storage_options may hold secrets: never shown
        return f"Remote({self.url!r}, cache_dir={self.cache_dir!r}, cache_limit={self.cache_limit!r})"


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
            if self._url.startswith(("s3://", "s3a://")):
                # s3fs's own layer: 5 attempts per call on a timeout, and a ranged re-read of a body cut mid-way,
                # neither seen by ours: a GET past its read timeout was asked again at once (the store served both)
                self._fs.retries = 1
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self):  # a spawned worker opens its own
        return {**self.__dict__, "_fs": None, "_pid": -1}

    def path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def call(self, url: str, what: Callable[[], _T], deadline: float | None = None) -> _T:
        """``what()`` with retries on transient errors; permanent ones (no such object, access denied) at once; all of
        it within ``deadline`` seconds (the remote's by default)."""
        clock = _Deadline(deadline or self.remote.deadline)
        last: Exception | None = None
        for attempt in range(self.remote.retries):
            try:
                return _within(what, clock.left())
            except _Late:
                raise clock.missed(url, attempt + 1, last) from None
            except Exception as e:
                permanent = _permanent(url, e)
                if permanent is not None:
                    raise permanent from None
                last = e
                _log.debug("retry %s: attempt %d failed (%s)", url, attempt + 1, _cause(e))
            if not self._wait(attempt, clock):
                raise clock.missed(url, attempt + 1, last)
        raise self._gave_up(url, clock.started, last)

    def _wait(self, attempt: int, clock: _Deadline) -> bool:
        """The backoff before the next attempt, within the deadline; False when the deadline leaves no time for it."""
        if attempt + 1 < self.remote.retries:
            delay = min(30.0, self.remote.backoff * 2**attempt) * random.uniform(0.5, 1.0)
            if delay >= clock.left():
                return False
            time.sleep(delay)
        return True

    def _gave_up(self, url: str, started: float, last: Exception | None) -> StorageError:
        return StorageError(
            f"{url}: unreachable after {self.remote.retries} attempts over {time.monotonic() - started:.1f} s "
            f"({_cause(last) if last is not None else '?'})"
        )

    def read_many(self, urls: list[str], starts: list[int], sizes: list[int]) -> list[bytes | Exception]:
        """Several range reads at once (a batch: concurrent requests, one round trip's latency for all), each its
        bytes or its :class:`StorageError`; the ones that fail transiently are retried together, all within the
        remote's deadline."""
        out: list[bytes | Exception | None] = [None] * len(urls)
        pending, clock = list(range(len(urls))), _Deadline(self.remote.deadline)
        last: Exception | None = None
        late = False
        for attempt in range(self.remote.retries):
            try:
                got = _within(self._ranges(urls, starts, sizes, pending), clock.left())
            except _Late:
                late = True
                break
            retry = []
            for k, r in zip(pending, got, strict=True):
                out[k] = _checked(urls[k], starts[k], sizes[k], r)
                if out[k] is None:
                    retry.append(k)
                    last = cast(Exception, r)
                    _log.debug("retry %s: attempt %d failed (%s)", urls[k], attempt + 1, _cause(last))
            pending = retry
            if not pending:
                break
            if not self._wait(attempt, clock):
                late = True
                break
        for k in pending:
            out[k] = clock.missed(urls[k], attempt + 1, last) if late else self._gave_up(urls[k], clock.started, last)
        return cast(list[bytes | Exception], out)

    def _ranges(self, urls: list[str], starts: list[int], sizes: list[int], which: list[int]) -> Callable[[], list]:
        """The one request of an attempt of :meth:`read_many` (each range its bytes or its exception)."""
        paths, first, end = (
            [self.path(urls[k]) for k in which],
            [starts[k] for k in which],
            [starts[k] + sizes[k] for k in which],
        )
        return lambda: self.fs.cat_ranges(paths, first, end, on_error="return")

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
        """One upload: an object appears whole or not at all (S3 PUTs are atomic). A large one gets a second per MiB
        where that is longer than the deadline."""
        deadline = max(self.remote.deadline, local.stat().st_size / (1 << 20))
        self.call(url, lambda: self.fs.put_file(str(local), self.path(url)), deadline)

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


class _Deadline:
    """The time one read has left, its attempts and waits included."""

    def __init__(self, seconds: float):
        self.seconds, self.started = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def missed(self, url: str, attempts: int, last: Exception | None) -> StorageError:
        cause = f"; the last error: {_cause(last)}" if last is not None else ""
        return StorageError(
            f"{url}: no answer within the deadline of {self.seconds:g} s ({attempts} attempt(s){cause}); "
            "Remote(deadline=) sets it"
        )


class _Late(Exception):
    """A call still running when its deadline came."""


def _within(what: Callable[[], _T], seconds: float) -> _T:
    """``what()`` in a thread of its own, waited for at most ``seconds`` (then :class:`_Late`): a client call that
    never returns cannot hold the caller past the deadline. The thread is left to end by itself, when the client's
    own timeouts end the call."""
    if seconds <= 0:
        raise _Late
    done = threading.Event()
    value: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            value.append(what())
        except BaseException as e:  # handed to the caller
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="gpupipe-store-call", daemon=True).start()
    if not done.wait(seconds):
        raise _Late
    if error:
        raise error[0]
    return value[0]


def _options(url: str, given: dict[str, Any]) -> dict[str, Any]:
    """The user's options; for S3, botocore's own retries off (ours are the one layer) unless they were set (s3fs's
    are turned off on the file system: :attr:`Store.fs`)."""
    options = dict(given)
    if url.startswith(("s3://", "s3a://")):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # max_attempts counts retries
        options["config_kwargs"] = config
    return options


def _permanent(url: str, e: Exception) -> StorageError | None:
    """The error to raise at once for ``e``; None when ``e`` is worth another try."""
    host = next((getattr(x, "host", "?") for x in _chain(e) if type(x).__name__ == "ClientConnectorDNSError"), None)
    if host is not None and any(isinstance(x, socket.gaierror) and x.errno == socket.EAI_NONAME for x in _chain(e)):
        return StorageError(f"{url}: no such host {host!r} (the name does not resolve; check the URL)")
    # fsspec's HTTP file system raises FileNotFoundError for any failed HEAD and GET, a refused connection or a 5xx too
    if isinstance(e, FileNotFoundError) and not _transient(e):
        if any(_status_and_code(x)[1] == "NoSuchBucket" for x in _chain(e)):
            bucket = url.split("://", 1)[-1].split("/", 1)[0]
            return StorageError(
                f"{url}: no such bucket {bucket!r} at this endpoint (create it first, or check the URL)"
            )
        return StorageError(f"{url}: no such object")
    if isinstance(e, PermissionError):
        return StorageError(f"{url}: access denied ({_cause(e)}); check the credentials")
    if "range is not satisfiable" in str(e):  # a range past the end: the object is shorter than its index says
        return StorageError(f"{url} ends before its member: truncated? ({_cause(e)})")
    return None if _transient(e) else StorageError(f"{url}: {_cause(e)}")


def _checked(url: str, start: int, size: int, got: bytes | Exception) -> bytes | Exception | None:
    """One range of a batch: its bytes, or the error to report for it; None when it is worth another try."""
    if isinstance(got, Exception):
        return _permanent(url, got)
    return got if len(got) == size else _truncated(url, start, size)


def _truncated(url: str, start: int, size: int) -> StorageError:
    return StorageError(f"{url} ends before its member at byte {start} of {size} bytes: truncated?")


# Error codes of S3 and the stores that copy its API that mean "try again": throttling, a busy or failing server.
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "RequestTimeout", "RequestTimeoutException", "InternalError",
    "ServiceUnavailable", "OperationAborted",
}  # fmt: skip
# s3fs turns those errors into a bare OSError whose text is the server's message ("Please reduce your request rate.",
# no code in it) and whose errno is EBUSY (throttling, 503) or EREMOTEIO (an internal error, 500)
_TRANSIENT_ERRNOS = (errno.EBUSY, errno.EREMOTEIO)


def _transient(e: Exception) -> bool:
    """Connection lost or refused, timeouts, 5xx, throttling: worth another try. Anything else is permanent. Told by
    the exception's type, the HTTP status and the store's error code (on it or on the client's error it wraps), never
    by words in its text alone."""
    for x in _chain(e):
        if isinstance(x, (ConnectionError, TimeoutError)):
            return True
        names = [c.__name__ for c in type(x).__mro__]  # aiohttp's ClientConnectorError is a ClientConnectionError
        if any(k in n for n in names for k in ("Connection", "Timeout", "Throttl", "IncompleteRead", "ClientPayload")):
            return True
        status, code = _status_and_code(x)
        if (status is not None and (status >= 500 or status in (408, 429))) or code in _TRANSIENT_CODES:
            return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the errors it was raised from (a client library's own error under s3fs's ``OSError``)."""
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in out and len(out) < 8:
        out.append(x)
        x = x.__cause__
    return out


def _status_and_code(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the store's error code an exception carries: botocore's ``response`` (S3), aiohttp's
    ``status`` (HTTP), gcsfs's ``code``, requests' ``response.status_code``."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (status if isinstance(status, int) else None), response.get("Error", {}).get("Code")
    status = getattr(e, "status", None)  # aiohttp's (its ``code`` is a deprecated alias)
    if not isinstance(status, int):
        status = getattr(e, "code", None)  # gcsfs's HttpError
    if not isinstance(status, int):
        status = getattr(response, "status_code", None)  # requests'
    return (status if isinstance(status, int) and 100 <= status < 600 else None), None


def _cause(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError) and e.__cause__ is not None:  # fsspec's HTTP: the failure under it
        return _cause(e.__cause__)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
