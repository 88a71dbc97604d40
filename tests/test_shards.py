"""Tar shards as a data set: WebDataset shards written by the webdataset library, their cached header index, clear
errors, and the loader contract (order per epoch, ranks, equal steps, exact resume) on prepared shards."""

import io
import json
import os
import shutil
import signal
import tarfile

import numpy as np
import pytest
import torch
from torchvision.datasets import ImageFolder

import gpupipe
from gpupipe.errors import DecodeError, GpupipeError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources import shards
from gpupipe.sources.open import open_source as scan

from .common_utils import (
    CPU_LOADER_BACKENDS,
    GPU_DECODERS,
    assert_resume_is_exact,
    decode_tolerance,
    photo,
    two_rank_epochs,
)

wds = pytest.importorskip("webdataset")
BACKENDS = CPU_LOADER_BACKENDS


def _encoded(seed: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    photo(np.random.default_rng(seed), 30 + seed % 7, 40).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def wds_shards(tmp_path_factory):
    """Two shards from ``webdataset.ShardWriter``: ``.jpg`` + ``.json`` labels, and one from ``TarWriter``:
    ``.png`` + ``.cls``. Label of sample ``i``: ``i % 5``."""
    d = tmp_path_factory.mktemp("wds")
    with wds.ShardWriter(str(d / "part-%02d.tar"), maxcount=6, verbose=0) as w:
        for i in range(10):
            w.write({"__key__": f"s{i:04d}", "jpg": _encoded(i), "json": {"label": i % 5, "caption": "x"}})
    with wds.TarWriter(str(d / "part-02.tar")) as w:
        for i in range(10, 14):
            w.write({"__key__": f"s{i:04d}", "png": _encoded(i, "PNG"), "cls": i % 5})
    return d


def test_webdataset_shards_load_with_their_labels(wds_shards):
    data = scan(str(wds_shards / "part-*.tar"))
    assert data.classes == ["0", "1", "2", "3", "4"]
    assert data.targets == [i % 5 for i in range(14)]
    assert data.samples[0] == ("part-00.tar:s0000.jpg", 0) and data.samples[-1] == ("part-02.tar:s0013.png", 3)
    assert data.sizes is None  # foreign shards record no sizes: decoders read them from the header
    with tarfile.open(wds_shards / "part-02.tar") as tf:
        assert data.read(12) == tf.extractfile("s0012.png").read()
    as_list = scan([wds_shards / "part-01.tar", wds_shards / "part-00.tar"])  # a list keeps its order
    assert as_list.targets == [i % 5 for i in (*range(6, 10), *range(6))]
    loader = gpupipe.build_loader(
        str(wds_shards / "part-*.tar"), "pillow", batch_size=4, train=False, image_size=24, num_workers=2, device="cpu"
    )
    assert torch.cat([y for _, y in loader]).tolist() == data.targets


def test_local_shards_take_webdatasets_brace_notation(wds_shards):
    """``part-{00..01}.tar`` names the same shards as the list, as braces do at a URL; a shard the braces name that is
    not there is named."""
    braces = scan(str(wds_shards / "part-{00..01}.tar"))
    assert braces.samples == scan([wds_shards / "part-00.tar", wds_shards / "part-01.tar"]).samples
    assert scan(str(wds_shards / "part-{02,00}.tar")).targets == [i % 5 for i in (*range(10, 14), *range(6))]
    with pytest.raises(gpupipe.MissingFileError, match=r"part-03.tar: no such shard"):
        scan(str(wds_shards / "part-{00..03}.tar"))


def test_class_names_from_json(tmp_path):
    with wds.TarWriter(str(tmp_path / "a.tar")) as w:
        for i, name in enumerate(["dog", "cat", "dog"]):
            w.write({"__key__": f"k{i}", "jpeg": _encoded(i), "json": {"cls": name}})
    data = scan(tmp_path / "a.tar")
    assert data.classes == ["cat", "dog"] and data.targets == [1, 0, 1]


def test_the_header_index_is_cached_and_rebuilt_when_the_shard_changes(wds_shards, monkeypatch):
    path = str(wds_shards / "part-00.tar")
    first = shards.shard_index(path)
    assert os.path.exists(path + ".gpupipe-index.npz")
    monkeypatch.setattr(shards, "index_tar", lambda p: pytest.fail("the cached index was not used"))
    assert all(np.array_equal(first[k], v) for k, v in shards.shard_index(path).items())
    monkeypatch.undo()
    os.utime(path, ns=(0, 0))  # a shard written again must be indexed again
    calls = []
    monkeypatch.setattr(shards, "index_tar", lambda p: calls.append(p) or first)
    shards.shard_index(path)
    assert calls == [path]
    shutil.copy2(path, path + ".new")  # cp -p: the same size and modification time, another file
    os.replace(path + ".new", path)
    shards.shard_index(path)
    assert calls == [path, path]


def test_an_unwritable_shard_folder_caches_the_index_in_the_user_cache(wds_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # root writes anywhere: pretend it cannot
    shards.shard_index(str(wds_shards / "part-01.tar"))
    assert [p.name[17:] for p in (tmp_path / "cache" / "gpupipe" / "shard-index").iterdir()] == [
        "part-01.tar.gpupipe-index.npz"
    ]


def _tar(path, members: dict[str, bytes] | list[tuple[str, bytes]]):
    with tarfile.open(path, "w") as tf:
        for name, data in members.items() if isinstance(members, dict) else members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"a.jpg": b"x", "b.jpg": b"x", "b.cls": b"1"}, r"key 'a' has no label"),
        (
            {"a.jpg": b"x", "a.png": b"x", "a.cls": b"1"},
            r"key 'a' has two images \(a.jpg and a.png\): mixed extensions",
        ),
        ({"a.jpg": b"x", "a.json": json.dumps({"caption": "x"}).encode()}, r"a.json: no label field"),
        ({"a.jpg": b"x", "a.cls": b"dog"}, r"a.cls: a .cls member must hold an integer"),
        ({"a.jpg": b"x", "a.cls": b"1_0"}, r"a.cls: a .cls member must hold an integer label, got b'1_0'"),
        ({"a.jpg": b"x", "a.cls": "\u0663".encode()}, r"a.cls: a .cls member must hold an integer"),
        ([("a.jpg", b"x"), ("a.cls", b"1"), ("a.cls", b"2")], r"key 'a' has two .cls members \(a.cls and a.cls\)"),
        ({"a.txt": b"x"}, r"no samples"),
        ({"a.jpg": b"x", "a.cls": b"1" * 30}, r"a.cls: label 1{12}\.\.\.\(30 characters\) would make more than"),
        ({"a.jpg": b"x", "a.cls": b"-" + b"1" * 30}, r"a.cls: label -1{11}\.\.\.\(31 characters\) must be >= 0"),
        ({"a.jpg": b"x", "a.json": b'{"label": 1000000000000000000000000000000}'}, r"a.json: label 1\d+.* more than"),
        ({"a.jpg": b"x", "a.json": b'{"label": -1000000000000000000000000000000}'}, r"a.json: label -1.* >= 0"),
    ],
)
def test_unusable_shards_are_named_with_their_key(tmp_path, members, message):
    path = _tar(tmp_path / "bad.tar", members)
    with pytest.raises(GpupipeError, match=message) as e:
        scan(path)
    assert str(path) in str(e.value)


def test_a_negative_member_size_is_named_not_an_overflow(tmp_path):
    """A base-256 size field tarfile reads as -256: the shard and member named, as every malformed shard is."""
    path = _tar(tmp_path / "bad.tar", [("a.cls", b"1"), ("a.jpg", b"x")])
    data = bytearray(path.read_bytes())
    header = data[1024:1536]  # a.jpg's
    header[124:136] = b"\xff" * 11 + b"\x00"  # the size field, base-256: -256
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\x00 " % sum(header)  # the header's checksum
    data[1024:1536] = header
    path.write_bytes(bytes(data))
    with pytest.raises(gpupipe.SourceError, match=rf"{path}: a.jpg: the tar header gives a negative size \(-256\)"):
        scan(path)


def test_a_compressed_shard_is_refused(tmp_path):
    import gzip

    (tmp_path / "x.tar").write_bytes(gzip.compress(_tar(tmp_path / "y.tar", {"a.jpg": b"x"}).read_bytes()))
    with pytest.raises(GpupipeError, match=r"x\.tar: not an uncompressed tar"):
        scan(tmp_path / "x.tar")


def test_a_compressed_or_cut_shard_alone_is_named_as_such(tmp_path):
    """The probe: ``x.tar.gz`` alone was "expected an ImageFolder directory or a .csv file list", and a plain tar cut
    short "not an uncompressed tar file"."""
    import gzip

    whole = _tar(tmp_path / "y.tar", {"a.jpg": b"x" * 4000, "a.cls": b"1"}).read_bytes()
    (tmp_path / "x.tar.gz").write_bytes(gzip.compress(whole))
    with pytest.raises(GpupipeError, match=r"x\.tar\.gz: a compressed tar file: shards are read uncompressed"):
        scan(tmp_path / "x.tar.gz")
    (tmp_path / "cut.tar").write_bytes(whole[:2000])
    with pytest.raises(GpupipeError, match=r"cut\.tar: a tar file cut short \(truncated, or still being written\)"):
        scan(tmp_path / "cut.tar")


def test_a_folder_of_webdataset_shards_reads_as_its_tar_files(wds_shards, tmp_path):
    """The probe: a folder holding shards that ``gpupipe prepare`` did not write was refused as an ImageFolder with no
    class folder, where the docs read tar shards from a folder."""
    got, want = scan(wds_shards), scan(str(wds_shards / "part-*.tar"))
    assert got.samples == want.samples and got.targets == [i % 5 for i in range(14)]
    assert gpupipe.build_loader(wds_shards, "pillow", batch_size=2, image_size=16, device="cpu").dataset is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_folder_of_shards_delivers_what_its_glob_does_resumes_and_splits_over_ranks(wds_shards, backend):
    """The folder form on every backend, with the default workers: the same batches as the glob of its tar files,
    to the bit, over two epochs; a resume mid-epoch delivers the rest of the epoch; two ranks split it as they split
    the glob."""
    kw = dict(batch_size=3, train=True, image_size=24, device="cpu", seed=3, drop_last=False)
    folder, glob = str(wds_shards), str(wds_shards / "part-*.tar")
    a, b = gpupipe.build_loader(folder, backend, **kw), gpupipe.build_loader(glob, backend, **kw)
    for epoch in range(2):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        got, want = list(a), list(b)
        assert len(got) == len(want) == 5
        for (x, y), (ex, ey) in zip(got, want, strict=True):
            assert torch.equal(x, ex) and torch.equal(y, ey)
    assert_resume_is_exact(lambda: gpupipe.build_loader(folder, backend, **kw), 1, 2)
    assert two_rank_epochs(folder, backend) == two_rank_epochs(glob, backend)


@pytest.fixture(scope="module")
def unique_prepared(unique_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("unique") / "out"
    prepare(unique_folder, out, PrepareOptions(shard_size=8 * 1024))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_epochs_follow_the_folders_order_on_shards(unique_folder, unique_prepared, backend):
    kw = dict(
        batch_size=4, train=True, image_size=24, num_workers=2, drop_last=False, device="cpu", seed=3, normalize=False
    )
    on_shards, on_files = (
        gpupipe.build_loader(unique_prepared, backend, **kw),
        gpupipe.build_loader(unique_folder, backend, **kw),
    )
    orders = []
    for epoch in range(3):
        on_shards.set_epoch(epoch)
        on_files.set_epoch(epoch)
        a, b = list(on_shards), list(on_files)
        orders.append(torch.cat([y for _, y in a]).tolist())
        assert orders[-1] == torch.cat([y for _, y in b]).tolist()
        if backend != "dali":  # the same crops from the same bytes (DALI draws its own)
            assert torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in b]))
    assert all(sorted(o) == list(range(13)) for o in orders) and len({tuple(o) for o in orders}) == 3


@pytest.mark.parametrize("backend", [*BACKENDS, "synthetic"])
def test_ranks_take_equal_steps_and_cover_the_shards(unique_prepared, backend):
    steps, seen = two_rank_epochs(unique_prepared, backend)
    assert steps[0] == steps[1] and seen[0] | seen[1] == set(range(13)) and len(seen[0] & seen[1]) <= 1


def test_resume_mid_epoch_on_shards(unique_prepared):
    kw = dict(batch_size=3, train=True, image_size=24, num_workers=1, normalize=False, device="cpu", seed=5)
    assert_resume_is_exact(lambda: gpupipe.build_loader(unique_prepared, "pillow", **kw), epoch=2, batch=2)


def test_a_truncated_shard_names_itself(unique_prepared, tmp_path):
    import shutil

    out = shutil.copytree(unique_prepared, tmp_path / "copy")
    last = sorted(out.glob("*.tar"))[-1]
    last.write_bytes(last.read_bytes()[:600])
    loader = gpupipe.build_loader(out, "pillow", batch_size=13, train=False, image_size=24, num_workers=0, device="cpu")
    with pytest.raises(DecodeError, match=f"{last.name}.*truncated"):
        list(loader)


def test_samples_are_a_lazy_sequence_equal_to_a_list(unique_folder, unique_prepared):
    data = scan(unique_prepared)
    listed = list(data.samples)
    assert data.samples == listed and data.samples[-1] == listed[-1] and data.samples[2:4] == listed[2:4]
    assert [label for _, label in listed] == ImageFolder(str(unique_folder)).targets
    with pytest.raises(IndexError):
        data.samples[len(listed)]
    assert np.asarray(data.sizes).tolist() == [list(hw) for hw in data.sizes]


def test_a_large_index_loads_without_opening_shards(unique_prepared, tmp_path):
    """100,000 samples (all pointing at one real image): the loader starts from the index alone. Timings are in
    bench/shards.py, not here."""
    n = 100_000
    out = tmp_path / "big"
    out.mkdir()
    meta = json.loads((unique_prepared / "gpupipe.json").read_text())
    (out / meta["shards"][0]).symlink_to(unique_prepared / meta["shards"][0])
    with np.load(unique_prepared / "index.npz") as z:
        one = {k: z[k][:1] for k in z.files}
    big = {k: np.repeat(v, n) for k, v in one.items()}
    big["label"] = np.arange(n, dtype=np.int64) % 1000
    np.savez(out / "index.npz", **big)
    meta.update(samples=n, shards=meta["shards"][:1], classes=[str(i) for i in range(1000)])
    (out / "gpupipe.json").write_text(json.dumps(meta))
    loader = gpupipe.build_loader(out, "pillow", batch_size=64, train=True, image_size=24, num_workers=0, device="cpu")
    assert len(loader.dataset) == n and len(loader) == n // 64
    assert loader.dataset.sizes[n - 1] == (int(one["height"][0]), int(one["width"][0]))
    x, y = next(iter(loader))
    assert x.shape == (64, 3, 24, 24) and y.max() < 1000


def test_shards_are_read_with_pread_where_mmap_is_refused(unique_prepared, monkeypatch):
    data = scan(unique_prepared)
    expected = [data.read(i) for i in range(len(data))]

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what a direct-I/O FUSE mount answers

    monkeypatch.setattr(shards.mmap, "mmap", refuse)
    again = scan(unique_prepared)
    assert [again.read(i) for i in range(len(again))] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_DECODERS)
def test_gpu_backends_read_shards(unique_folder, unique_prepared, backend):
    def run(root, b, device):
        loader = gpupipe.build_loader(
            root, b, batch_size=4, train=False, image_size=32, num_workers=1, normalize=False, device=device
        )
        batches = list(loader)
        return torch.cat([x.cpu() for x, _ in batches]).float(), torch.cat([y.cpu() for _, y in batches])

    x, y = run(unique_prepared, backend, "cuda")
    ref_x, ref_y = run(unique_folder, "pillow", "cpu")
    assert torch.equal(y, ref_y) and (x - ref_x).abs().mean() <= decode_tolerance("cuda", 1.0)


@pytest.mark.parametrize("source", ["webdataset", "folder"])
def test_dali_reads_no_sample_before_training_and_only_what_it_schedules(wds_shards, folder, source, monkeypatch):
    """No up-front scan (issue 21): building the loader reads no sample's bytes, and the first batch reads its own
    samples and the few scheduled ahead, not the data set (headers are judged from the bytes the feed holds). From a
    folder, DALI reads the files itself: Python reads none (their headers are judged as their batches come)."""
    pytest.importorskip("nvidia.dali")
    from gpupipe.backends.dali import _PREFETCH
    from gpupipe.sources.scan import ImageList

    reads: list[tuple] = []  # (image list, index): another test's loader may still be reading ahead on its threads
    for cls in (ImageList, shards.ShardImageList):
        read = cls.read
        monkeypatch.setattr(cls, "read", lambda self, i, read=read: reads.append((self, i)) or read(self, i))
    root = str(wds_shards / "part-*.tar") if source == "webdataset" else folder
    loader = gpupipe.build_loader(root, "dali", batch_size=1, image_size=16, device="cpu", num_workers=0)

    def own() -> list[int]:
        return [i for data, i in reads if data is loader.dataset]

    assert own() == [] and len(loader.dataset) >= 12
    images, _ = next(iter(loader))
    assert images.shape[0] == 1
    if source == "folder":
        assert own() == []
    else:  # this batch, the two the loader's thread makes ahead (one queued, one waiting) and those DALI has scheduled
        assert 1 <= len(own()) <= 3 + _PREFETCH < len(loader.dataset)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own


def test_many_shards_stay_within_the_open_file_limit_and_name_it_when_out(tmp_path):
    """240 shards under ``ulimit -n 128`` (2 workers) lost a worker: each shard map holds a file descriptor, and 256 of
    them were kept. Now a quarter of the limit, least recently used first to go; and a process out of files says so,
    with ``on_error="skip"`` too (it is no bad sample)."""
    import resource

    buf = io.BytesIO()
    photo(np.random.default_rng(0), 16, 16).save(buf, "JPEG")
    jpeg = buf.getvalue()
    for i in range(120):
        _tar(tmp_path / f"s{i:03d}.tar", {"a.jpg": jpeg, "a.cls": b"0"})
    data, fresh = scan(str(tmp_path / "*.tar")), scan(str(tmp_path / "*.tar"))
    loader = gpupipe.build_loader(
        str(tmp_path / "*.tar"), "pillow", batch_size=4, image_size=16, num_workers=0, device="cpu", on_error="skip"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        # room for 60 more (120 maps did not fit), and for the quarter of the limit the maps may take when earlier
        # tests left files open (the limit is on descriptor numbers: counted from the highest in use)
        used = max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
        limit = max(used + 60, used * 4 // 3 + 8)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        assert all(data.read(i) == jpeg for i in range(len(data)))
        assert 1 <= len(data._maps) <= limit // 4
        lowest_free = os.dup(0)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # not one more (the limit is on numbers)
        with pytest.raises(OSError, match=r"Too many open files \(.*ulimit -n is \d+\)"):
            fresh.read(0)
        with pytest.raises(GpupipeError, match=r"s\d+\.tar:a\.jpg: .*Too many open files.*raise the limit"):
            next(iter(loader))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _index_dying_in_a_worker(path: str) -> dict[str, np.ndarray]:
    if os.environ["GPUPIPE_TEST_PARENT"] != str(os.getpid()) and path.endswith("1.tar"):
        os.kill(os.getpid(), signal.SIGKILL)
    n = int(path[-5])
    return {"member": np.array([f"{n}.jpg"]), "offset": np.array([n]), "size": np.array([1]), "label": np.array([n])}


def test_a_header_index_worker_that_dies_leaves_the_shards_walked_here(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUPIPE_TEST_PARENT", str(os.getpid()))
    monkeypatch.setattr(shards, "usable_cores", lambda: 2)
    paths = [str(tmp_path / f"s{i}.tar") for i in range(4)]
    for p in paths:
        open(p, "wb").close()
    parts = shards.index_all(paths, _index_dying_in_a_worker)
    assert [int(p["label"][0]) for p in parts] == [0, 1, 2, 3]
