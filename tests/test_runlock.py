"""One run per output folder (_runlock): real processes hold it, are killed, and a second one is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
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


_HOLD_AND_FORK = """
import os, sys, time
sys.path.insert(0, {repo!r})
from gpupipe._runlock import RunLock
with RunLock(sys.argv[1]):
    child = os.fork()  # as a DataLoader starts its workers: the child inherits every open descriptor
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
"""


def test_children_forked_by_a_killed_holder_do_not_hold_the_folder(tmp_path):
    """A run SIGKILLed while its DataLoader workers live: the orphaned workers (which linger for seconds) keep the
    lock file's descriptor, but not the lock: the run can be resumed at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_AND_FORK.format(repo=str(REPO_ROOT)), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(FolderInUseError, match=f"pid {proc.pid} "):
            RunLock(tmp_path).acquire()
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the orphan still lives, its copy of the descriptor open
        with RunLock(tmp_path):
            assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


_LOCK_SILENTLY = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_dead_process_named_in_the_file_is_not_named_as_the_holder(tmp_path):
    """The lock is held but the file still names an earlier holder that has ended: not blamed."""
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": socket.gethostname()}) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCK_SILENTLY, str(tmp_path / LOCK_NAME)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(FolderInUseError, match="a process that is just starting") as e:
            RunLock(tmp_path).acquire()
        assert "999999999" not in str(e.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_killed_before_it_wrote_its_name_leaves_no_lock(tmp_path):
    """SIGKILL at any moment: the kernel drops the flock with the process, whatever the file holds."""
    (tmp_path / LOCK_NAME).write_text('{"pid": 999999999, "host": "gone"}\n')
    start = time.time()
    with RunLock(tmp_path):
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    assert time.time() - start < 1
