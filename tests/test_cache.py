"""The node's shard cache (gpupipe/sources/cache.py) against the tests' real S3-compatible server, seen through a
counting proxy (what the server is asked): one fetch per shard per node for 2 ranks x 2 workers, the least recently
used shards evicted at the limit and pinned ones kept, a limit smaller than the window refused, a changed object
fetched again, a fetch killed mid-way fetched again (and a truncated copy never read), the next shards read ahead."""

import collections
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import gpupipe
from gpupipe import Remote
from gpupipe.errors import StorageError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources.cache import ShardCache, parse_limit
from gpupipe.sources.open import open_source as scan

from .common_utils import REPO_ROOT, CountingProxy, S3Server

pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
KW = dict(batch_size=4, image_size=24, device="cpu", seed=3, normalize=False)


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "prepared"
    prepare(folder, out, PrepareOptions(shard_size=16 * 1024, order="shuffled"))  # 24 samples, some 8 shards
    return out


@pytest.fixture
def proxy(s3):
    p = CountingProxy(s3.endpoint)
    yield p
    p.stop()


# The proxy answers once it holds the whole object: on a busy machine that may come past s3fs's 15 s read timeout,
# and a timed-out GET is asked again (the server serves both). These tests count requests, not time them.
PATIENT = {"read_timeout": 120}


def _remote(url: str, proxy: CountingProxy, cache, **kw) -> Remote:
    options = {"endpoint_url": proxy.endpoint, "config_kwargs": PATIENT}
    return Remote(url, storage_options=options, cache_dir=str(cache), **kw)


def _shard_gets(proxy: CountingProxy, prefix: str) -> dict[str, int]:
    return {os.path.basename(p): n for p, n in proxy.gets(f"/{S3Server.BUCKET}/{prefix}/shard-").items()}


_RANK = """
import sys
import gpupipe
import logging
logging.basicConfig(format="%(message)s")  # the store's retries, said on stderr (forked workers too)
logging.getLogger("gpupipe.sources.objstore").setLevel(logging.DEBUG)
url, endpoint, cache, rank = sys.argv[1:]
options = {"endpoint_url": endpoint, "config_kwargs": {"read_timeout": 120}}  # PATIENT
source = gpupipe.Remote(url, storage_options=options, cache_dir=cache)
loader = gpupipe.build_loader(source, "pillow", train=True, batch_size=4, image_size=24, num_workers=2, device="cpu",
                              normalize=False, rank=int(rank), world_size=2, shuffle_window=2)
for epoch in range(2):
    loader.set_epoch(epoch)
    assert sum(len(y) for _, y in loader) == len(loader) * 4
# the read ahead has moved on to the next epoch's first shards: let its fetch end before this process does (killed
# mid-way, it would leave the shard to the other rank, fetched twice; a fetch killed mid-way has a test of its own)
import gc, threading, time
del loader
gc.collect()
ahead = [t for t in threading.enumerate() if t.name == "gpupipe-read-ahead"]
end = time.monotonic() + 120
while any(t.is_alive() for t in ahead) and time.monotonic() < end:
    time.sleep(0.05)
assert not any(t.is_alive() for t in ahead), "the read ahead outlived its loader"
"""


@pytest.mark.slow
def test_two_ranks_of_two_workers_fetch_each_shard_once(s3, prepared, proxy, tmp_path):
    """Two processes (two local ranks) of two DataLoader workers each, started together, two epochs: each shard is
    asked of the server once, whole."""
    url = s3.upload(prepared, "node")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, url, proxy.endpoint, str(tmp_path / "cache"), str(r)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    said = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], said
    # a GET the transport failed (the store's retry, logged) is asked again; the cache's own fetches are once a shard
    retried = collections.Counter(
        os.path.basename(line.split()[1].rstrip(":"))
        for text in said
        for line in text.splitlines()
        if line.startswith("retry ")
    )
    shards = sorted(prepared.glob("shard-*.tar"))
    gets = [(p, r, n) for m, p, r, n in proxy.log if m == "GET" and "/node/shard-" in p]
    why = f"the shard GETs (path, Range, bytes): {gets}; the ranks' stderr: {said}"
    assert _shard_gets(proxy, "node") == {p.name: 1 + retried[p.name] for p in shards}, why
    whole = {
        os.path.basename(p): n for p, r, n in gets if r is None and n == os.path.getsize(prepared / os.path.basename(p))
    }
    assert sorted(whole) == [p.name for p in shards], why  # each shard answered whole at least once


def _files(cache) -> dict[str, int]:
    return {p.name.split("-", 3)[3]: p.stat().st_size for p in cache.iterdir() if p.name.endswith(".tar")}


def test_the_least_recently_used_shards_go_at_the_limit_never_a_pinned_one(s3, prepared, tmp_path):
    url = s3.upload(prepared, "evict")
    data = scan(Remote(url, cache_dir=str(tmp_path)))
    sizes, n = data.cache.sizes, len(data.shard_paths)
    limit = sum(sorted(sizes)[-2:])  # two shards, whichever
    cache = ShardCache(tmp_path / "small", limit)
    fetch = lambda s: cache.ensure(data.store, data.shard_paths[s], sizes[s], data.cache.etags[s])
    pinned = cache.pin(data.store, data.shard_paths[0], sizes[0], data.cache.etags[0])
    for s in range(1, n):
        fetch(s)
        held = _files(tmp_path / "small")
        assert "shard-000000.tar" in held and f"shard-{s:06d}.tar" in held  # the pinned one, the newest
        assert sum(held.values()) <= limit
    pinned.close()
    fetch(1)
    fetch(2)  # unpinned, shard 0 is the least recently used: it goes first, then the last one fetched
    assert sorted(_files(tmp_path / "small")) == ["shard-000001.tar", "shard-000002.tar"]
    assert cache.fetches == n + 2  # shards 1 and 2 had been evicted: fetched again


def test_a_limit_smaller_than_the_window_is_refused_with_the_numbers(s3, prepared, tmp_path):
    url = s3.upload(prepared, "small")
    two = sum(sorted(scan(Remote(url, cache_dir=str(tmp_path))).cache.sizes)[-2:])
    source = Remote(url, cache_dir=str(tmp_path), cache_limit=two - 1, memory_cache=0)  # no blocks kept either
    refused = r"cache_limit=.* KiB \(--cache-limit\) holds fewer than shuffle_window=2 \(--shuffle-window\) shards \("
    with pytest.raises(ValueError, match=refused):
        gpupipe.build_loader(source, "pillow", shuffle_window=2, num_workers=0, **KW)
    one = gpupipe.build_loader(source, "pillow", shuffle_window=1, num_workers=0, **KW).dataset
    assert one.cached and one.read_ahead is None  # no room for the next group: each shard fetched when needed
    with pytest.warns(UserWarning, match=r"a global shuffle over .* KiB of shards, more than cache_limit=.* use "):
        assert not gpupipe.build_loader(source, "pillow", num_workers=0, **KW).dataset.cached
    assert parse_limit("50GB") == 50 << 30 and parse_limit(0) == 0
    with pytest.raises(ValueError, match="cache_limit: expected a size such as 50GB"):
        Remote(url, cache_limit="lots")


def test_a_set_prepared_again_in_place_is_read_anew(s3, prepared, unique_folder, tmp_path):
    """The cached copies are keyed by the objects' size and ETag: a set re-written at the same URL is fetched again,
    never read through the old copies with the new index."""
    other = tmp_path / "other"
    prepare(unique_folder, other, PrepareOptions(shard_size=16 * 1024))
    url = s3.upload(prepared, "again")
    first = scan(Remote(url, cache_dir=str(tmp_path / "cache")))
    assert [first.read(i) for i in range(len(first))] == [scan(prepared).read(i) for i in range(len(first))]
    s3.upload(other, "again")
    second, disk = scan(Remote(url, cache_dir=str(tmp_path / "cache"))), scan(other)
    assert [second.read(i) for i in range(len(second))] == [disk.read(i) for i in range(len(disk))]


_PIN = """
import sys
from gpupipe.sources.cache import ShardCache
from gpupipe.sources.objstore import Remote, Store
url, endpoint, cache, size, etag = sys.argv[1:]
store = Store(Remote(url, storage_options={"endpoint_url": endpoint}, retries=1), url)
ShardCache(cache, 1 << 30).pin(store, url, int(size), etag)
"""


def test_a_fetch_killed_mid_way_is_fetched_again_and_a_truncated_copy_never_read(s3, prepared, proxy, tmp_path):
    url = s3.upload(prepared, "killed")
    data = scan(Remote(url, cache_dir=str(tmp_path)))
    shard, size, etag = data.shard_paths[0], data.cache.sizes[0], data.cache.etags[0]
    proxy.stall.add(f"/{S3Server.BUCKET}/killed/shard-000000.tar")
    child = subprocess.Popen([sys.executable, "-c", _PIN, shard, proxy.endpoint, str(tmp_path), str(size), etag])
    try:
        assert proxy.stalled.wait(300), "the fetch never started"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    proxy.stall.clear()
    cache = ShardCache(tmp_path, 1 << 30)
    path = tmp_path / cache.name(shard, size, etag)
    assert not path.exists()  # half a file was never put in place
    expected = (prepared / "shard-000000.tar").read_bytes()
    with cache.pin(data.store, shard, size, etag) as pinned:  # its lock was freed by the kill: fetched again
        assert pinned.read(0, size) == expected
    path.write_bytes(expected[:100])  # a copy cut short (a disk full, a crash before the data reached it)
    with cache.pin(data.store, shard, size, etag) as pinned:
        assert pinned.read(0, size) == expected
    assert cache.fetches == 2 and not list(tmp_path.glob("*.part"))


def test_the_next_shards_are_read_ahead(s3, prepared, proxy, tmp_path):
    """Built and not yet iterated, a loader's read-ahead fetches the shards its first batch needs and the next
    group's (``ahead`` = the window); iterating then asks the server for no shard twice."""
    url = s3.upload(prepared, "ahead")
    loader = gpupipe.build_loader(_remote(url, proxy, tmp_path), "pillow", shuffle_window=2, num_workers=0, **KW)
    ahead = loader.dataset.read_ahead
    order, first = ahead.plan(0)
    target = min(int((first <= 0).sum()) + 2, len(order))
    deadline = time.monotonic() + 300
    while ahead.done < target and time.monotonic() < deadline:  # a hang guard, not a timing margin
        time.sleep(0.05)
    assert ahead.done == target and ahead.error is None
    assert sum(_shard_gets(proxy, "ahead").values()) == target
    assert sorted(_shard_gets(proxy, "ahead")) == sorted(f"shard-{s:06d}.tar" for s in order[:target])
    list(loader)
    assert set(_shard_gets(proxy, "ahead").values()) == {1} and len(_shard_gets(proxy, "ahead")) == len(order)
    spawned = pickle.loads(pickle.dumps(loader.dataset))  # what a spawned worker gets: no thread, no pins
    assert spawned.read_ahead is None and spawned.read(5) == loader.dataset.read(5)


def test_train_takes_the_cache_limit(s3, prepared, tmp_path):
    from gpupipe.train.build import build_loaders
    from gpupipe.train.config import load_config

    url = s3.upload(prepared, "train")
    for given, limit in (("1GB", 1 << 30), ("0", None)):
        cfg = load_config(None, {"data": url, "cache_limit": given, "workers": 0, "batch_size": 4, "image_size": 24})
        data = build_loaders(cfg, torch.device("cpu"))[0].dataset
        assert (data.cache and data.cache.cache.limit) == limit


def test_an_object_re_written_with_the_same_size_under_a_running_loader_is_an_error_naming_it(s3, prepared, tmp_path):
    """The loader listed the shard; then it is re-written, as long as before, and not cached yet (or evicted): the
    bytes fetched are not the listed version (their MD5 is not the ETag), an error naming the object, never decoded
    with the old index."""
    url = s3.upload(prepared, "rewritten")
    data = scan(Remote(url, cache_dir=str(tmp_path)))
    shard = prepared / "shard-000000.tar"
    changed = bytearray(shard.read_bytes())
    changed[2000:2100] = bytes(100)  # inside the first JPEG: the same size, other pixels
    s3.client().pipe_file(f"{S3Server.BUCKET}/rewritten/shard-000000.tar", bytes(changed))
    first = int((data._shard == 0).nonzero()[0][0])
    with pytest.raises(StorageError, match=rf"^{url}/shard-000000.tar: the object changed since the loader listed it"):
        data.read(first)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tar", ".part"))]  # nothing of it kept


def test_a_cached_copy_altered_in_place_is_fetched_again_never_read(s3, prepared, tmp_path):
    """A cached shard whose bytes changed after it was fetched (the same size: a disk's error, a stray write) no longer
    matches the object: the next process to open it fetches it again."""
    url = s3.upload(prepared, "corrupted")
    data = scan(Remote(url, cache_dir=str(tmp_path)))
    shard, size, etag = data.shard_paths[0], data.cache.sizes[0], data.cache.etags[0]
    expected = (prepared / "shard-000000.tar").read_bytes()
    ShardCache(tmp_path, 1 << 30).ensure(data.store, shard, size, etag)
    path = tmp_path / ShardCache.name(shard, size, etag)
    with open(path, "r+b") as f:
        f.seek(3000)
        f.write(b"\xff" * 64)
    cache = ShardCache(tmp_path, 1 << 30)  # another process's
    with cache.pin(data.store, shard, size, etag) as pinned:
        assert pinned.read(0, size) == expected and cache.fetches == 1


def test_a_full_cache_disk_names_the_folder_the_free_space_and_the_fix(s3, prepared, tmp_path):
    """``cache_limit`` above what the disk can hold: the shard that does not fit is a one-line error naming the cache
    folder, its free space and the fix, not the store's "No space left on device"."""
    from .test_train_checkpoint import small_disk

    url = s3.upload(prepared, "full")
    with small_disk(tmp_path, 40 << 10) as (mount, limit):
        if limit is not None:
            pytest.skip("needs a small real disk (a tmpfs this process may mount)")
        disk = mount / "cache"  # the tmpfs's own root is writable by every user: refused as a cache folder
        data = scan(Remote(url, cache_dir=str(disk), cache_limit="1GB"))
        with pytest.raises(StorageError) as e:
            for i in range(len(data)):
                data.read(i)
        said = str(e.value)
        assert said.startswith(f"{disk}: no room for {url}/shard-") and "\n" not in said
        assert " free, and cache_limit 1.00 GiB is more than the disk holds; set a smaller --cache-limit" in said
        assert not list(disk.glob("*.part"))


def test_the_default_folder_is_the_users_own(s3, prepared, tmp_path, monkeypatch):
    """``$XDG_CACHE_HOME/gpupipe/shards``: made mode 0700, and made so where it was open to others."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GPUPIPE_CACHE", raising=False)
    url = s3.upload(prepared, "default")
    data = scan(Remote(url))
    folder = tmp_path / "xdg" / "gpupipe" / "shards"
    assert data.cache.cache.folder == folder and oct(folder.stat().st_mode & 0o777) == oct(0o700)
    folder.chmod(0o755)
    scan(Remote(url))
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.slow
def test_a_cache_limit_below_the_shuffle_window_through_the_cli_is_one_line_with_both_flags(s3, prepared, tmp_path):
    """``gpupipe train --shuffle-window 2 --cache-limit 20KB``: refused before training, in one line naming both flags
    and sizes as they are (it said "cache_limit=0.0 MiB ... the largest 2 hold 0.0 MiB")."""
    url = s3.upload(prepared, "cli")
    args = ["--data", url, "--shuffle-window", "2", "--cache-limit", "20KB", "--epochs", "1", "--batch-size", "4"]
    args += ["--image-size", "32", "--workers", "0", "--device", "cpu", "--out", str(tmp_path / "run")]
    env = {**os.environ, "GPUPIPE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "gpupipe", "train", *args], capture_output=True, text=True, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(
        "error: cache_limit=20.0 KiB (--cache-limit) holds fewer than shuffle_window=2 (--shuffle-window) shards (the "
        "largest 2 hold "
    )
    assert " KiB); allow at least " in lines[0] and "0.0 MiB" not in lines[0]


_FILL = """
import random, sys
from gpupipe import Remote
from gpupipe.sources.open import open_source
url, cache, limit, local, seed = sys.argv[1:]
data = open_source(Remote(url, cache_dir=cache, cache_limit=int(limit)))
data.cached, data.cache.keep = True, 1  # every read through the cache, one shard pinned at a time
truth = open_source(local)
order = list(range(len(data))) * 3
random.Random(int(seed)).shuffle(order)
bad = [i for i in order if data.read(i) != truth.read(i)]
data.cache.release(set())
print(len(order), len(bad), data.cache.cache.fetches)
"""


@pytest.mark.slow
def test_ranks_of_two_nodes_fill_one_small_cache_at_once_and_read_every_byte_right(s3, prepared, tmp_path):
    """Four processes (two "nodes" of two ranks, one shared folder, as on a shared file system) read every sample
    three times in orders of their own through a cache that holds three shards: shards are fetched, evicted and
    fetched again while others read them; each reads the store's bytes, every time."""
    url = s3.upload(prepared, "fill")
    limit = 3 * max(p.stat().st_size for p in prepared.glob("shard-*.tar"))
    cache = tmp_path / "cache"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _FILL, url, str(cache), str(limit), str(prepared), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2)},
        )
        for r in range(4)
    ]
    said = [p.communicate(timeout=600) for p in ranks]
    assert [p.returncode for p in ranks] == [0] * 4, [err for _, err in said]
    counts = [tuple(map(int, out.split())) for out, _ in said]
    assert all(read == 3 * 24 and bad == 0 for read, bad, _ in counts)
    assert sum(fetched for *_, fetched in counts) > len(list(prepared.glob("shard-*.tar")))  # evicted, fetched again
    held = sum(p.stat().st_size for p in cache.glob("*.tar"))
    assert held <= limit and not list(cache.glob("*.part"))


def test_two_fetches_at_once_make_room_for_both(s3, prepared, tmp_path, monkeypatch):
    """Two readers fetch two shards at once (two caches on one folder, as two processes): the second counts the first's
    fetch in progress (its ``.part``, at the size its name holds) and evicts for both. Each made room for its own shard
    alone, and a four-process run ended a shard over its limit."""
    url = s3.upload(prepared, "both")
    data = scan(Remote(url, cache_dir=str(tmp_path / "index")))
    urls, sizes, etags = data.shard_paths[:3], data.cache.sizes[:3], data.cache.etags[:3]
    limit = sum(sizes) - min(sizes)  # any two shards, not three
    first, second = ShardCache(tmp_path / "cache", limit), ShardCache(tmp_path / "cache", limit)
    first.ensure(data.store, urls[0], sizes[0], etags[0])  # in the cache, unused: the one to evict
    real, started, done = data.store.fs.get_file, threading.Event(), threading.Event()

    def get_file(rpath, lpath, *args, **kw):
        if rpath.endswith(os.path.basename(urls[1])):  # the first fetch waits until the second is done
            started.set()
            assert done.wait(60)
        return real(rpath, lpath, *args, **kw)

    monkeypatch.setattr(data.store.fs, "get_file", get_file)
    fetching = threading.Thread(target=first.ensure, args=(data.store, urls[1], sizes[1], etags[1]))
    fetching.start()
    assert started.wait(60)
    second.ensure(data.store, urls[2], sizes[2], etags[2])
    done.set()
    fetching.join(60)
    held = {p.name: p.stat().st_size for p in (tmp_path / "cache").glob("*.tar")}
    assert sum(held.values()) <= limit and len(held) == 2, held


def test_a_folder_left_over_its_limit_by_shards_in_use_is_trimmed_when_one_is_released(s3, prepared, tmp_path):
    """A fetch that cannot evict (the shards in its way are in use) leaves the folder over its limit; the folder stayed
    so after every reader was done (a 4-process run ended holding 4 shards in a 3-shard cache). The next release
    evicts again, and the folder is back within its limit."""
    url = s3.upload(prepared, "trim")
    data = scan(Remote(url, cache_dir=str(tmp_path / "index")))
    urls, sizes, etags = data.shard_paths[:2], data.cache.sizes[:2], data.cache.etags[:2]
    cache = ShardCache(tmp_path / "cache", max(sizes))  # room for one shard
    first = cache.pin(data.store, urls[0], sizes[0], etags[0])
    second = cache.pin(data.store, urls[1], sizes[1], etags[1])  # the first in use: both stay
    shards = lambda: sorted(p.name for p in (tmp_path / "cache").glob("*.tar"))
    assert len(shards()) == 2 and (tmp_path / "cache" / ".over-limit").exists()
    first.close()  # released, and the least recently used: evicted
    assert shards() == [ShardCache.name(urls[1], sizes[1], etags[1])]
    assert not (tmp_path / "cache" / ".over-limit").exists()
    assert second.read(0, sizes[1]) == (prepared / os.path.basename(urls[1])).read_bytes()
    second.close()
    assert len(shards()) == 1


def test_a_shard_another_process_reads_is_never_evicted_under_it(s3, prepared, tmp_path):
    url = s3.upload(prepared, "pinned")
    data = scan(Remote(url, cache_dir=str(tmp_path)))
    shard, size, etag = data.shard_paths[0], data.cache.sizes[0], data.cache.etags[0]
    expected = (prepared / "shard-000000.tar").read_bytes()
    reader = ShardCache(tmp_path, 1 << 30)
    with reader.pin(data.store, shard, size, etag) as pinned:
        evict = [sys.executable, "-c", "import sys; from gpupipe.sources.cache import ShardCache; "
                 "ShardCache(sys.argv[1], 0).evict(1 << 30)", str(tmp_path)]  # fmt: skip
        subprocess.run(evict, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
        assert pinned.read(0, size) == expected and pinned.path.exists()
    subprocess.run(evict, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert not pinned.path.exists() and not list(tmp_path.glob("*.sha256"))  # unpinned: evicted, digest and all
