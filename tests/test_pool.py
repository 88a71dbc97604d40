"""Worker processes that die: ``prepare --workers 2`` and ``check`` survive a SIGKILLed worker (real processes,
real signals); a worker that dies on every try is one line naming the samples."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest

from gpupipe._pool import ordered_map
from gpupipe.errors import GpupipeError

from .common_utils import REPO_ROOT, make_folder


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc: no psutil needed)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _is_worker(pid: int) -> bool:
    """Whether child ``pid`` is a worker: this interpreter (as forked, or as multiprocessing starts it), not a
    helper (multiprocessing's resource tracker or fork server) nor a short-lived program a library runs (ldconfig)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return argv[0] == sys.executable and not any("resource_tracker" in a or "forkserver" in a for a in argv)


def _kill_a_worker_of(proc: subprocess.Popen) -> int:
    """SIGKILL the first worker ``proc`` starts, while ``proc`` runs; its pid. A child gone before the signal lands
    is looked for again."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        for kid in filter(_is_worker, _children(proc.pid)):
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return kid
        time.sleep(0.005)
    raise AssertionError("the command ended before it started a worker")


def _gpupipe(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "gpupipe", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("workers"), 3, 12)


@pytest.mark.slow
def test_prepare_survives_a_killed_worker_with_the_same_shards(src, tmp_path):
    proc = _gpupipe("prepare", src, tmp_path / "killed", "--workers", "2", "--max-side", "48")
    _kill_a_worker_of(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "36 samples" in out
    straight = _gpupipe("prepare", src, tmp_path / "straight", "--workers", "1", "--max-side", "48")
    assert straight.wait(timeout=300) == 0
    for name in ("shard-000000.tar", "index.npz"):
        assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


@pytest.mark.slow
def test_check_survives_a_killed_worker(src):
    proc = _gpupipe("check", src, "--workers", "2", "--json")
    _kill_a_worker_of(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and '"files": 36' in out, err


def _die_on_5(i: int) -> int:
    if i == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return i * i


def _no_setup() -> None:
    pass


def _die_once_on_5(marker: str, i: int) -> int:
    if i == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(0.3)  # after the first chunk's results are in
        os.kill(os.getpid(), signal.SIGKILL)
    return i * i


def test_a_worker_that_dies_while_results_are_being_used_is_replaced(tmp_path):
    """The pool is found broken when the next chunk is handed out, not when a result is awaited."""
    fn, got = functools.partial(_die_once_on_5, str(tmp_path / "died")), []
    for r in ordered_map(fn, range(40), 2, initializer=_no_setup):
        if not got:
            time.sleep(1.5)  # the worker dies meanwhile
        got.append(r)
    assert (tmp_path / "died").exists() and got == [i * i for i in range(40)]


def test_a_worker_that_always_dies_is_one_line_naming_the_samples():
    with pytest.raises(GpupipeError) as e:
        list(ordered_map(_die_on_5, range(12), 2, initializer=_no_setup, name=lambda i: f"img{i}.jpg", what="x: w"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("x: w died (killed, or out of memory) on samples 4..7 (img4.jpg ...)")


def test_results_come_in_order_across_chunks():
    assert list(ordered_map(abs, range(-9, 30), 2, initializer=_no_setup)) == [abs(i) for i in range(-9, 30)]
