"""Shards on object storage, read from a real S3-compatible server the tests start on 127.0.0.1 (moto's server
mode; the client, s3fs, talks HTTP to it): every backend gets the same samples, labels and order as from the disk,
for prepared and for foreign (webdataset-written) shards; and the faults a store has: a server gone mid-epoch, a
truncated object, a missing one, a refused one (403)."""

import io
import re
import time

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe import Remote, StorageError
from gpupipe.errors import GpupipeError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources import remote
from gpupipe.sources.objstore import Store
from gpupipe.sources.open import open_source as scan
from gpupipe.sources.remote import expand_braces

from .common_utils import CPU_LOADER_BACKENDS, HTTPFiles, S3Server, assert_resume_is_exact, photo, two_rank_epochs

wds = pytest.importorskip("webdataset")
KW = dict(batch_size=4, image_size=24, num_workers=2, drop_last=False, device="cpu", seed=3, normalize=False)
FAST = dict(retries=3, backoff=0.05)  # a quick give-up for the fault tests


@pytest.fixture(scope="module")
def prepared(unique_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("remote") / "prepared"
    prepare(unique_folder, out, PrepareOptions(shard_size=8 * 1024))
    return out


@pytest.fixture(scope="module")
def prepared_url(s3, prepared):
    return s3.upload(prepared, "prepared")


def _encoded(seed: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    photo(np.random.default_rng(seed), 30 + seed % 7, 40).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Three shards from ``webdataset``: ``.jpg`` + ``.json`` labels, then ``.png`` + ``.cls``; label ``i % 5``."""
    d = tmp_path_factory.mktemp("wds-remote")
    with wds.ShardWriter(str(d / "part-%06d.tar"), maxcount=5, verbose=0) as w:
        for i in range(10):
            w.write({"__key__": f"s{i:04d}", "jpg": _encoded(i), "json": {"label": i % 5}})
    with wds.TarWriter(str(d / "part-000002.tar")) as w:
        for i in range(10, 14):
            w.write({"__key__": f"s{i:04d}", "png": _encoded(i, "PNG"), "cls": i % 5})
    return d


@pytest.fixture(scope="module")
def foreign_url(s3, foreign):
    return s3.upload(foreign, "foreign")


def _epochs(loader, epochs=2):
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append(list(loader))
    return out


def _assert_same(a, b):
    for ea, eb in zip(a, b, strict=True):
        assert torch.cat([y for _, y in ea]).tolist() == torch.cat([y for _, y in eb]).tolist()
        assert torch.equal(torch.cat([x for x, _ in ea]), torch.cat([x for x, _ in eb]))


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_prepared_shards_read_from_s3_as_from_disk(prepared, prepared_url, backend):
    from_s3 = _epochs(gpupipe.build_loader(prepared_url, backend, train=True, **KW))
    _assert_same(from_s3, _epochs(gpupipe.build_loader(prepared, backend, train=True, **KW)))
    assert sorted(torch.cat([y for _, y in from_s3[0]]).tolist()) == list(range(13))


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_foreign_shards_read_from_s3_as_from_disk(foreign, foreign_url, backend):
    on_disk = str(foreign / "part-*.tar")
    for url in (f"{foreign_url}/part-*.tar", f"{foreign_url}/part-{{000000..000002}}.tar"):
        a = _epochs(gpupipe.build_loader(url, backend, train=False, **KW), 1)
        _assert_same(a, _epochs(gpupipe.build_loader(on_disk, backend, train=False, **KW), 1))
        assert torch.cat([y for _, y in a[0]]).tolist() == [i % 5 for i in range(14)]


def test_the_same_samples_and_index_as_from_disk(foreign, foreign_url, prepared, prepared_url):
    for url, path in ((prepared_url, prepared), (f"{foreign_url}/part-*.tar", str(foreign / "part-*.tar"))):
        a, b = scan(url), scan(path)
        assert list(a.samples) == list(b.samples) and a.classes == b.classes
        assert all(a.read(i) == b.read(i) for i in range(len(a)))
    listed = scan([f"{foreign_url}/part-000001.tar", f"{foreign_url}/part-000000.tar"])  # a list keeps its order
    assert listed.targets == [i % 5 for i in (*range(5, 10), *range(5))]


def test_a_foreign_shards_index_is_built_once(foreign_url, monkeypatch):
    url = f"{foreign_url}/part-000000.tar"
    scan(url)  # built (or already cached by an earlier test)
    monkeypatch.setattr(remote, "index_tar", lambda p: pytest.fail("the cached index was not used"))
    assert scan(url).targets == [0, 1, 2, 3, 4]


def test_foreign_shards_take_their_sizes_and_etags_from_one_listing(foreign_url):
    urls = [f"{foreign_url}/part-00000{i}.tar" for i in range(3)]
    store = Store(Remote(urls), urls[0])
    listed = remote._listed(store, urls)
    for url in urls:  # what a HEAD request per shard gave: the cached index's stamp is unchanged
        info = store.info(url)
        assert (listed[url]["ETag"], listed[url]["size"]) == (info["ETag"], info["size"])


@pytest.mark.parametrize("backend", ["pillow", "synthetic"])
def test_ranks_take_equal_steps_over_s3(prepared_url, backend):
    steps, seen = two_rank_epochs(prepared_url, backend)
    assert steps[0] == steps[1] and seen[0] | seen[1] == set(range(13))


def test_resume_mid_epoch_over_s3(prepared_url):
    kw = dict(KW, batch_size=3, num_workers=1)
    assert_resume_is_exact(lambda: gpupipe.build_loader(prepared_url, "pillow", train=True, **kw), epoch=1, batch=2)


def test_storage_options_reach_the_client_and_stay_hidden(s3, prepared_url, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "do-not-print-me"}
    source = Remote(prepared_url, storage_options=options)
    assert "do-not-print-me" not in repr(source) and "do-not-print-me" not in str(scan(source).root)
    assert len(scan(source)) == 13


@pytest.mark.slow  # an S3 server process of its own
def test_a_cache_folder_keeps_shards_once_read(s3, prepared, tmp_path):  # s3: the AWS_* keys
    """A second server, stopped after the first epoch: the cached shards still serve the second."""
    server = S3Server(process=True)
    try:
        url = server.upload(prepared, "cached")
        source = Remote(url, storage_options={"endpoint_url": server.endpoint}, cache_dir=str(tmp_path), **FAST)
        loader = gpupipe.build_loader(source, "pillow", train=True, **KW)
        first = _epochs(loader, 1)
    finally:
        server.stop()
    assert len(list(tmp_path.glob("*.tar"))) == len(list(prepared.glob("*.tar")))
    loader.set_epoch(0)
    _assert_same(first, [list(loader)])


def _loader_on_a_server_that_stops(prepared, backend):
    server = S3Server(process=True)
    url = server.upload(prepared, "stopping")
    source = Remote(url, storage_options={"endpoint_url": server.endpoint}, **FAST)
    return server, gpupipe.build_loader(source, backend, train=False, **dict(KW, num_workers=1, batch_size=2))


@pytest.mark.parametrize("on_error", ["raise", pytest.param("skip", marks=pytest.mark.slow)])
def test_a_server_gone_mid_epoch_is_retried_then_named(s3, prepared, on_error):
    server, loader = _loader_on_a_server_that_stops(prepared, "pillow")
    loader.on_error = on_error
    it = iter(loader)
    next(it)
    server.stop()
    started = time.monotonic()
    with pytest.raises(GpupipeError, match=r"s3://gpupipe-test/stopping/shard-\d+\.tar: unreachable after 3 attempts"):
        list(it)
    assert time.monotonic() - started < 30


def test_a_missing_object_is_named(s3, prepared):
    url = s3.upload(prepared, "missing")
    data = scan(url)
    s3.client().rm(f"{S3Server.BUCKET}/missing/shard-000001.tar")
    index = next(i for i in range(len(data)) if data.shard_paths[int(data._shard[i])].endswith("1.tar"))
    with pytest.raises(StorageError, match=r"missing/shard-000001\.tar: no such object"):
        data.read(index)
    with pytest.raises(StorageError, match="nowhere: neither a folder written by gpupipe prepare"):
        scan(f"s3://{S3Server.BUCKET}/nowhere")
    with pytest.raises(StorageError, match="no object matches"):
        scan(f"s3://{S3Server.BUCKET}/nowhere/*.tar")


def test_a_missing_bucket_is_named_as_such(s3, prepared):
    s3.upload(prepared, "somewhere")  # the server is up and answers for its own bucket
    with pytest.raises(StorageError, match=r"no such bucket 'no-such-bucket-here' at this endpoint \(create it first"):
        scan("s3://no-such-bucket-here/train/shard-000000.tar")


def test_a_truncated_object_is_named(s3, prepared):
    url = s3.upload(prepared, "truncated")
    data = scan(url)
    fs = s3.client()
    fs.pipe(f"{S3Server.BUCKET}/truncated/shard-000000.tar", (prepared / "shard-000000.tar").read_bytes()[:1000])
    # cut after the loader was built: the listing it read said otherwise
    with pytest.raises(StorageError, match=r"truncated/shard-000000\.tar: 1000 bytes .* changed .*truncated\?"):
        for i in range(len(data)):
            data.read(i)
    loader = gpupipe.build_loader(url, "pillow", train=False, **KW)
    with pytest.raises(GpupipeError, match=r"shard-000000\.tar ends before its member"):
        list(loader)


def test_access_denied_is_named_without_retrying(s3, prepared_url):
    s3.set_auth(enforced=True)
    try:
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"prepared/gpupipe\.json: access denied.*check the credentials"):
            scan(prepared_url)
        assert time.monotonic() - started < 5
    finally:
        s3.set_auth(enforced=False)


@pytest.fixture()
def web(prepared, tmp_path):
    """The prepared folder on a plain HTTP server (``/data``), a file beside it that is none of its own."""
    import shutil

    shutil.copytree(prepared, tmp_path / "data")
    shutil.copy(prepared / "shard-000000.tar", tmp_path / "secret.tar")
    server = HTTPFiles(tmp_path)
    yield server, tmp_path / "data"
    server.stop()


@pytest.mark.parametrize(
    "name", ["../secret.tar", "a/../../secret.tar", "/secret.tar", "http://127.0.0.1:1/x.tar", "%2e%2e/secret.tar"]
)
def test_a_prepared_folder_at_a_url_names_only_its_own_shards(prepared, web, name):
    import json

    server, data = web
    assert len(scan(f"{server.url}/data")) == len(scan(prepared))  # the folder as written reads over HTTP
    meta = json.loads((data / "gpupipe.json").read_text())
    meta["shards"][0] = name
    (data / "gpupipe.json").write_text(json.dumps(meta))
    with pytest.raises(GpupipeError, match=rf"data/gpupipe\.json: shard {re.escape(repr(name))} lies outside"):
        scan(f"{server.url}/data")
    assert not any("secret" in r or "x.tar" in r for r in server.requests)


def test_brace_notation():
    assert expand_braces("s3://b/a-{08..10}.tar") == ["s3://b/a-08.tar", "s3://b/a-09.tar", "s3://b/a-10.tar"]
    assert expand_braces("{train,val}/x-{0..1}.tar") == ["train/x-0.tar", "train/x-1.tar", "val/x-0.tar", "val/x-1.tar"]
    with pytest.raises(ValueError, match="runs backwards"):
        expand_braces("a-{3..1}.tar")
