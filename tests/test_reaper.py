"""plumbing/reaper.py's Reaper: one thread per process for every loader, ended at interpreter exit and not inherited
by a forked child (a daemon thread left in C++ code at shutdown aborts the process after a run that went well)."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from gpupipe.plumbing.reaper import Reaper

from .common_utils import REPO_ROOT


def _reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpupipe-reaper"]


def test_every_loader_shares_one_thread_and_stop_ends_it():
    a, b = Reaper(), Reaper()
    for _ in range(3):
        a.drop(torch.zeros(1000))
        b.drop(torch.zeros(1000))
    assert len(_reapers()) == 1
    Reaper.stop()
    assert _reapers() == []
    a.drop(torch.zeros(10))  # a later drop starts it again
    assert len(_reapers()) == 1


def test_a_forked_child_drops_on_its_own_thread():
    Reaper().drop(torch.zeros(10))
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's, a drop starts its own, exit ends it
        ok = _reapers() == []
        Reaper().drop(torch.zeros(10))
        os._exit(0 if ok and len(_reapers()) == 1 else 1)
    assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.slow  # a fresh interpreter, run to its exit
def test_the_thread_is_joined_before_the_interpreter_finalizes():
    code = (
        "import atexit, threading, torch\n"
        "atexit.register(lambda: print('alive', [t.name for t in threading.enumerate()]))\n"  # LIFO: after stop
        "from gpupipe.plumbing.reaper import Reaper\n"
        "for _ in range(100): Reaper().drop(torch.zeros(100_000))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    assert r.returncode == 0, r.stderr
    assert "gpupipe-reaper" not in r.stdout and "alive" in r.stdout
