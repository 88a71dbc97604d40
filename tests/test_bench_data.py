"""``gpupipe bench`` on the data a user has: a folder ``gpupipe prepare`` wrote, a folder with an unreadable file;
and how long ``--seconds`` makes a run, against the time left it announces."""

import json
import re
import time

import pytest

import gpupipe
from gpupipe.prepare import prepare

from .common_utils import gpupipe_cli, make_folder

CPU_BACKENDS = [b for b in ("pillow", "turbojpeg", "dali") if b in gpupipe.available_backends()]


def _bench(data, tmp_path, *extra):
    return gpupipe_cli(
        "bench",
        "--data",
        data,
        "--device",
        "cpu",
        "--workers",
        0,
        "--batch-size",
        4,
        "--image-size",
        32,
        "--repeats",
        1,
        *extra,
        env={"GPUPIPE_CACHE": str(tmp_path / "cache")},
    )


@pytest.mark.slow
def test_bench_measures_a_prepared_folder_on_every_backend(tmp_path):
    src = make_folder(tmp_path / "src", 2, 4)
    prepare(str(src), str(tmp_path / "shards"), workers=0)
    j = tmp_path / "b.json"
    r = _bench(tmp_path / "shards", tmp_path, "--backends", ",".join(CPU_BACKENDS), "--seconds", 0.2, "--json", j)
    assert r.returncode == 0, r.stderr  # was: No such file or directory: 'shard-000000.tar:00000000.jpg'
    got = {(x["backend"], x["pipeline"]) for x in json.loads(j.read_text())["results"]}
    for b in ["baseline", *CPU_BACKENDS]:
        assert (b, "train") in got and (b, "eval") in got
    assert all(x["megapixels_per_s"] > 0 for x in json.loads(j.read_text())["results"])


@pytest.mark.slow
def test_bench_on_a_folder_with_an_unreadable_file_measures_and_names_it(tmp_path):
    root = make_folder(tmp_path / "data", 2, 3)
    (root / "c00" / "000.jpg").write_bytes(b"not an image")  # the first file: also in the size estimate
    r = _bench(root, tmp_path, "--backends", "pillow", "--pipelines", "decode,eval", "--seconds", 0.2)
    assert r.returncode == 0, r.stderr  # was: a PIL.UnidentifiedImageError traceback
    assert "Traceback" not in r.stderr
    assert "1 unreadable file(s) left out of the measurements" in r.stderr and "000.jpg" in r.stderr
    assert "gpupipe check" in r.stderr
