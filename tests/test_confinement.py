"""Reading and writing only where gpupipe should: index caches beside shards created exclusively (no planted link
followed), prepared folders that name only shards inside themselves."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import gpupipe
from gpupipe.errors import GpupipeError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources import shards
from gpupipe.sources.open import open_source as scan

from .test_shards import _tar


@pytest.fixture()
def foreign_tar(tmp_path, base):
    import io

    buf = io.BytesIO()
    base.save(buf, "JPEG")
    path = tmp_path / "shards" / "x.tar"
    path.parent.mkdir()
    _tar(path, {"a.jpg": buf.getvalue(), "a.cls": b"0", "b.jpg": buf.getvalue(), "b.cls": b"1"})
    return path


def test_planted_links_at_the_index_caches_names_are_not_written_through(foreign_tar, tmp_path):
    """The probe's attack: links at the cache's temp names (the old one was ``.x.tar.gpupipe-index.npz.<pid>.tmp``)
    and at the cache itself, pointing at another file. The index is written to an unpredictable temp file and renamed
    over the link; the other file is untouched, and a link at the cache's name is never read as an index."""
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    folder = foreign_tar.parent
    for pid in range(os.getpid() - 50, os.getpid() + 50):  # this process and its neighbours
        (folder / f".x.tar.gpupipe-index.npz.{pid}.tmp").symlink_to(victim)
    cache = folder / "x.tar.gpupipe-index.npz"
    cache.symlink_to(victim)
    data = scan(foreign_tar)
    assert data.targets == [0, 1]
    assert victim.read_text() == "user data"
    assert cache.is_file() and not cache.is_symlink()  # the link was replaced by the real index
    assert scan(foreign_tar).targets == [0, 1]  # and that index is read back
    leftovers = [p.name for p in folder.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert leftovers == []


def test_a_link_at_the_cache_name_to_a_forged_index_is_not_read(foreign_tar, tmp_path):
    index = shards.index_tar(str(foreign_tar))
    st = os.stat(foreign_tar)
    forged = tmp_path / "forged.npz"
    stamp = [shards._INDEX_VERSION, st.st_size, st.st_mtime_ns]
    shards._save_npz(forged, stamp=np.array(stamp), **{**index, "label": index["label"] * 0 + 7})
    (foreign_tar.parent / "x.tar.gpupipe-index.npz").symlink_to(forged)
    assert scan(foreign_tar).targets == [0, 1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from .common_utils import make_folder

    root = tmp_path_factory.mktemp("conf")
    src = make_folder(root / "src", 2, 3)
    prepare(src, root / "prep", PrepareOptions(), workers=1)
    return root / "prep"


def _edited(prepared, tmp_path, shard_name) -> str:
    out = tmp_path / "prep"
    shutil.copytree(prepared, out)
    meta = json.loads((out / "gpupipe.json").read_text())
    meta["shards"] = [shard_name(out)]
    (out / "gpupipe.json").write_text(json.dumps(meta))
    return str(out)


@pytest.mark.parametrize(
    "shard_name",
    [
        lambda out: str(out.parent / "private.tar"),  # an absolute path elsewhere (the probe's /srv/other/...)
        lambda out: "../private.tar",
    ],
    ids=["absolute", "dotdot"],
)
def test_a_prepared_folder_may_name_only_shards_inside_itself(prepared, tmp_path, shard_name):
    shutil.copy(prepared / "shard-000000.tar", tmp_path / "private.tar")  # a readable tar elsewhere
    out = _edited(prepared, tmp_path, shard_name)
    with pytest.raises(GpupipeError) as e:
        gpupipe.build_loader(out, "pillow", batch_size=2, train=False, image_size=16, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{out}/gpupipe.json: shard ") and "lies outside" in msg
    assert "allow_outside_root=True" in msg
    loader = gpupipe.build_loader(
        out, "pillow", batch_size=2, train=False, image_size=16, device="cpu", allow_outside_root=True
    )
    assert sum(len(y) for _, y in loader) == 6  # trusted: read as before
