"""gpupipe/sources/objstore.py: the Store's retries against real servers on 127.0.0.1 (a small HTTP server that
answers as S3 and as a web server do, with the faults queued; a socket that never answers): what is retried, what
is not, and the deadline over all attempts."""

from __future__ import annotations

import socket
import time

import pytest

from gpupipe import Remote, StorageError
from gpupipe.sources.objstore import Store

from .common_utils import BlackHole, HTTPFiles

pytest.importorskip("aiohttp", reason="fsspec's HTTP file system needs aiohttp")

_S3_ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{}</Code><Message>{}</Message></Error>"
INTERNAL = _S3_ERROR.format("InternalError", "We encountered an internal error. Please try again.").encode()
SLOW_DOWN = _S3_ERROR.format("SlowDown", "Please reduce your request rate.").encode()
BAD = _S3_ERROR.format("InvalidArgument", "Invalid argument.").encode()


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "obj").write_bytes(b"0123456789")
    server = HTTPFiles(tmp_path)
    yield server
    server.stop()


def _store(url: str, endpoint: str, **kw) -> Store:
    options = {"endpoint_url": endpoint, "key": "k", "secret": "s"} if url.startswith("s3://") else {}
    return Store(Remote(url, storage_options=options, backoff=0.01, **kw), url)


def _url(files: HTTPFiles, scheme: str) -> str:
    if scheme == "s3":
        pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
        return "s3://bucket/obj"
    return f"{files.url}/bucket/obj"


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_5xx_and_throttling_are_retried_until_the_object_comes(files, scheme):
    """s3fs reports a 500 as a bare OSError whose text is the server's message, and a 503 SlowDown as one saying
    "Please reduce your request rate.": the Store tells them by the status and the code, not by words."""
    url = _url(files, scheme)
    for status, body in ((500, INTERNAL), (500, INTERNAL), (503, SLOW_DOWN)):
        files.fail(status, body)
    assert _store(url, files.url).read(url, 2, 4) == b"2345"
    assert files.requests == ["/bucket/obj"] * 4  # one request per attempt: botocore's own retries are off


def test_a_read_past_its_timeout_is_retried_by_the_store_alone(files):
    """s3fs retried a timed-out call 5 times by itself, unseen: a GET the server was slow to answer was asked
    again at once (a shard fetched twice), and each of the Store's attempts was 5."""
    pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    files.late = 1.5
    options = {"endpoint_url": files.url, "key": "k", "secret": "s", "config_kwargs": {"read_timeout": 0.5}}
    store = Store(Remote("s3://bucket/obj", storage_options=options, backoff=0.01, retries=2), "s3://bucket/obj")
    with pytest.raises(StorageError, match=r"bucket/obj: unreachable after 2 attempts .*timeout"):
        store.read("s3://bucket/obj", 2, 4)
    assert files.requests == ["/bucket/obj"] * 2  # one request per attempt


@pytest.mark.parametrize("scheme", [pytest.param("s3", marks=pytest.mark.slow), "http"])
def test_a_client_error_is_not_retried(files, scheme):
    url = _url(files, scheme)
    files.fail(400, BAD)
    with pytest.raises(StorageError, match="bucket/obj: ") as e:
        _store(url, files.url).read(url, 2, 4)
    assert "unreachable" not in str(e.value) and files.requests == ["/bucket/obj"]


@pytest.mark.parametrize("scheme", [pytest.param("s3", marks=pytest.mark.slow), "http"])
def test_an_endpoint_that_never_answers_ends_at_the_deadline(scheme):
    """A server that accepts and never answers held a read for ~16 minutes (6 attempts, each through the client's
    own timeouts and retries); the deadline bounds them all, and the error states it."""
    if scheme == "s3":
        pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    hole = BlackHole()
    url = "s3://bucket/obj" if scheme == "s3" else f"{hole.url}/bucket/obj"
    store = _store(url, hole.url, deadline=2)
    try:
        for read in (lambda: store.read(url, 0, 4), lambda: store.read_many([url], [0], [4])[0]):
            started = time.monotonic()
            with pytest.raises(StorageError, match=r"bucket/obj: no answer within the deadline of 2 s \(1 attempt"):
                got = read()
                raise got if isinstance(got, Exception) else AssertionError(got)
            assert time.monotonic() - started < 60  # 2 s and a thread's start: the bound is the point, not the time
    finally:
        hole.stop()


def test_the_deadline_leaves_no_wait_past_it(files):
    url = f"{files.url}/bucket/obj"
    store = Store(Remote(url, backoff=60, deadline=10), url)  # the first backoff, 30-60 s, would pass the deadline
    assert store.read(url, 0, 4) == b"0123"  # the client's imports and session are made before the clock matters
    files.fail(500, INTERNAL)
    with pytest.raises(StorageError, match=r"deadline of 10 s \(1 attempt\(s\); the last error: ClientResponseError"):
        store.read(url, 0, 4)
    with pytest.raises(ValueError, match="deadline must be > 0 seconds"):
        Remote(url, deadline=0)


def test_a_host_that_cannot_be_reached_is_named_not_a_missing_object(files):
    """fsspec's HTTP file system raises FileNotFoundError for a refused connection, a name that does not resolve and
    a 5xx alike: each read 'no such object'. The cause under it decides: retried, then the host named."""
    closed = socket.socket()  # bound, never listening: a connection to it is refused
    closed.bind(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/bucket/obj"
        with pytest.raises(StorageError, match=r"unreachable after 2 attempts .*Cannot connect to host 127\.0\.0\.1:"):
            _store(url, url, retries=2).info(url)
    finally:
        closed.close()
    url = "http://gpupipe-test.invalid/bucket/obj"  # .invalid never resolves (RFC 2606)
    with pytest.raises(StorageError, match=r"gpupipe-test\.invalid") as e:
        _store(url, url, retries=2, deadline=30).info(url)
    assert "no such object" not in str(e.value)
    files.fail(503, SLOW_DOWN)  # the HEAD, then the GET fsspec tries after it
    files.fail(503, SLOW_DOWN)
    assert _store(f"{files.url}/bucket/obj", files.url).info(f"{files.url}/bucket/obj")["size"] == 10
    with pytest.raises(StorageError, match=r"bucket/nope: no such object$"):
        _store(f"{files.url}/bucket/nope", files.url).info(f"{files.url}/bucket/nope")
