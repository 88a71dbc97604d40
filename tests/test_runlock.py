"""One run per output folder (_runlock): real processes hold it, are killed, and a second one is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpupipe._runlock import LOCK_NAME, FolderInUseError, RunLock
from gpupipe.errors import GpupipeError

from .common_utils import REPO_ROOT

_HOLD = """
import sys, time
sys.path.insert(0, {repo!r})
from gpupipe._runlock import RunLock
with RunLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(folder) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD.format(repo=str(REPO_ROOT)), str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_second_run_is_refused_naming_the_holder_until_it_dies(tmp_path, sig):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError) as e:
            RunLock(tmp_path).acquire()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{tmp_path}: in use by another run (pid {holder.pid} on ")
        assert "choose another --out" in msg
    finally:
        holder.send_signal(sig)
        holder.wait()
    assert holder.returncode == -sig
    assert (tmp_path / LOCK_NAME).exists()  # the dead holder's lock file is still there, and in nobody's way
    with RunLock(tmp_path):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()  # a run that ends leaves nothing behind


def test_the_lock_is_released_on_an_exception_and_can_be_taken_again(tmp_path):
    with pytest.raises(RuntimeError), RunLock(tmp_path / "run"):
        raise RuntimeError("the run failed")
    with RunLock(tmp_path / "run"):
        with pytest.raises(FolderInUseError):  # in this process too: a second lock on the folder is refused
            RunLock(tmp_path / "run").acquire()


def test_a_link_planted_at_the_lock_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).symlink_to(victim)
    with pytest.raises(GpupipeError, match=f"{LOCK_NAME}: cannot lock the folder"):
        RunLock(tmp_path / "run").acquire()
    assert victim.read_text() == "user data"


def test_a_holder_killed_before_it_wrote_its_name_leaves_no_lock(tmp_path):
    """SIGKILL at any moment: the kernel drops the flock with the process, whatever the file holds."""
    (tmp_path / LOCK_NAME).write_text('{"pid": 999999999, "host": "gone"}\n')
    start = time.time()
    with RunLock(tmp_path):
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    assert time.time() - start < 1
