"""A batch read from object storage in few requests (gpupipe/sources/ranges.py: the node's shard cache off,
``cache_limit=0``), against the tests' real S3-compatible
server: kept blocks and coalesced ranges give exactly the bytes the same shards give on disk, in the batch's order,
with far fewer requests than samples; a fault in a block or a coalesced range still names the URL (after the retries
for a server that is gone)."""

import warnings

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe import Remote, StorageError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources import ranges
from gpupipe.sources.open import open_source as scan
from gpupipe.sources.ranges import Span, coalesce

from .common_utils import S3Server

FAST = dict(retries=3, backoff=0.05)


def test_samples_close_together_share_a_request():
    spans, where = coalesce([0, 0, 1, 0, 0], [100, 0, 0, 10_000, 50], [50, 40, 10, 5, 50], max_gap=20, max_span=400)
    assert spans == [Span(0, 0, 150), Span(0, 10_000, 10_005), Span(1, 0, 10)]
    assert where == [(0, 100), (0, 0), (2, 0), (1, 0), (0, 50)]
    spans, where = coalesce([0, 0, 0], [0, 0, 60], [50, 50, 50], max_gap=20, max_span=100)  # a repeat; the cap
    assert spans == [Span(0, 0, 50), Span(0, 60, 110)] and where == [(0, 0), (0, 0), (1, 0)]


@pytest.fixture(scope="module")
def shards(unique_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranges") / "prepared"
    prepare(unique_folder, out, PrepareOptions(shard_size=24 * 1024))  # 3-4 samples a shard
    return out


@pytest.fixture(scope="module")
def url(s3, shards):
    return s3.upload(shards, "ranges")


@pytest.mark.parametrize("memory_cache", [256 << 20, 0], ids=["blocks", "coalesced"])
def test_a_batch_is_the_disks_bytes_in_few_requests(shards, url, memory_cache, monkeypatch):
    monkeypatch.setattr(ranges, "BLOCK", 6000)  # samples across block boundaries, several blocks per shard
    disk, remote = scan(shards), scan(Remote(url, cache_limit=0, memory_cache=memory_cache))
    assert remote.reader.keeps_blocks == (memory_cache > 0) and len(remote.shard_paths) >= 3
    batch = [int(i) for i in np.random.default_rng(0).permutation(len(disk))] + [4, 4]
    assert remote.read_many(batch) == [disk.read(i) for i in batch]
    used = remote.reader.requests
    assert used < len(batch)
    assert remote.read_many(list(range(len(disk)))) == [disk.read(i) for i in range(len(disk))]
    assert remote.reader.requests == used if memory_cache else used + len(remote.shard_paths)
    assert remote.read(7) == disk.read(7)


@pytest.fixture(scope="module")
def many(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranges-window") / "prepared"
    prepare(folder, out, PrepareOptions(shard_size=16 * 1024))  # 24 samples in 2-4 KiB, some 10 shards
    return out


def test_a_window_reads_each_block_once_per_epoch_from_a_set_larger_than_the_cache(s3, many, monkeypatch):
    """shuffle_window=2 with a memory cache that holds 2 shards of a larger set: the same batches as from the disk,
    and each block read once in an epoch (in one process); the global shuffle over that cache is warned about."""
    monkeypatch.setattr(ranges, "BLOCK", 6000)  # several blocks per shard, samples across their boundaries
    url = s3.upload(many, "window")
    ends = scan(url).reader.ends
    budget = scan(url).reader.window_bytes(2)
    assert len(ends) >= 6 and budget < ends.sum()
    kw = dict(batch_size=4, image_size=24, num_workers=0, device="cpu", seed=2, normalize=False, drop_last=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        remote = gpupipe.build_loader(Remote(url, cache_limit=0, memory_cache=budget), "pillow", shuffle_window=2, **kw)
    disk = gpupipe.build_loader(many, "pillow", shuffle_window=2, **kw)
    reader = remote.dataset.reader
    blocks = sum(-(-int(e) // ranges.BLOCK) for e in ends)
    assert reader.keeps_blocks
    for epoch in (0, 1):
        remote.set_epoch(epoch)
        disk.set_epoch(epoch)
        before = reader.requests
        for (a, la), (b, lb) in zip(remote, disk, strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb)
        if epoch == 0:
            assert (reader.requests, reader.bytes_read) == (blocks, int(ends.sum()))
        assert reader.requests - before <= blocks
    with pytest.warns(UserWarning, match=rf"^{url}: a global shuffle over .* MiB of shards, more than the .* use "):
        shuffled = gpupipe.build_loader(Remote(url, cache_limit=0, memory_cache=budget), "pillow", **kw)
    assert not shuffled.dataset.reader.keeps_blocks
    with pytest.warns(UserWarning, match=r"shuffle_window=2 spans up to .* use shuffle_window=1 or less"):
        gpupipe.build_loader(Remote(url, cache_limit=0, memory_cache=budget - 1), "pillow", shuffle_window=2, **kw)


@pytest.mark.slow  # an S3 server process of its own, stopped
def test_a_server_gone_fails_each_sample_of_a_request_with_its_url(s3, shards):
    server = S3Server(process=True)
    try:
        url, options = server.upload(shards, "gone"), {"endpoint_url": server.endpoint}
        kw = dict(storage_options=options, cache_limit=0, **FAST)
        sets = [scan(Remote(url, memory_cache=m, **kw)) for m in (256 << 20, 0)]
    finally:
        server.stop()
    for data in sets:  # kept blocks, then coalesced ranges
        got = data.read_many(list(range(len(data))))
        assert data.reader.requests < len(data)
        for i, e in enumerate(got):
            assert isinstance(e, StorageError)
            assert str(e).startswith(f"{data.shard_paths[int(data._shard[i])]}: unreachable after 3 attempts")


@pytest.mark.parametrize("memory_cache", [256 << 20, 0], ids=["blocks", "coalesced"])
def test_a_truncated_shard_fails_its_samples_only(s3, shards, memory_cache):
    url = s3.upload(shards, f"cut-{memory_cache}")
    data = scan(Remote(url, cache_limit=0, memory_cache=memory_cache))
    s3.client().pipe(f"{S3Server.BUCKET}/cut-{memory_cache}/shard-000001.tar", b"x" * 600)
    got = data.read_many(list(range(len(data))))
    cut = [i for i in range(len(data)) if data.shard_paths[int(data._shard[i])].endswith("shard-000001.tar")]
    assert cut and all(isinstance(got[i], StorageError) for i in cut)
    assert all("shard-000001.tar ends before its member" in str(got[i]) for i in cut)
    assert all(got[i] == scan(shards).read(i) for i in range(len(data)) if i not in cut)


def test_memory_cache_is_checked():
    with pytest.raises(ValueError, match="memory_cache must be >= 0"):
        Remote("s3://b/x", memory_cache=-1)
