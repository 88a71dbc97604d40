"""gpupipe/sources/parquet.py: Parquet files in the Hugging Face Hub's layout read by every backend as the same
images written as an ImageFolder (labels, order, crops, resume, ranks), by path, glob, folder or list; class names
from the schema's metadata; a bad row named by its file and row."""

import json
import os
import warnings

import numpy as np
import pytest
import torch

from gpupipe.errors import DecodeError, StorageError
from gpupipe.sources.open import open_source

from .common_utils import S3Server, assert_resume_is_exact, encoded, photo
from .test_dataset import BACKENDS, _batches, _same, on_two_ranks

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CLASSES = ["cat", "dog", "owl"]


def _hub_table(cells, labels, names=CLASSES):
    """A table as the ``datasets`` library writes one: ``{bytes, path}`` image structs, a ClassLabel's names."""
    image = pa.array(cells, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return pa.table({"image": image, "label": pa.array(labels, pa.int64())}).replace_schema_metadata(meta)


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Eleven PNGs (several sizes and modes) as an ImageFolder and as two Parquet files of row groups of 3, the rows
    in the folder's order."""
    root = tmp_path_factory.mktemp("sets")
    rng = np.random.default_rng(9)
    folder = root / "folder"
    for i in range(11):
        img = photo(rng, 26 + 5 * i, 44 - 2 * i)
        img = img.convert("L") if i % 4 == 1 else img.convert("RGBA") if i % 4 == 2 else img
        (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        img.save(folder / f"c{i % 3}" / f"{i:02d}.png")
    samples = open_source(folder).samples
    cells = [{"bytes": open(p, "rb").read(), "path": p.rsplit("/", 1)[1]} for p, _ in samples]
    labels = [label for _, label in samples]
    (root / "hub").mkdir()
    for k, part in enumerate((slice(0, 7), slice(7, None))):
        pq.write_table(_hub_table(cells[part], labels[part]), root / "hub" / f"train-{k:05d}.parquet", row_group_size=3)
    return folder, root / "hub"


@pytest.mark.parametrize("backend", BACKENDS)
def test_parquet_reads_as_the_same_images_in_a_folder(sets, backend):
    folder, hub = sets
    exact = backend in ("pillow", "nvjpeg")  # PNGs: Pillow decodes them for both
    for train in (True, False):
        _same(_batches(hub, backend, train=train), _batches(folder, backend, train=train), exact)


def test_a_path_a_glob_a_folder_and_a_list_name_the_same_rows_and_class_names(sets):
    _, hub = sets
    files = sorted(str(p) for p in hub.glob("*.parquet"))
    listed = open_source(hub)
    assert listed.classes == CLASSES and len(listed) == 11
    assert listed.samples[8] == (f"{files[1]} row 1", listed.targets[8])
    for other in (str(hub / "*.parquet"), files):
        assert open_source(other).samples == listed.samples
    assert len(open_source(files[1])) == 4


def test_parquet_resumes_mid_epoch_and_reads_its_rank_as_the_folder(sets):
    folder, hub = sets
    kw = dict(batch_size=2, train=True, drop_last=False)
    loader = _batches(hub, "pillow", **kw)
    loader.set_epoch(2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = list(it)
    resumed = _batches(hub, "pillow", **kw)
    resumed.load_state_dict(state)
    _same(resumed, rest, exact=True)
    for rank in (0, 1):
        _same(
            _batches(hub, "pillow", rank=rank, world_size=2), _batches(folder, "pillow", rank=rank, world_size=2), True
        )


@pytest.mark.parametrize("backend", ["pillow", "nvjpeg"])
def test_a_bad_row_is_named_by_its_file_and_row_and_skipped(tmp_path, backend):
    good = encoded(photo(np.random.default_rng(0), 30, 30), "PNG")
    cells = [{"bytes": good, "path": None}] * 2 + [{"bytes": b"junk", "path": None}, {"bytes": None, "path": None}]
    path = tmp_path / "part-0003.parquet"
    pq.write_table(_hub_table(cells, [0, 1, 0, 1]), path)
    with pytest.raises(DecodeError, match=rf"^{path} row 2: cannot decode"):
        list(_batches(path, backend, train=False))
    loader = _batches(path, backend, train=False, on_error="skip")
    assert sum(len(y) for _, y in loader) == 2
    assert loader.skipped[1] == (f"{path} row 3", "the image cell holds neither bytes nor a path")


def test_a_file_that_is_not_parquet_or_lacks_a_label_column_is_one_line(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"x.parquet: cannot read it as Parquet"):
        open_source(tmp_path / "x.parquet")
    pq.write_table(pa.table({"image": pa.array([b"a"])}), tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y.parquet: columns image; expected an image column .* and a label column"):
        open_source(tmp_path / "y.parquet")


def test_prepare_converts_parquet_to_shards_of_the_same_samples(sets, tmp_path):
    from gpupipe.prepare import prepare

    _, hub = sets
    prepare(hub, tmp_path / "shards")
    shards, rows = open_source(tmp_path / "shards"), open_source(hub)
    assert shards.targets == rows.targets and shards.classes == CLASSES


def test_two_gloo_ranks_read_parquet_as_each_reads_the_folder(sets):
    folder, hub = sets
    for rank, got in on_two_ranks(hub).items():
        _same(got, _batches(folder, "pillow", train=True, rank=rank, world_size=2), exact=True)


@pytest.mark.parametrize("backend", ["pillow", "turbojpeg", "dali"])
def test_parquet_reads_as_the_folder_with_the_default_two_workers(sets, backend):
    """Parquet row groups read in the DataLoader or feed workers (``num_workers=2``, a user's default here)."""
    folder, hub = sets
    for train in (True, False):
        _same(
            _batches(hub, backend, train=train, num_workers=2),
            _batches(folder, backend, train=train, num_workers=2),
            exact=backend == "pillow",
        )


# -- shuffle_window: row groups, file after file --------------------------------------------------------------------


def test_a_shuffle_window_reads_row_groups_file_after_file_and_resumes_exactly(sets):
    """``shuffle_window=2``: each window is two row groups (of one file or two), the loader delivers the sampler's
    order, the same for the same seed, and a loader resumed mid-epoch delivers exactly the rest."""
    _, hub = sets
    kw = dict(batch_size=2, train=True, drop_last=False, shuffle_window=2)
    loader = _batches(hub, "pillow", **kw)
    data, sampler = loader.dataset, loader.sampler
    assert data.shard_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4] and data.shard_files.tolist() == [0, 0, 0, 1, 1]
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        order = sampler.rank_indices(epoch)
        assert torch.cat([y for _, y in loader]).tolist() == [data.targets[i] for i in order]
        windows = [set(data.shard_of[order[j : j + 4]].tolist()) for j in range(0, 8, 4)]  # groups of 3 rows but one
        assert all(len(w) <= 3 for w in windows)
    assert sampler.order(0) != sampler.order(1)
    assert _batches(hub, "pillow", **kw).sampler.order(1) == sampler.order(1)
    assert_resume_is_exact(lambda: _batches(hub, "pillow", **kw), epoch=1, batch=2)
    ranks = [_batches(hub, "pillow", rank=r, world_size=2, **kw).sampler.rank_indices(0) for r in (0, 1)]
    assert ranks[0] + ranks[1] == (sampler.order(0) * 2)[:12]  # each rank a contiguous part (11 rows, one padded)


# -- on object storage: the tests' S3 server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_url(s3, sets):
    return s3.upload(sets[1], "parquet")


@pytest.mark.parametrize("backend", ["pillow", "dali"])
def test_parquet_on_s3_reads_as_the_same_images_in_a_folder(sets, hub_url, backend):
    """A folder at a URL, a glob and a list of URLs: the folder's labels, order and crops."""
    folder, _ = sets
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    urls = [f"{hub_url}/train-00000.parquet", f"{hub_url}/train-00001.parquet"]
    assert open_source(hub_url).samples == open_source(f"{hub_url}/*.parquet").samples == open_source(urls).samples
    assert open_source(hub_url).classes == CLASSES
    for train in (True, False) if backend == "pillow" else (False,):
        _same(_batches(hub_url, backend, train=train), _batches(folder, backend, train=train), backend == "pillow")


def test_parquet_on_s3_is_fetched_once_per_node_for_two_ranks_of_two_workers(s3, sets, tmp_path):
    """Two ranks of this node (one cache folder), two workers each, two epochs with a shuffle window: each object is
    asked of the server once, whole (the index is read from that copy too), and the ranks read the folder's rows."""
    from gpupipe import Remote

    from .common_utils import CountingProxy

    _, hub = sets
    url = s3.upload(hub, "parquet-node")
    proxy = CountingProxy(s3.endpoint)
    try:
        source = Remote(url, storage_options={"endpoint_url": proxy.endpoint}, cache_dir=str(tmp_path))
        kw = dict(batch_size=2, train=True, shuffle_window=2, num_workers=2, world_size=2)
        loaders = [_batches(source, "pillow", rank=r, **kw) for r in (0, 1)]
        for epoch in (0, 1):
            for r, loader in enumerate(loaders):
                loader.set_epoch(epoch)
                local = _batches(hub, "pillow", rank=r, **kw)
                local.set_epoch(epoch)
                _same(loader, local, exact=True)
        gets = proxy.gets(f"/{S3Server.BUCKET}/parquet-node/")
    finally:
        proxy.stop()
    assert gets == {f"/{S3Server.BUCKET}/parquet-node/train-0000{k}.parquet": 1 for k in (0, 1)}, proxy.log
    assert loaders[0].dataset.cached and len(list(tmp_path.glob("*.parquet"))) == 2


def test_parquet_without_the_node_cache_reads_row_groups_by_range(hub_url, sets):
    from gpupipe import Remote

    folder, _ = sets
    data = open_source(Remote(hub_url, cache_limit=0))
    assert data.cache is None and not data.cached
    _same(_batches(data.root, "pillow", train=False), _batches(folder, "pillow", train=False), exact=True)
    assert [data.read(i) for i in range(len(data))] == [open_source(folder).read(i) for i in range(len(data))]


def test_a_missing_parquet_object_or_bucket_is_named_in_one_line(s3, sets):
    _, hub = sets
    url = s3.upload(hub, "parquet-missing")
    with pytest.raises(StorageError, match=r"^s3://gpupipe-test/parquet-missing/nope\.parquet: no such object"):
        open_source([f"{url}/train-00000.parquet", f"{url}/nope.parquet"])
    with pytest.raises(StorageError, match=r"no such bucket 'no-such-bucket-here'"):
        open_source("s3://no-such-bucket-here/train/part-0.parquet")
    with pytest.raises(StorageError, match=r"parquet-nowhere/\*\.parquet: no object matches"):
        open_source(f"s3://{S3Server.BUCKET}/parquet-nowhere/*.parquet")
    with pytest.raises(StorageError, match=r"parquet-nowhere: neither a folder written by .* nor \.parquet files$"):
        open_source(f"s3://{S3Server.BUCKET}/parquet-nowhere")


def test_a_global_shuffle_over_more_row_groups_than_are_kept_is_a_warning_with_the_fix(sets):
    """Parquet has no access to one row: a shuffled epoch over more row groups than a reader keeps reads a group for
    nearly every sample, said once at the build with the fix; a shuffle window, or an eval pass, says nothing."""
    _, hub = sets
    with pytest.warns(UserWarning, match=r"5 Parquet row groups .* shuffle_window=K") as said:
        _batches(hub, "pillow", batch_size=2, train=True)
    assert said[0].filename.startswith(os.path.dirname(__file__))  # the caller's build_loader line, not gpupipe's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _batches(hub, "pillow", batch_size=2, train=True, shuffle_window=2)
        _batches(hub, "pillow", batch_size=2, train=False)


def test_a_local_file_is_opened_once_per_process_and_reopened_after_a_fork(sets, monkeypatch):
    """Each row group of a file read from one open of it (its footer read once, its column chunks mapped), and a
    forked child opens its own."""
    _, hub = sets
    opened = []
    real = pq.ParquetFile

    def counted(source, *args, **kwargs):
        opened.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", counted)
    listed = open_source(sorted(str(p) for p in hub.glob("*.parquet"))[0])  # 7 rows, groups of 3
    assert len(opened) == 1  # its index, read at the open
    expected = [listed.read(i) for i in range(len(listed))]
    assert len(opened) == 2  # three groups, one open
    listed._groups.clear()
    pid = os.fork()
    if pid == 0:  # the child: its own open, the same bytes
        ok = [listed.read(i) for i in range(len(listed))] == expected and len(opened) == 3
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
