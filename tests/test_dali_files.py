"""backends/dali_files.py: DALI reads a folder's or a file list's files itself. The training thread hands it path rows
and crop rows, never bytes; no process is started for it but the header scan's; the batches are, to the bit, those
of the feed that reads the files in DataLoader workers (the path shards still take); and a file that changed between
two passes is judged again, as it is then."""

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe.backends.dali import DaliLoader
from gpupipe.sources.scan import ImageList

from .common_utils import ctrl_c_mid_pass, make_folder, photo

pytestmark = pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="DALI is not installed")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Photo-like JPEGs with EXIF turns, a PNG, a CMYK JPEG, a GIF (Pillow only), an empty file, a truncated JPEG and
    one with bytes after its end marker: every verdict the feed makes."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(3)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for i in range(9):
            h, w = [(150, 200), (200, 150), (120, 168)][i % 3]
            exif = Image.Exif()
            if i == 4:
                exif[0x0112] = 6 if c == 0 else 8
            photo(rng, h, w).save(root / f"c{c}" / f"{i:02d}.jpg", quality=90, exif=exif)
    photo(rng, 90, 110).save(root / "c0" / "png.png")
    photo(rng, 90, 110).convert("CMYK").save(root / "c1" / "cmyk.jpg", quality=90)
    (root / "c1" / "empty.jpg").write_bytes(b"")
    photo(rng, 70, 90).save(root / "c1" / "gif.jpg", "GIF")  # a GIF under a JPEG name: Pillow only
    whole = (root / "c0" / "00.jpg").read_bytes()
    (root / "c0" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (root / "c1" / "tail.jpg").write_bytes(whole + b"\0" * 5000)  # a whole JPEG, its marker far from the end
    return root


@pytest.fixture()
def no_pipeline():
    """No DALI pipeline of an earlier test left in this process (one still to be collected, in a reference cycle):
    scan workers are forked only while none runs (``_fork.pipelines_running``)."""
    import gc

    from gpupipe.backends._fork import pipelines_running

    gc.collect()
    assert not pipelines_running(), "a DALI pipeline of an earlier test is still alive"


def _feed_loader(root, **kw):
    """The loader as it was: the files read and judged by the feed's workers, their bytes handed to DALI."""
    loader = gpupipe.build_loader(root, "dali", **kw)
    assert isinstance(loader, DaliLoader)
    loader._files = False
    return loader


def _same(a, b):
    assert len(a) == len(b)
    for (x, y), (rx, ry) in zip(a, b, strict=True):
        assert torch.equal(y, ry) and torch.equal(x, rx)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("workers", [1, 8])
def test_batches_equal_the_feeds_to_the_bit(mixed, train, workers):
    """Three epochs (the second left a batch short), skips, Pillow's samples and refills included; with one DALI
    thread and one scan process, and with eight threads and two processes."""
    kw = dict(batch_size=5, train=train, image_size=40, num_workers=workers, seed=2, device="cpu", on_error="skip")
    files, feed = gpupipe.build_loader(mixed, "dali", **kw), _feed_loader(mixed, **kw)
    for epoch in range(3):
        a, b = iter(files), iter(feed)
        short = epoch == 1 and train
        n = len(files) - 1 if short else len(files)
        _same([next(a) for _ in range(n)], [next(b) for _ in range(n)])
        if not short:
            assert next(a, None) is None and next(b, None) is None
        assert sorted(files.skipped) == sorted(feed.skipped) and files.fallbacks == feed.fallbacks
    kinds = files._feed.table.kind.tolist() if files._feed is not None else []
    assert kinds == [0] * 9 + [2, 0] + [0] * 9 + [0, 2, 1, 0]  # c0: ..., cut, png; c1: ..., cmyk, empty, gif, tail
    if not train:  # (train refills from the epoch's first samples: its last pass may skip fewer)
        assert {os.path.basename(p) for p, _ in files.skipped} == {"empty.jpg", "cut.jpg"}
        assert files.fallbacks == 1  # the GIF


@pytest.mark.usefixtures("no_pipeline")
def test_no_image_bytes_are_read_in_python_and_the_scan_processes_are_the_loaders_for_its_life(folder, monkeypatch):
    """The scan processes (which check each pass's files against their verdicts) are started once, are the only ones,
    and end with the loader."""
    reads = []
    real = ImageList.read

    def read(self, index):
        reads.append(index)
        return real(self, index)

    monkeypatch.setattr(ImageList, "read", read)
    children = __import__("multiprocessing").active_children
    before = set(children())
    loader = gpupipe.build_loader(folder, "dali", batch_size=4, image_size=32, num_workers=2, device="cpu")
    started = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == 4 * len(loader)
        started.append(set(children()) - before)
    assert reads == [] and started[0] == started[1] and 1 <= len(started[0]) <= 2
    del loader
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in started[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in started[0])


@pytest.mark.usefixtures("no_pipeline")
def test_headers_judged_in_processes_as_in_this_one(mixed):
    from gpupipe.backends.dali_files import FileTable, Scanner

    dataset = gpupipe.sources.open.open_source(mixed)
    here, there = FileTable(dataset, 10**8), FileTable(dataset, 10**8)
    index = np.arange(len(dataset))
    Scanner(here, 0).settle(None, index)
    scanner = Scanner(there, 1)
    asked = [scanner.ask(index[:10]), scanner.ask(index[5:])]  # overlapping: judged twice, alike
    assert scanner._pool is not None
    scanner.settle(asked[0], index[:10])
    scanner.settle(asked[1], index[5:])
    assert np.array_equal(here.kind, there.kind) and np.array_equal(here.sizes, there.sizes)
    assert np.array_equal(here.stamps, there.stamps) and (here.stamps != -1).all()
    assert here.problems == there.problems and len(here.problems) == 2
    assert scanner.ask(index) is None  # every sample judged, and checked in this pass
    scanner.close()


@pytest.mark.usefixtures("no_pipeline")
def test_a_scan_worker_killed_between_batches_leaves_the_samples_judged_here(mixed):
    from gpupipe.backends.dali_files import FileTable, Scanner
    from gpupipe.sources.open import open_source

    dataset = open_source(mixed)
    here, there = FileTable(dataset, 10**8), FileTable(dataset, 10**8)
    index = np.arange(len(dataset))
    Scanner(here, 0).settle(None, index)
    scanner = Scanner(there, 1)
    scanner.settle(scanner.ask(index[:4]), index[:4])
    (worker,) = scanner._pool._processes.values()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    time.sleep(0.5)  # the pool's manager thread marks the pool broken
    asked = scanner.ask(index[4:])
    scanner.settle(asked, index[4:])
    assert np.array_equal(here.kind, there.kind) and here.problems == there.problems


def test_scan_workers_are_forked_only_while_no_dali_pipeline_runs(mixed, folder):
    """A fork beside DALI's threads may inherit a lock one of them holds (the child then hangs): while a pipeline
    runs in this process (another loader's), the headers are judged on the caller's thread, alike; once none does,
    in processes again."""
    import gc

    from gpupipe.backends._fork import pipelines_running
    from gpupipe.backends.dali_files import FileTable, Scanner
    from gpupipe.sources.open import open_source

    dataset = open_source(mixed)
    here, beside, alone = (FileTable(dataset, 10**8) for _ in range(3))
    index = np.arange(len(dataset))
    Scanner(here, 0).settle(None, index)
    running = gpupipe.build_loader(folder, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    next(iter(running))
    scanner = Scanner(beside, 1)
    asked = scanner.ask(index)
    assert asked is None and scanner._pool is None
    scanner.settle(asked, index)
    del running
    gc.collect()
    deadline = time.monotonic() + 10  # its pass's thread, stopped, lets go of the pipeline as it ends
    while pipelines_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    scanner = Scanner(alone, 1)
    asked = scanner.ask(index)
    assert asked is not None and scanner._pool is not None
    scanner.settle(asked, index)
    for table in (beside, alone):
        assert np.array_equal(here.kind, table.kind) and here.problems == table.problems


def test_a_stuck_scan_worker_is_killed_and_its_samples_judged_here(mixed, monkeypatch, no_hang):
    """A worker that stops answering (stopped here; a deadlock, a hung file system) is waited for a bounded time,
    then killed, its samples judged on the loader's thread: the loader never hangs on it."""
    from gpupipe.backends import dali_files
    from gpupipe.sources.open import open_source

    dataset = open_source(mixed)
    here, there = dali_files.FileTable(dataset, 10**8), dali_files.FileTable(dataset, 10**8)
    index = np.arange(len(dataset))
    dali_files.Scanner(here, 0).settle(None, index)
    scanner = dali_files.Scanner(there, 1)
    scanner.settle(scanner.ask(index[:4]), index[:4])
    (worker,) = scanner._pool._processes.values()
    monkeypatch.setattr(dali_files, "_ANSWER", 1.0)  # (once it has answered: a loaded machine may be slow to start)
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        scanner.settle(scanner.ask(index[4:]), index[4:])
        assert np.array_equal(here.kind, there.kind) and here.problems == there.problems
        assert scanner._pool is None
        deadline = time.monotonic() + 10  # killed (reaped by the pool's own thread: its state read from /proc)
        while _running(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker.pid)
    finally:
        if _running(worker.pid):
            os.kill(worker.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture()
def no_hang():
    def stop(signum, frame):
        raise TimeoutError("still running after 60 s: something blocked")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_fifo_or_device_never_reaches_dalis_reader(tmp_path, no_hang):
    """A fifo in the folder is left out by the walk; one that replaced a file after the scan, or a link to
    /dev/zero, is found by the header scan (opened non-blocking): reported as Pillow reports it, never read."""
    root = make_folder(tmp_path / "data", 2, 3)
    os.mkfifo(root / "c01" / "p.jpg")
    loader = gpupipe.build_loader(root, "dali", batch_size=3, train=False, image_size=16, device="cpu", on_error="skip")
    (root / "c00" / "000.jpg").unlink()
    os.mkfifo(root / "c00" / "000.jpg")
    (root / "c00" / "001.jpg").unlink()
    (root / "c00" / "001.jpg").symlink_to("/dev/zero")
    assert sum(len(y) for _, y in loader) == 4
    assert sorted(reason for _, reason in loader.skipped) == [
        "cannot read the file (not a regular file: a character device)",
        "cannot read the file (not a regular file: a fifo)",
    ]


@pytest.fixture()
def fifos():
    """The fifos a test makes; at its end each is opened for writing and removed, so a reader a failed test left
    waiting in ``open`` goes on, and no later test meets a stuck pipeline."""
    made: list = []
    yield made
    for _ in range(3):
        for path in made:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        time.sleep(0.2)
    for path in made:
        path.unlink(missing_ok=True)


@pytest.mark.usefixtures("no_native_hang")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_file_that_becomes_a_fifo_between_epochs_is_reported_not_waited_on(tmp_path, no_hang, fifos, workers):
    """The next epoch's first batches are scheduled in DALI before their pass begins: a file replaced by a fifo in
    between kept DALI's reader waiting in ``open`` for a writer, and the loader waited for ever on the batch. Now,
    while the loader waits on DALI (a batch, or a pipeline's shut-down) over a second, the fifos among the batches in
    flight are opened for writing and closed: the read ends, and the file is reported as on the CPU backends."""
    root = make_folder(tmp_path / "data", 2, 8)
    kw = dict(batch_size=4, image_size=16, num_workers=workers, device="cpu", on_error="skip")
    loader = gpupipe.build_loader(root, "dali", **kw)
    assert sum(len(y) for _, y in loader) == 16 and loader.skipped == []
    fifos += sorted((root / "c01").glob("*.jpg"))  # half the files: some in the batches scheduled ahead
    for path in fifos:
        path.unlink()
        os.mkfifo(path)
    loader.set_epoch(1)
    assert [len(y) for _, y in loader] == [4] * 4  # (a train epoch's batches refilled from good samples)
    assert sorted(path for path, _ in loader.skipped) == [str(p) for p in fifos]
    assert {reason for _, reason in loader.skipped} == {"cannot read the file (not a regular file: a fifo)"}
    loader.close()


@pytest.fixture()
def no_native_hang():
    """A hang inside DALI's native calls, where ``SIGALRM``'s handler never runs: every thread's stack printed and
    the run ended after two minutes, not a CI job waiting out its limit."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _driver_fed(paths: list, size: int = 32):
    """A dali loader's pipeline (files read by DALI), fed one batch of ``paths`` with whole-image crops."""
    from gpupipe.backends.dali_graph import Driver, build_pipeline, crop_inputs

    recipe = gpupipe.Recipe(size)
    graph = build_pipeline(
        recipe, train=True, batch_size=len(paths), device=torch.device("cpu"), num_threads=1, files=True
    )
    pipe = Driver(graph)
    rows = np.zeros((len(paths), 256), np.uint8)
    for row, path in zip(rows, paths, strict=True):
        row[: len(bytes(path))] = np.frombuffer(bytes(path), np.uint8)
    pipe.feed("paths", rows)
    crops = np.array([[0, 0, 16, 16, k, size] for k in range(len(paths))], np.int64)
    for name, data in crop_inputs(recipe, True, crops).items():
        pipe.feed(name, data)
    pipe.run()
    return pipe


@pytest.mark.usefixtures("no_native_hang")
def test_a_wait_on_a_batch_whose_file_is_a_fifo_ends_in_dalis_error(tmp_path, fifos):
    """A file swapped for a fifo between its check and DALI's read: the wait on its batch is watched, the fifo opened
    for writing, and DALI's read of it ends in an error the loader recovers from (Pillow then names the file)."""
    from gpupipe.backends import dali_fifos

    good = make_folder(tmp_path / "data", 1, 1) / "c00" / "000.jpg"
    fifos.append(tmp_path / "swapped.jpg")
    os.mkfifo(fifos[0])
    pipe = _driver_fed([good, fifos[0]])
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        pipe.share(None)
    assert time.monotonic() - start > dali_fifos.AFTER  # it was held in ``open`` until the watch came
    assert not pipe.in_flight.batches
    pipe.shutdown()


@pytest.mark.usefixtures("no_native_hang")
@pytest.mark.parametrize("cycle", [False, True])
def test_a_pipeline_dropped_with_a_fifo_in_flight_is_shut_down_watched(tmp_path, fifos, cycle):
    """A pipeline let go with a batch in flight whose file is a fifo (its loader collected, at once or in a reference
    cycle by the collector): DALI's ``__del__`` waited on the reader for ever; its paths are now watched while it
    does."""
    import gc

    fifos.append(tmp_path / "swapped.jpg")
    os.mkfifo(fifos[0])
    pipe = _driver_fed([fifos[0]])
    if cycle:
        pipe.me = pipe  # type: ignore[attr-defined]
    time.sleep(0.2)  # DALI's thread in ``open``
    del pipe
    gc.collect()
    from gpupipe.backends._fork import pipelines_running

    assert not pipelines_running()


@pytest.mark.usefixtures("no_native_hang")
def test_a_pipeline_collected_on_the_fifo_watch_thread_is_shut_down_on_another(tmp_path, fifos, monkeypatch):
    """The collector runs a dropped pipeline's finalizer on whichever thread allocates when it runs, the fifo watch's
    own among them: the shut-down waited there on a reader held in ``open``, for the watch that was waiting, for ever.
    It is handed to a thread of its own there, and the watch goes on and lets the reader go."""
    import threading

    from gpupipe.backends import dali_fifos, dali_graph

    fifos.append(tmp_path / "swapped.jpg")
    os.mkfifo(fifos[0])
    pipe = _driver_fed([fifos[0]])  # DALI's thread in ``open`` now, or soon
    flight, ran_on = pipe.in_flight, []
    look = dali_fifos.InFlight.look

    def collected_here(self, now):  # the collector, on the watch thread, runs the dropped pipeline's finalizer
        if not ran_on:
            ran_on.append(threading.current_thread())
            dali_graph._collected(pipe.pipe, flight)
        look(self, now)

    monkeypatch.setattr(dali_fifos.InFlight, "look", collected_here)
    busy = dali_fifos.InFlight()  # another loader's wait under way, which the watch looks at
    dali_fifos._waiting[id(busy)] = busy
    try:
        deadline = time.monotonic() + 30
        while not flight.shut and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dali_fifos._waiting.pop(id(busy), None)
        with contextlib.suppress(OSError):  # (a failing run: DALI's reader let go, not left in ``open``)
            os.close(os.open(fifos[0], os.O_WRONLY | os.O_NONBLOCK))
    assert ran_on == dali_fifos._watcher  # it was collected there
    assert flight.shut and not flight.batches  # shut down, on another thread, with the watch's help


_CTRL_C_MID_PASS = """
import sys, time
import gpupipe
loader = gpupipe.build_loader(sys.argv[1], "dali", batch_size=4, image_size=16, num_workers=2, device="cpu")
try:
    for epoch in range(1000):
        for k, _ in enumerate(loader):
            if epoch == 1 and k == 1:
                print("in the second pass", flush=True)
            time.sleep(0.05)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


@pytest.mark.slow  # a script run into its second pass
def test_ctrl_c_mid_pass_prints_no_traceback_from_the_scan_workers(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while a dali loader reads a folder: the script's
    own handler stops it, and nothing else is printed. The header scan's workers printed a KeyboardInterrupt traceback
    each ("Process ZygoteProcess-1: ... call_queue.get ... KeyboardInterrupt"), 6 runs of 6."""
    root = make_folder(tmp_path / "data", 2, 8)
    code, out, err = ctrl_c_mid_pass(_CTRL_C_MID_PASS, root)
    assert (code, out) == (0, "stopped\n"), err
    assert err == ""


_EXIT_WITH_FIFOS_IN_FLIGHT = """
import os, sys
from pathlib import Path
import gpupipe
root = Path(sys.argv[1])
loader = gpupipe.build_loader(root, "dali", batch_size=4, image_size=16, num_workers=2, device="cpu", on_error="skip")
assert sum(len(y) for _, y in loader) == 16  # the next epoch's first batches are scheduled now
for path in sorted(root.glob("c0?/*.jpg")):
    path.unlink()
    os.mkfifo(path)
print("exiting", flush=True)
"""


def test_a_process_that_ends_with_a_fifo_among_the_paths_in_flight_exits(tmp_path, fifos):
    """The process ends with the next epoch's first batches scheduled in DALI, every file of them a fifo now: DALI's
    own exit hook shut its pipelines down first, unwatched, and waited for ever on a reader held in ``open``. The
    loaders' hook now runs before it and shuts them down with the fifos watched."""
    import subprocess
    import sys

    root = make_folder(tmp_path / "data", 2, 8)
    fifos += sorted(root.glob("c0?/*.jpg"))
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_FIFOS_IN_FLIGHT, str(root)], capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stdout) == (0, "exiting\n"), run.stderr
    assert "Exception ignored" not in run.stderr and "Error" not in run.stderr, run.stderr


@pytest.mark.usefixtures("no_pipeline")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_file_gone_after_its_check_is_reported_and_the_rest_of_its_batch_delivered(tmp_path, monkeypatch, workers):
    """A file removed between its header's check and its batch's read: DALI's reader fails on the batch, Pillow names
    the file, reported as the scan reports a file it cannot read; the other samples are delivered (on a new
    pipeline) as a CPU backend delivers them, the batches refilled by the samples after."""
    from gpupipe.backends import dali_files

    root = make_folder(tmp_path / "data", 2, 6)
    real, gone = dali_files.FileStream.make, []

    def make(self, request, index):
        if request.number == 1 and not gone:
            gone.append(self.table.dataset.samples[request.indices[0]][0])
            os.unlink(gone[0])
        return real(self, request, index)

    monkeypatch.setattr(dali_files.FileStream, "make", make)
    kw = dict(batch_size=4, train=False, image_size=16, device="cpu", on_error="skip", num_workers=workers)
    loader = gpupipe.build_loader(root, "dali", **kw)
    labels = [y for _, y in loader]
    assert loader.skipped == [(gone[0], "cannot read the file (No such file or directory)")]
    images = [x for x, _ in loader]  # (the loader's second pass: the file is gone from the start)
    pillow = gpupipe.build_loader(root, "pillow", **kw)  # what a CPU backend makes of the folder as it is now
    assert [y.tolist() for y in labels] == [y.tolist() for _, y in pillow]
    for x, (px, _) in zip(images, pillow, strict=True):
        assert (x.float() - px.float()).abs().mean() < 2


def test_eval_rows_are_the_recipes_to_the_bit():
    from gpupipe.backends.gpu_feed import eval_rows

    rng = np.random.default_rng(0)
    heights, widths = rng.integers(1, 5000, 4000), rng.integers(1, 5000, 4000)
    heights[:3], widths[:3] = [224, 300, 256], [224, 200, 257]  # square, tall, a half to round
    for recipe in (gpupipe.Recipe(224), gpupipe.Recipe(160, crop_pct=0.95), gpupipe.Recipe(33, crop_pct=0.5)):
        want = [recipe.eval_offsets(h, w) for h, w in zip(heights.tolist(), widths.tolist(), strict=True)]
        assert eval_rows(recipe, heights, widths).tolist() == [list(r) for r in want]


def test_a_loader_dropped_while_headers_are_judged_ends_the_scan_processes(folder):
    import gc
    import time

    children = __import__("multiprocessing").active_children
    before = set(children())
    loader = gpupipe.build_loader(folder, "dali", batch_size=2, image_size=16, num_workers=4, device="cpu")
    it = iter(loader)
    next(it)
    scanning = set(children()) - before
    assert scanning and loader._feed is not None and (loader._feed.table.kind < 0).any()  # not all judged yet
    gc.disable()
    try:
        del it, loader
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in scanning) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.is_alive() for p in scanning)
    finally:
        gc.enable()


def test_the_path_rows_are_each_samples_path_bytes_then_nuls(mixed, tmp_path):
    """From a folder's own path buffer and from a plain list of (path, label), non-UTF-8 names included, the last path
    of the buffer too: each row is its path's bytes, then NULs only (DALI's reader takes a row as a C string); every
    row as wide as the longest path and one NUL."""
    from gpupipe.backends.dali_files import FileTable
    from gpupipe.sources.scan import ImageList

    folder = gpupipe.sources.open.open_source(mixed)
    odd = os.fsdecode(bytes(tmp_path) + b"/caf\xe9.jpg")
    plain = ImageList(str(tmp_path), [("/a.jpg", 0), (odd, 1), ("/bb/c.png", 0)], ["0", "1"])
    for dataset in (folder, plain):
        table = FileTable(dataset, 10**8)
        last = len(dataset.samples) - 1
        chosen = np.array([2, 0, 1, last, 2])
        rows = table.paths(chosen)
        assert rows.shape == (5, max(len(os.fsencode(p)) for p, _ in dataset.samples) + 1)
        for row, i in zip(rows, chosen, strict=True):
            name = os.fsencode(dataset.samples[i][0])
            assert row[: len(name)].tobytes() == name and not row[len(name) :].any()


def test_dali_reads_a_path_row_up_to_its_first_nul(tmp_path):
    """What the path rows rely on: DALI's file reader, fed a row of a path's bytes then NULs, reads that file."""
    from nvidia.dali import fn, pipeline_def, types

    short, long = tmp_path / "a.bin", tmp_path / "a_longer_name.bin"
    short.write_bytes(b"short"), long.write_bytes(b"the longer one")
    names = [os.fsencode(p) for p in (short, long)]
    rows = np.zeros((2, max(map(len, names)) + 3), np.uint8)
    for row, name in zip(rows, names, strict=True):
        row[: len(name)] = np.frombuffer(name, np.uint8)

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def read():
        return fn.io.file.read(fn.external_source(name="paths", dtype=types.UINT8, ndim=1), dont_use_mmap=True)

    pipe = read()
    pipe.build()
    pipe.feed_input("paths", rows)
    (out,) = pipe.run()
    assert [np.array(out[k]).tobytes() for k in range(2)] == [b"short", b"the longer one"]


@pytest.mark.parametrize("train", [True, False])
def test_dali_reads_each_fed_path_with_no_operator_between(train):
    """The file reader takes the ``paths`` input as it is fed: a slice of a path table in the graph was one more CPU
    operator in DALI's chain per batch, which its threads waited on (bench/README.md, "dali with every core")."""
    from gpupipe.backends.dali_graph import build_pipeline

    device = torch.device("cpu")
    pipe = build_pipeline(gpupipe.Recipe(32), train=train, batch_size=2, device=device, num_threads=1, files=True)
    (read,) = [op for op in pipe._ops if type(op._op).__name__ == "Read"]  # DALI's graph, as built
    assert [i.source.name for i in read.inputs] == ["paths"]
    assert not [op for op in pipe._ops if type(op._op).__name__ == "Slice"]


def test_crop_boxes_are_drawn_several_batches_at_a_time_while_samples_are_still_being_judged(tmp_path, monkeypatch):
    """While the first epochs still meet samples being judged (every sample in the first, those the first left out in
    the next), a batch whose verdicts are in joins the run of batches whose crop boxes are drawn in one call: drawn one
    batch at a time, they cost the training thread several times as much (23 calls in these two epochs, was)."""
    from gpupipe.recipe import Recipe

    root = make_folder(tmp_path, 2, 108)  # 216 samples, batches of 16: 13 an epoch, 8 samples left out of each
    calls = []
    real = Recipe.plan_boxes
    monkeypatch.setattr(Recipe, "plan_boxes", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    loader = gpupipe.build_loader(root, "dali", batch_size=16, image_size=16, num_workers=2, device="cpu")
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sum(1 for _ in loader) == 13
    # runs of up to 8 batches: 2 calls an epoch, a few more while verdicts (and each pass's stamp checks) come; one a
    # batch would be 26: a busy machine's late verdicts make up to about 15
    assert len(calls) <= 17, len(calls)


def _change(path: str, change: str) -> None:
    """``path`` replaced (a new file renamed over it, or a fifo) by another kind of image."""
    new = path + ".new"
    if change == "fifo":
        os.mkfifo(new)
    else:  # "bigger": over the loader's max_pixels; "truncated": its rows past the centre crop's cut
        h, w = {"wider": (40, 240), "bigger": (400, 400), "truncated": (400, 40)}[change]
        stripes = np.zeros((h, w, 3), np.uint8)
        stripes[:, (np.arange(w) // 8) % 2 == 1] = 255  # where a crop falls shows
        Image.fromarray(stripes).save(new, "JPEG", quality=90)
        if change == "truncated":
            whole = open(new, "rb").read()
            with open(new, "wb") as f:
                f.write(whole[: len(whole) * 3 // 4])
    os.replace(new, path)


@pytest.mark.parametrize("change", ["wider", "bigger", "truncated", "fifo"])
def test_a_file_changed_between_epochs_is_judged_again_by_a_loader_living_across_them(tmp_path, change):
    """A file of epoch 1's last batch (not read ahead) replaced after epoch 0: epoch 1 is what a new loader makes of
    it (the new image's box; an error where it is refused), never the old verdict's."""
    root = make_folder(tmp_path / "data", 2, 8, sizes=((48, 40),))
    train = change != "wider"  # (eval's centre crop: where the old box falls shows most)
    kw = dict(batch_size=2, image_size=24, device="cpu", seed=1, on_error="skip", max_pixels=100_000, num_workers=1)
    kw.update(train=train, normalize=False)
    loader = gpupipe.build_loader(root, "dali", **kw)
    list(loader)
    path = loader.dataset.samples[loader.sampler.batches(1)[-1][0]][0]
    _change(path, change)
    signal.alarm(60)  # a hang is a failure
    try:
        loader.set_epoch(1)
        got = list(loader)
    finally:
        signal.alarm(0)
    if change == "fifo":  # (a new loader's scan leaves it out)
        assert loader.skipped == [(path, "cannot read the file (not a regular file: a fifo)")]
        return
    fresh = gpupipe.build_loader(root, "dali", **kw)
    fresh.set_epoch(1)
    expected = list(fresh)
    assert len(got) == len(expected) and loader.skipped == fresh.skipped
    assert (change == "wider") == (loader.skipped == [])
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(y, ey) and (x.float() - ex.float()).abs().mean() < 1  # (the old box: ~60)


@pytest.mark.usefixtures("no_pipeline")
def test_each_pass_checks_its_files_in_the_scan_processes_not_on_the_loaders_thread(tmp_path, monkeypatch):
    """The batches taken from the plan ahead of a pass's start (asked about in the pass before) are asked about again
    as the pass begins: the loader's thread made a ``stat`` a sample for up to eight batches at every epoch edge (the
    scan's answer was a pass old), while the scan processes sat idle."""
    from gpupipe.backends import dali_files

    stats_here = []
    real = dali_files.stamp_key
    monkeypatch.setattr(dali_files, "stamp_key", lambda path: stats_here.append(path) or real(path))
    _two_passes_after_the_first(tmp_path, stats_here.clear)
    assert stats_here == []


def _two_passes_after_the_first(tmp_path, between) -> None:
    """A folder loader (60 samples, batches of 4: 15 an epoch, two workers) run for a pass, ``between()``, then two
    more passes; the scan processes still running at the end (else every check is the loader thread's)."""
    root = make_folder(tmp_path, 2, 30)
    loader = gpupipe.build_loader(root, "dali", batch_size=4, image_size=16, num_workers=2, device="cpu")
    assert sum(len(y) for _, y in loader) == 60
    between()
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == 60
    assert loader._feed.scanner._pool is not None


@pytest.mark.usefixtures("no_pipeline")
def test_a_pass_after_the_first_sends_the_scan_only_the_files_that_changed(tmp_path, monkeypatch):
    """Once every sample was judged, a pass checks each batch's files in one call without the GIL (gpupipe/_stamps.c)
    and sends the scan only those whose stamps moved: a message cost the loader's thread about a millisecond (the
    executor's threads woken, a pipe written, each taking the GIL that DALI's threads wait for at an operator's end),
    where the ``stat`` calls take microseconds. Two passes of 15 batches sent 14 messages a few batches each."""
    from gpupipe.backends import dali_files

    if dali_files._stamps is None:
        pytest.skip("gpupipe._stamps is not built (no C compiler at install time)")
    sent = []
    real = dali_files.Asked
    monkeypatch.setattr(dali_files, "Asked", lambda indices, *rest: sent.append(len(indices)) or real(indices, *rest))
    monkeypatch.setattr(dali_files, "_SLOW_CALLS", 10**9)  # a busy machine's slow calls keep the checks here
    root = make_folder(tmp_path, 2, 30)
    loader = gpupipe.build_loader(root, "dali", batch_size=4, image_size=16, num_workers=2, device="cpu")
    assert sum(len(y) for _, y in loader) == 60
    sent.clear()
    loader.set_epoch(1)
    assert sum(len(y) for _, y in loader) == 60
    assert sent == [] and loader._feed.scanner._pool is not None
    changed = sorted(root.glob("*/*.jpg"))[7]
    Image.open(changed).resize((40, 30)).save(changed)
    loader.set_epoch(2)
    assert sum(len(y) for _, y in loader) == 60
    # judged again as it is now: by the scan, alone, or on the loader's thread where its batch was made ahead of the
    # pass (FileStream.reread)
    table = loader._feed.table
    i = [p for p, _ in table.dataset.samples].index(str(changed))
    assert sent in ([], [1]) and table.sizes[i].tolist() == [30, 40]


@pytest.mark.usefixtures("no_pipeline")
def test_where_stat_is_slow_the_checks_go_back_to_the_scan_processes(tmp_path, monkeypatch, caplog):
    """A network file system's ``stat`` (milliseconds) would hold up the thread that feeds DALI: after a few slow
    calls in a row the checks go to the header scan's processes, off that thread, and the loader says so once."""
    import types

    from gpupipe.backends import dali_files

    if dali_files._stamps is None:
        pytest.skip("gpupipe._stamps is not built (no C compiler at install time)")
    real = dali_files._stamps.stamps

    def slow(buf, starts, lengths, index, out):
        real(buf, starts, lengths, index, out)
        time.sleep(len(index) * 2 * dali_files._SLOW_STAT_S)

    monkeypatch.setattr(dali_files, "_stamps", types.SimpleNamespace(stamps=slow))
    sent = []
    asked = dali_files.Asked
    monkeypatch.setattr(dali_files, "Asked", lambda indices, *rest: sent.append(len(indices)) or asked(indices, *rest))
    caplog.set_level("INFO", logger="gpupipe")
    root = make_folder(tmp_path, 2, 30)
    loader = gpupipe.build_loader(root, "dali", batch_size=4, image_size=16, num_workers=2, device="cpu")
    for epoch in range(3):
        sent.clear()
        loader.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == 60
    assert not loader._feed.table.stat_here and sent  # the last pass's checks: the scan's
    assert sum("a network file system?" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.usefixtures("no_pipeline")
def test_an_ask_of_the_pass_before_still_at_work_is_not_waited_on_once_the_files_are_checked(mixed):
    """At a pass's start the batches taken ahead are asked about again. Where the new ask is not needed (every file
    checked in one call, unchanged), an ask of the pass before that is still at work was kept and waited on: its
    answer set the samples back to the pass before, and they were checked again on the loader's thread."""
    from concurrent.futures import Future

    from gpupipe.backends import dali_files
    from gpupipe.backends.dali_feed import Request
    from gpupipe.recipe import Recipe
    from gpupipe.sources.open import open_source

    if dali_files._stamps is None:
        pytest.skip("gpupipe._stamps is not built (no C compiler at install time)")
    dataset = open_source(mixed)
    table = dali_files.FileTable(dataset, 10**8)
    dali_files.Scanner(table, 0).settle(None, np.arange(len(dataset)))  # every sample judged, with its stamp
    stream = dali_files.FileStream(table, Recipe(16), True, 0, workers=1)
    index = np.arange(4, dtype=np.int64)
    still = dali_files.Asked(index, table.passes, Future())  # never answered
    stream._ahead.append((Request(1, list(range(4)), 0), index, still))
    stream.consuming(1)  # the pass begins
    stream._ask_again()
    ((_, _, asked),) = stream._ahead
    assert asked is None and not table.unchecked(index).any()
    stream.scanner.close()


@pytest.mark.usefixtures("no_pipeline")
def test_without_the_stamps_extension_a_pass_asks_the_scan_about_several_judged_batches_in_one_message(
    tmp_path, monkeypatch
):
    """Where gpupipe._stamps was not built, a pass's checks (a ``stat`` a file) go to the scan a few batches to a
    message, not one a batch."""
    from gpupipe.backends import dali_files

    monkeypatch.setattr(dali_files, "_stamps", None)
    sent = []
    real = dali_files.Scanner.ask
    monkeypatch.setattr(dali_files.Scanner, "ask", lambda self, index: sent.append(len(index)) or real(self, index))
    _two_passes_after_the_first(tmp_path, sent.clear)
    # up to 4 batches a message, none across an epoch's edge, the next epoch's first ones asked about again as it
    # begins: 14; one a batch was 44
    assert len(sent) <= 16 and max(sent) == 16, sent


def test_bad_files_are_judged_again_only_when_they_change(mixed, tmp_path, monkeypatch):
    """A bad file (truncated: Pillow decodes it to be sure) costs each later pass a ``stat`` in the scan processes,
    nothing on the loader's thread; once mended, the next pass reads it (judged here only if its batch was made
    ahead of the pass)."""
    from gpupipe.backends import dali_files

    judged_here = []
    real = dali_files.judge_file
    monkeypatch.setattr(dali_files, "judge_file", lambda path, limit: judged_here.append(path) or real(path, limit))
    root = tmp_path / "data"
    shutil.copytree(mixed, root)
    kw = dict(batch_size=5, image_size=24, device="cpu", train=False, on_error="skip", num_workers=1)
    loader = gpupipe.build_loader(root, "dali", **kw)
    list(loader)
    assert {os.path.basename(p) for p, _ in loader.skipped} == {"empty.jpg", "cut.jpg"}
    judged_here.clear()
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        list(loader)
    assert judged_here == []
    shutil.copy(root / "c0" / "01.jpg", root / "c0" / "cut.jpg")  # mended
    loader.set_epoch(3)
    list(loader)
    assert {os.path.basename(p) for p, _ in loader.skipped} == {"empty.jpg"}
    assert judged_here in ([], [str(root / "c0" / "cut.jpg")])


def _damaged(data: bytes, how: str) -> bytes:
    """A baseline JPEG with header bytes overwritten: ``"marker"``, its last Huffman table's marker and length zeroed
    (Pillow decodes past them, DALI's parser does not); ``"counts"``, its first Huffman table's code counts zeroed
    (neither decodes it)."""
    from gpupipe.image import _jpeg_segments

    tables = [at for marker, at, _ in _jpeg_segments(data) if marker == 0xC4]
    out = bytearray(data)
    if how == "marker":
        out[tables[-1] - 4 : tables[-1]] = bytes(4)
    else:
        out[tables[0] + 1 : tables[0] + 17] = bytes(16)
    return bytes(out)


def test_a_jpeg_header_is_sound_unless_its_bytes_were_overwritten():
    """Every kind of JPEG the loaders read has a sound header (a chain of segments up to the first scan, each table
    filling its segment); one with bytes overwritten there has not. A header longer than the bytes at hand is sound
    as far as they go."""
    from gpupipe.image import _jpeg_segments, jpeg_header_sound

    from .common_utils import VALID, jpeg_bytes, jpeg_with_orientation

    img = photo(np.random.default_rng(3), 64, 96)
    kinds = ("gray", "progressive", "arithmetic", "444", "422", "cmyk", "tiny", "elongated", "png_as_jpg")
    sound = {kind: VALID[kind](img) for kind in kinds}
    sound |= {f"orientation-{o}": jpeg_with_orientation(img, o) for o in (1, 6)}
    sound["restart markers"] = jpeg_bytes(img, quality=90, restart_marker_blocks=1)
    sound["16-bit tables"] = jpeg_bytes(img, quality=1)  # Pillow writes 16-bit tables where values pass 255
    base = jpeg_bytes(img, quality=90)
    sound["cut inside its header"] = base[:300]
    for kind, data in sound.items():
        assert jpeg_header_sound(data), kind
    dqt = next(at for marker, at, _ in _jpeg_segments(base) if marker == 0xDB)
    damaged = {
        "a marker zeroed": _damaged(base, "marker"),
        "Huffman code counts zeroed": _damaged(base, "counts"),
        "a table of precision 2": base[:dqt] + bytes([0x20]) + base[dqt + 1 :],
        "a length under 2": base[: dqt - 2] + b"\x00\x01" + base[dqt:],
        "an end of image in the header": base[: dqt - 4] + b"\xff\xd9" + base[dqt - 2 :],
        "a scan of 9 components": (lambda at: base[: at + 4] + b"\x09" + base[at + 5 :])(base.find(b"\xff\xda")),
    }
    for kind, data in damaged.items():
        assert not jpeg_header_sound(data), kind


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_jpeg_with_a_damaged_header_never_reaches_dali(tmp_path, source, capfd):
    """Two JPEGs with header bytes overwritten, which PIL still opens: DALI's decoder printed each on stderr ("[ERROR]
    [jpeg_parser] Invalid marker", "Bogus marker length"), every pass, before gpupipe's own report. Pillow takes them
    now: the one it decodes is delivered, the other skipped and named (``gpupipe prepare`` re-encodes the first and
    leaves the second out), and nothing of DALI's is on stderr."""
    from gpupipe.prepare import PrepareOptions, prepare

    from .common_utils import jpeg_bytes

    root = make_folder(tmp_path / "data", 2, 4)
    base = jpeg_bytes(photo(np.random.default_rng(4), 96, 128), quality=90)
    (root / "c00" / "damaged-marker.jpg").write_bytes(_damaged(base, "marker"))
    (root / "c00" / "damaged-counts.jpg").write_bytes(_damaged(base, "counts"))
    data = root
    if source == "shards":
        data = tmp_path / "shards"
        assert prepare(root, data, PrepareOptions(), workers=1).reencoded == {"damaged header": 1}
    capfd.readouterr()
    loader = gpupipe.build_loader(
        data, "dali", batch_size=2, train=False, image_size=16, num_workers=1, device="cpu", on_error="skip"
    )
    for _ in range(2):
        assert sum(len(labels) for _, labels in loader) == 9
    err = capfd.readouterr().err
    assert "[ERROR]" not in err and "Bogus" not in err and "Invalid marker" not in err, err
    skipped = [Path(path).name for path, _ in loader.skipped]
    assert skipped == ([] if source == "shards" else ["damaged-counts.jpg"])
