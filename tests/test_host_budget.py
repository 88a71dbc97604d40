"""gpupipe/bench/host_budget.py: the training thread's CPU time per batch, with the GPU side on the meta device."""

import json

import numpy as np
import pytest

from gpupipe import cli
from gpupipe.bench.host_budget import jpeg_shape

from .common_utils import jpeg_bytes, photo


def test_the_stand_in_reads_a_jpeg_frame_header():
    data = jpeg_bytes(photo(np.random.default_rng(0), 37, 53), quality=90)
    assert jpeg_shape(memoryview(data)) == (37, 53)
    with pytest.raises(ValueError, match="no JPEG frame header"):
        jpeg_shape(b"\xff\xd8" + b"\x00" * 20)


def test_gpupipe_bench_host_budget_reports_every_path(folder, tmp_path):
    out = tmp_path / "hb.json"
    argv = ["bench", "--host-budget", "--data", str(folder), "--batch-size", "4", "--image-size", "16"]
    assert cli.main([*argv, "--workers", "0", "--backends", "pillow,nvjpeg", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["size"]) for r in rows} >= {("pillow", 16), ("nvjpeg", 32), ("policy: draw + pack", 16)}
    assert all(r["ms_per_batch"] > 0 and r["device"] in ("meta", "host") for r in rows)
    assert all(r["device_ops"] > 0 for r in rows if r["backend"].startswith("policy"))
    # the loader's own threads in the training process, beside: nvjpeg's decode thread; none for pillow's 0 workers
    threads = {(r["backend"], r["size"]): r.get("loader_thread_ms") for r in rows}
    assert threads[("nvjpeg", 16)] > 0 and threads[("pillow", 16)] == 0
