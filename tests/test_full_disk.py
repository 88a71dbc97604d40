"""A full disk during ``prepare``: one line naming the file and the cause, the complete shards kept, and the same
command resumes once there is room (a real tmpfs where the test can mount one, else RLIMIT_FSIZE)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from .common_utils import REPO_ROOT, make_folder
from .test_train_checkpoint import small_disk


@pytest.mark.slow
def test_prepare_on_a_full_disk_is_one_line_and_resumes(tmp_path):
    src = make_folder(tmp_path / "src", 3, 12)  # about 200 KB of JPEGs
    with small_disk(tmp_path, 96 << 10) as (disk, limit):
        if limit is not None:  # the stand-in limits each file: one below a shard's size fills the "disk" at once
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (30 << 10, 30 << 10))
        out = disk / "prep"
        cmd = [sys.executable, "-m", "gpupipe", "prepare", str(src), str(out), "--workers", "1"]
        cmd += ["--shard-size", "40KB"]
        env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
        r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, env=env, timeout=300)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"error: {out}/") and "cannot write it (" in lines[0]
        assert "No space left on device" in lines[0] or "File too large" in lines[0]
        assert "the complete shards are kept: run the same command again to resume" in lines[0]
        kept = sorted(p.name for p in out.glob("shard-*.tar"))
        assert kept or limit is not None  # on the tmpfs, some shards made it before the disk filled
        if limit is None:
            subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # room again
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert ("resumed at sample" in r.stdout or not kept) and "36 samples" in r.stdout
