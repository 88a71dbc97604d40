"""plumbing/zygote.py: a loader's helper processes are forked by a fork server made while no DALI pipeline ran, also
once one runs (a second loader's first pass, a pass after an error-ended one); what is forked beside DALI's threads
has a bounded start."""

import os
import signal
import time

import pytest
import torch

import gpupipe
from gpupipe.errors import GpupipeError
from gpupipe.plumbing.zygote import Zygote

from .test_pool import _children

needs_dali = pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="DALI is not installed")


class _Pids(torch.utils.data.Dataset):
    """Each item: the reading process, its parent, and the id of an object it holds (a list: its identity shows)."""

    def __init__(self):
        self.held = [1, 2, 3]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid(), os.getppid(), id(self.held)


def test_workers_are_forked_by_the_zygote_and_take_what_it_holds_by_reference():
    """The workers are the zygote's children; the object it was given is not copied (same identity, as forked); a
    class defined outside any importable module (here: a test module's) reaches them; nothing is imported again."""
    dataset = _Pids()
    zygote = Zygote(hold=[dataset.held])
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context=zygote.context
    )
    items = list(loader)
    assert {int(parent) for _, parent, _ in items} == {zygote.pid}
    assert {int(held) for _, _, held in items} == {id(dataset.held)}
    assert zygote.pid in _children(os.getpid())
    del loader, zygote
    assert not [pid for pid in _children(os.getpid()) if pid == items[0][1]]


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    from gpupipe.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("zygote-shards") / "out"
    prepare(folder, out, PrepareOptions(), workers=1)
    return out


_WHILE_A_PIPELINE_RUNS = """
import sys
import gpupipe
from gpupipe.backends._fork import pipelines_running


def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def feed_workers(loader):
    return {parent(w.pid) for w in loader._feed._loader._iterator._workers}


kw = dict(batch_size=4, image_size=32, num_workers=2, device="cpu")
assert not pipelines_running()
first = gpupipe.build_loader(sys.argv[1], "dali", **kw)
zygote = first._zygote
assert zygote is not None and first.pipelines_built == 0
next(iter(first))
assert pipelines_running() and feed_workers(first) == {zygote.pid}
second = gpupipe.build_loader(sys.argv[1], "dali", train=False, **kw)
assert sum(len(y) for _, y in second) == len(second.dataset)
assert feed_workers(second) == {zygote.pid}
first._feed.stop()  # as a pass an error ended does
next(iter(first))
assert feed_workers(first) == {zygote.pid}
print("forked by the zygote")
"""


@pytest.mark.slow
@needs_dali
def test_a_loader_built_while_a_pipeline_runs_and_a_restart_fork_from_a_zygote_made_before_any(shards):
    """A second loader (a validation loader) whose first pass comes while the first one's DALI pipeline runs, and the
    first one's pass after an error-ended one (its feed stopped, then started again): their feed workers are forked
    by the zygote the first loader made before its pipeline was built, not by this process. In a process of its own,
    where no DALI pipeline ran before."""
    import subprocess
    import sys

    run = [sys.executable, "-c", _WHILE_A_PIPELINE_RUNS, str(shards)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[-2:] == ["forked by the zygote", ""], done.stderr


def _stuck_init(worker_id, nicer, began):
    os.kill(os.getpid(), signal.SIGSTOP)


@needs_dali
def test_a_feed_worker_stuck_as_it_begins_is_killed_and_named(shards, monkeypatch):
    """Forked from this process (no zygote), a worker that never begins (stopped here; a lock held at the fork) is
    killed once ``_START`` seconds have passed, and the pass ends with an error naming it: nothing waits for ever."""
    from gpupipe.backends import dali_stream

    monkeypatch.setattr(dali_stream, "_feed_worker_init", _stuck_init)
    monkeypatch.setattr(dali_stream, "_START", 1.0)
    loader = gpupipe.build_loader(shards, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    loader._zygote = None
    began = time.monotonic()
    with pytest.raises(GpupipeError, match=r"feed worker \(pid \d+\) did not begin within 1 s") as caught:
        next(iter(loader))
    assert time.monotonic() - began < 30  # not the 60 s a worker's answer may take: the 1 s bound held
    pid = int(str(caught.value).split("pid ")[1].split(")")[0])
    deadline = time.monotonic() + 10
    while pid in _children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid not in _children(os.getpid())
