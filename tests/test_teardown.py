"""A loader dropped in the middle of a pass ends its DataLoader workers at once, by reference counting.

A loader that sat in a reference cycle with its DataLoader's iterator was left to the garbage collector, which
finalises the iterator's queues before the iterator itself: the "stop" it then sends its workers never leaves the
process, and torch waits 5 s per worker before it terminates them (a test suite, a notebook re-running a cell, a
sweep building loaders in a loop). With gc off, the workers must be gone soon after the last reference is.
A loader that is in such a cycle anyway (a caught error's traceback holds it, or a user's object does) is collected
without that wait, and a pass that an error ends stops the workers before the error is raised.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe import Recipe

from .common_utils import jpeg_bytes, make_folder, photo
from .test_pool import _children

CASES = {
    "pillow": ("pillow", {"image_size": 32}),
    "turbojpeg": ("turbojpeg", {"image_size": 32}),
    "dali": ("dali", {"image_size": 32}),
    "ctaugment": ("pillow", {"recipe": Recipe(32, auto_augment="ctaugment")}),
}


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    from gpupipe.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("teardown-shards") / "out"
    prepare(folder, out, PrepareOptions(), workers=1)
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_dropped_loader_ends_its_workers_without_the_garbage_collector(folder, shards, case, monkeypatch):
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 30.0)  # torch's fallback: 30 s, not 5
    backend, kw = CASES[case]
    if backend not in gpupipe.available_backends():
        pytest.skip(f"no {backend}")
    data = shards if backend == "dali" else folder  # dali's feed processes read shards (a folder: DALI's threads)
    _ends_with_its_last_reference(
        lambda: gpupipe.build_loader(data, backend, batch_size=4, num_workers=1, device="cpu", **kw)
    )


def test_a_dropped_nvjpeg_loader_ends_its_workers_without_the_garbage_collector(folder, monkeypatch):
    """nvjpeg's stream too, its decode thread left in the middle of a pass (the loader's device side on the CPU)."""
    from .test_nvjpeg import _CpuNvjpegLoader

    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 30.0)

    parts = gpupipe.build_loader(folder, "pillow", batch_size=4, num_workers=1, device="cpu", image_size=32).parts
    _ends_with_its_last_reference(lambda: _CpuNvjpegLoader(parts))


def _workers(pid: int) -> set[int]:
    """The live processes below ``pid``, but multiprocessing's resource tracker (kept for the process's life once a
    worker is started by a fork server: no loader's): its children and theirs (dali's workers are forked by a fork
    server, :mod:`gpupipe.plumbing.zygote`)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker._pid  # private: multiprocessing has no public handle of it
    found = set(_children(pid)) - {tracker}
    return found | {grandchild for child in found for grandchild in _workers(child)}


def _ends_with_its_last_reference(make) -> None:
    """The loader ``make()`` builds, two batches of a pass taken, then it and its pass dropped with gc off: its
    workers end."""
    before = _workers(os.getpid())
    loader = make()
    it = iter(loader)
    next(it)
    next(it)
    workers = _workers(os.getpid()) - before
    assert workers, "the loader started no worker process"
    gc.disable()
    try:
        del it, loader
        deadline = time.monotonic() + 20  # torch's own wait for a worker that missed the stop: 30 s here
        while workers & _workers(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = workers & _workers(os.getpid())
    finally:
        gc.enable()
        gc.collect()
    assert not left, f"workers {sorted(left)} outlived their loader (a reference cycle keeps it for the collector)"


@pytest.mark.parametrize("backend", ["pillow", "turbojpeg", "dali"])
def test_a_loader_in_a_reference_cycle_is_collected_without_waiting_out_its_workers(
    folder, shards, monkeypatch, backend
):
    """The collector frees a loader, its pass and its DataLoader's iteration together: the iteration stays reachable
    until the loader's stream ends it, so its queues still carry the stop. torch's wait for a worker that missed it
    is made 30 s here, so a wait is told apart from a stop at once by a wide margin. dali's pass thread holds the
    loader only while it works on a batch: collected as soon as it is idle."""
    if backend not in gpupipe.available_backends():
        pytest.skip(f"no {backend}")
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 30.0)
    data = shards if backend == "dali" else folder
    loader = gpupipe.build_loader(data, backend, batch_size=4, num_workers=2, device="cpu", image_size=32)
    before = _workers(os.getpid())
    it = iter(loader)
    next(it)
    workers = _workers(os.getpid()) - before
    assert workers, "the loader started no worker process"
    loader.cycle = (loader, it)  # type: ignore[attr-defined]
    del loader, it

    def collect_until_gone() -> None:
        deadline = time.monotonic() + 10
        while workers & _workers(os.getpid()) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)

    collecting = threading.Thread(target=collect_until_gone, daemon=True)
    collecting.start()
    collecting.join(timeout=20)
    assert not collecting.is_alive(), "the collector waited out the workers of a loader in a reference cycle"
    assert not workers & _workers(os.getpid()), "a loader in a reference cycle was never collected"


def test_a_dali_pass_an_error_ends_stops_its_feed_workers_and_the_next_pass_starts_them(tmp_path):
    """dali on shards (its feed's DataLoader workers read them): a bad sample with ``on_error="raise"``."""
    if "dali" not in gpupipe.available_backends():
        pytest.skip("no dali")
    wds = pytest.importorskip("webdataset")
    good = jpeg_bytes(photo(np.random.default_rng(0), 40, 48))
    (tmp_path / "shards").mkdir()
    with wds.TarWriter(str(tmp_path / "shards" / "part-0.tar")) as w:
        for i in range(16):
            w.write({"__key__": f"s{i:04d}", "jpg": good[: len(good) // 3] if i == 9 else good, "cls": i % 2})
    loader = gpupipe.build_loader(
        str(tmp_path / "shards" / "part-0.tar"), "dali", batch_size=4, num_workers=2, device="cpu", image_size=32
    )
    before = _workers(os.getpid())
    for _ in range(2):
        with pytest.raises(gpupipe.DecodeError, match="s0009"):
            list(loader)
        workers = _workers(os.getpid()) - before
        assert not workers, f"workers {sorted(workers)} outlived the pass the error ended"


@pytest.mark.parametrize("backend", ["pillow", "turbojpeg", "dali", "nvjpeg"])
def test_a_pass_an_error_ends_stops_its_workers_before_the_error_is_raised(tmp_path, backend):
    """A bad file with ``on_error="raise"``: the error's traceback holds the loader (a caught error kept, a
    notebook's last one), yet no worker waits for the collector. The next pass starts them again, and reads the file
    mended meanwhile (dali judges each file's header once: the bad ones are judged again)."""
    if backend not in gpupipe.available_backends() and backend != "nvjpeg":
        pytest.skip(f"no {backend}")
    root = make_folder(tmp_path / "data", 2, 8)  # dali: the next pass goes on with the plan that met the error
    bad = sorted((root / "c01").iterdir())[1]
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 3])
    if backend == "nvjpeg":  # its device side on the CPU (see test_nvjpeg.py)
        from .test_nvjpeg import _CpuNvjpegLoader

        kw = dict(batch_size=4, num_workers=2, device="cpu", image_size=32)
        loader = _CpuNvjpegLoader(gpupipe.build_loader(root, "pillow", **kw).parts)
    else:
        loader = gpupipe.build_loader(root, backend, batch_size=4, num_workers=2, device="cpu", image_size=32)
    before = _workers(os.getpid())
    with pytest.raises(gpupipe.DecodeError, match=bad.name) as raised:
        list(loader)
    workers = _workers(os.getpid()) - before
    assert not workers, f"workers {sorted(workers)} outlived the pass the error ended"
    bad.write_bytes(good)
    assert sum(len(y) for _, y in loader) == 16 and raised.value.path.endswith(bad.name)


@pytest.mark.slow
def test_an_interrupt_while_the_take_thread_waits_on_a_stuck_worker_is_raised_at_once(folder):
    """Stopping the workers when a pass ends in an error first waits for the loader's take thread, for a bounded
    time: with every worker stopped (SIGSTOP), a Ctrl-C still ends the program. Run in a process of its own, whose
    stopped workers are killed with it."""
    import subprocess
    import sys

    code = f"""
import multiprocessing, os, signal, threading
from gpupipe.bench.host_budget import meta_loader
from gpupipe.recipe import Recipe
loader = meta_loader({str(folder)!r}, "pillow", Recipe(32), 4, 2)  # a device with no pin thread: a take thread
it = iter(loader)
next(it)
workers = [p.pid for p in multiprocessing.active_children()]
for pid in workers:
    os.kill(pid, signal.SIGSTOP)
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    while True:  # the batches made before the stop may end the pass: the next ones wait on the stopped workers
        for _ in it:
            pass
        it = iter(loader)
except KeyboardInterrupt:
    print("interrupted")
finally:
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["interrupted"], done.stderr


_ENDS_NORMALLY = """
import os, sys
import gpupipe
def forever(loader):
    while True:
        yield from loader
kept = []
for data, backend in zip(sys.argv[1::2], sys.argv[2::2]):
    settings = dict(backend=backend, batch_size=4, image_size=32, device="cpu", num_workers=1)
    loader = gpupipe.build_loader(data, **settings)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, labels in loader:
            pass
    left = gpupipe.build_loader(data, **settings)
    next(iter(left))  # a pass left early
    kept += [loader, left]
    going = forever(gpupipe.build_loader(data, **settings))
    next(going)  # a pass in the middle, held by a name of __main__ to the end
    globals()[f"going_{len(kept)}"] = going
os.kept = kept  # held by a module imported before gpupipe: dropped only in the interpreter's teardown
"""


@pytest.mark.slow
def test_a_script_that_ends_normally_exits_0_with_nothing_on_stderr(folder, shards):
    """The README's loop on every backend (dali on files and on shards), and loaders held to the interpreter's
    teardown, one of them left in the middle of a pass: no "Exception ignored" from a ``__del__`` run once the
    modules' names are cleared, no abort from a thread still in C++ code."""
    import subprocess
    import sys

    runs = [(folder, b) for b in ("pillow", "turbojpeg", "dali", "synthetic")] + [(shards, "dali")]
    args = [str(x) for data, backend in runs if backend in gpupipe.available_backends() for x in (data, backend)]
    kw: dict = {"capture_output": True, "text": True, "timeout": 120}
    done = subprocess.run([sys.executable, "-c", _ENDS_NORMALLY, *args], **kw)
    assert (done.returncode, done.stderr) == (0, "")
    # a pass held by the main module, as the benchmarks' simulated step holds it; a loader open in a with block of a
    # generator the main module holds, as the bench's jobs hold theirs
    for script, backends in ((_HELD_BY_MAIN, ("pillow", "turbojpeg")), (_OPEN_IN_A_GENERATOR, ("pillow", "dali"))):
        for backend in (b for b in backends if b in gpupipe.available_backends()):
            done = subprocess.run([sys.executable, "-c", script, str(folder), backend], **kw)
            assert (done.returncode, done.stderr) == (0, ""), backend


_OPEN_IN_A_GENERATOR = """
import sys
import gpupipe
def counts():
    with gpupipe.build_loader(sys.argv[1], sys.argv[2], batch_size=4, image_size=32, device="cpu") as loader:
        while True:
            for _, labels in loader:
                yield len(labels)
going = counts()
for _ in range(3):
    next(going)
"""


_HELD_BY_MAIN = """
import sys
from gpupipe.bench.host_budget import meta_loader
from gpupipe.recipe import Recipe
loader = meta_loader(sys.argv[1], sys.argv[2], Recipe(32), 4, 1)  # as for CUDA: a take thread, the device side on meta
def forever():
    while True:
        yield from loader
it = forever()
for _ in range(3):
    next(it)
"""


_FORKED = """
import os, sys
import gpupipe
for data, backend in zip(sys.argv[1::2], sys.argv[2::2]):
    loader = gpupipe.build_loader(data, backend, batch_size=4, image_size=32, device="cpu", num_workers=2)
    first = sum(len(labels) for _, labels in loader)
    for iterate in (False, True):
        pid = os.fork()
        if pid == 0:  # a child that ends normally, having tried the parent's loader or not
            if iterate:
                try:
                    next(iter(loader))
                except gpupipe.GpupipeError as e:  # naming the parent
                    print("refused" if str(e).startswith(f"this loader was built in process {os.getppid()},") else e)
            sys.exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        assert sum(len(labels) for _, labels in loader) == first
    print(backend, "goes on")
"""


@pytest.mark.slow
def test_a_forked_child_leaves_its_parents_loader_alone(folder, shards):
    """A process forked after a loader was used (``os.fork()``, as multiprocessing's fork start and many libraries
    do) that ends normally does not end the parent's workers nor hang; one that iterates the loader gets one error
    naming the process that built it; the parent's loader goes on."""
    import subprocess
    import sys

    runs = [(folder, "pillow"), (shards, "dali")]
    args = [str(x) for data, backend in runs if backend in gpupipe.available_backends() for x in (data, backend)]
    done = subprocess.run([sys.executable, "-c", _FORKED, *args], capture_output=True, text=True, timeout=120)
    expected = [line for backend in args[1::2] for line in ("refused", f"{backend} goes on")]
    assert (done.returncode, done.stdout.splitlines(), done.stderr) == (0, expected, "")


_KILLED = """
import glob, os, sys, time
import gpupipe
loaders = []
for data, backend in zip(sys.argv[1::2], sys.argv[2::2]):  # each between two epochs, its workers waiting
    loader = gpupipe.build_loader(data, backend, batch_size=4, image_size=32, device="cpu", num_workers=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    loaders.append(loader)
print("ready", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_killed_process_leaves_no_worker_and_no_shared_memory_behind(folder, shards):
    """A training process killed between two epochs (SIGKILL, as the out-of-memory killer does): its workers, which
    wait for the next epoch, notice their parent's death and end within seconds, and their shared-memory files go."""
    import glob
    import subprocess
    import sys

    runs = [(folder, "pillow"), (folder, "dali"), (shards, "dali")]
    args = [str(x) for data, backend in runs if backend in gpupipe.available_backends() for x in (data, backend)]
    run = subprocess.Popen([sys.executable, "-c", _KILLED, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        workers = _workers(run.pid)
        files = [f for pid in workers for f in glob.glob(f"/dev/shm/torch_{pid}_*")]
        assert workers and files
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 15  # each watches its parent every 0.5 s
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if _alive(pid)] == []
    assert [f for f in files if os.path.exists(f)] == []


def test_end_workers_stops_an_iterations_workers_now_and_a_persistent_dataloader_starts_new_ones():
    """The one way both streams (the CPU backends' and dali's feed) end a DataLoader iteration: its workers gone when it
    returns, and a DataLoader with persistent workers lets go of it, so that its next ``iter()`` starts fresh ones
    instead of handing back the ended iteration."""
    from gpupipe.plumbing.workers import end_workers, start_workers

    dataloader = torch.utils.data.DataLoader(range(8), batch_size=2, num_workers=1, persistent_workers=True)
    it = start_workers(dataloader)
    assert next(it).tolist() == [0, 1]
    workers = list(it._workers)
    end_workers(dataloader, it)
    assert not any(w.is_alive() for w in workers)
    assert dataloader._iterator is None
    again = start_workers(dataloader)
    assert again is not it and [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    end_workers(dataloader, again)
    end_workers(dataloader, None)  # nothing begun: nothing to end
