"""The CPU backends' one stream of batches across epochs (gpupipe/backends/cpu_stream.py): one DataLoader iteration
for the loader's life, the next epoch's first batches made while a pass ends (also one left early, as ``gpupipe train
--accum 2`` leaves a pass's odd last batch), the same batches as a pass read on its own, and batches read ahead kept
only when they are still what the pass asks for (a re-split resume, CTAugment's reloaded weights)."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe import Recipe
from gpupipe.data.position import ResumeNotice

from .common_utils import DECODERS, make_folder, photo
from .test_augment_feedback import _feedback
from .test_cpu_batch import _Logged
from .test_nvjpeg import _CpuNvjpegLoader

KW = dict(batch_size=4, image_size=32, device="cpu", normalize=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """4 classes x 6 JPEGs: 6 batches of 4 an epoch."""
    return make_folder(tmp_path_factory.mktemp("stream"), 4, 6)


@pytest.fixture()
def dataloader_iterations(monkeypatch):
    """How many times a DataLoader was iterated (``iter()``: each starts its workers or resets them)."""
    count = [0]
    real = torch.utils.data.DataLoader.__iter__

    def counted(self):
        count[0] += 1
        return real(self)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", counted)
    return count


def _epochs_left_early(loader, epochs: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As ``gpupipe train --accum 2`` with an odd number of batches: each pass left one batch early, then the next
    epoch set."""
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        it = iter(loader)
        out += [next(it) for _ in range(len(loader) - 1)]
        loader.set_epoch(epoch + 1)
    return out


def _each_epoch_on_its_own(data, backend, epochs: int = 3, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches, each epoch read by a loader of its own: nothing read ahead, nothing carried over."""
    out = []
    for epoch in range(epochs):
        loader = gpupipe.build_loader(data, backend, num_workers=0, **{**KW, **kw})
        loader.set_epoch(epoch)
        out += list(loader)[:-1]
    return out


def _assert_same(got, expected) -> None:
    assert len(got) == len(expected)
    for k, ((x, y), (ex, ey)) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(y, ey) and torch.equal(x, ex), k


@pytest.mark.parametrize("backend", DECODERS)
@pytest.mark.parametrize("workers", [0, 2])
def test_passes_left_early_are_one_dataloader_iteration_with_each_epochs_own_batches(
    data, backend, workers, dataloader_iterations
):
    loader = gpupipe.build_loader(data, backend, num_workers=workers, **KW)
    got = _epochs_left_early(loader)
    assert dataloader_iterations[0] == 1  # was 3: one iter() a pass, each epoch opening cold
    _assert_same(got, _each_epoch_on_its_own(data, backend))
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["batch"] == 0


def _nvjpeg(data, workers: int, **kw) -> _CpuNvjpegLoader:
    """nvjpeg's loader whole (workers reading bytes and headers, the decode thread, batched crops), on the CPU."""
    return _CpuNvjpegLoader(gpupipe.build_loader(data, "pillow", num_workers=workers, **{**KW, **kw}).parts)


def _build(data, backend: str, workers: int, **kw):
    """``backend``'s loader; nvjpeg's on the CPU (:func:`_nvjpeg`)."""
    if backend == "nvjpeg":
        return _nvjpeg(data, workers, **kw)
    return gpupipe.build_loader(data, backend, num_workers=workers, **{**KW, **kw})


@pytest.mark.parametrize("workers", [0, 2])
def test_nvjpeg_passes_left_early_are_one_dataloader_iteration_with_each_epochs_own_batches(
    data, workers, dataloader_iterations
):
    """nvjpeg's workers stream as the CPU decoders' do, its decode thread taking each pass's batches from the
    stream (the one left early handed over to the next pass's)."""
    loader = _nvjpeg(data, workers)
    got = _epochs_left_early(loader)
    assert dataloader_iterations[0] == 1  # was 3
    expected = []
    for epoch in range(3):
        fresh = _nvjpeg(data, 0)
        fresh.set_epoch(epoch)
        expected += list(fresh)[:-1]
    _assert_same(got, expected)
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["batch"] == 0


def test_workers_a_pass_when_asked_still_deliver_each_epochs_batches(data, dataloader_iterations):
    """``persistent_workers=False``: the workers end with each pass, as asked, and a pass left early drops its rest."""
    loader = gpupipe.build_loader(data, "pillow", num_workers=2, persistent_workers=False, **KW)
    got = _epochs_left_early(loader)
    assert dataloader_iterations[0] == 3
    _assert_same(got, _each_epoch_on_its_own(data, "pillow"))


@pytest.mark.parametrize("backend", ["pillow", "nvjpeg"])
def test_an_eval_loader_streams_its_passes_unpadded(data, backend, dataloader_iterations):
    loader = _build(data, backend, 2, train=False, batch_size=5)
    labels = [[int(v) for _, y in loader for v in y] for _ in range(3)]
    assert labels[0] == [label for _, label in loader.dataset.samples] and labels[1:] == labels[:2]
    assert [len(y) for _, y in loader] == [5, 5, 5, 5, 4]
    assert dataloader_iterations[0] == 1


class _MadeAt:
    """A per-image transform that writes, into the image's first 8 bytes, when it was made (in the worker), and
    counts the images made in a file (so a test can see the workers go idle)."""

    def __init__(self, log):
        self.log = str(log)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image = image.contiguous().clone()
        image.view(-1)[:8] = torch.from_numpy(np.array([time.monotonic_ns()], np.int64).view(np.uint8))
        with open(self.log, "a") as f:
            f.write("x\n")
        return image


def _made_at(images: torch.Tensor) -> int:
    return int(images[0].contiguous().view(-1)[:8].numpy().view(np.int64)[0])


def _until_idle(log, quiet: float = 0.5, limit: float = 30.0) -> None:
    """Wait until no image was made for ``quiet`` seconds (the workers made what they were given)."""
    deadline, seen, since = time.monotonic() + limit, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(log.read_text().splitlines()) if log.exists() else 0
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since > quiet:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("backend", DECODERS)
def test_the_next_epochs_first_batches_are_made_before_the_pass_is_left(data, backend, tmp_path):
    """Each epoch's first batch was made while the previous pass, left one batch early, was still under way: the
    first ``next()`` of an epoch takes a made batch, as one mid-epoch does."""
    log = tmp_path / "made.log"
    loader = gpupipe.build_loader(data, backend, num_workers=2, transforms=_MadeAt(log), **KW)
    left = []
    firsts = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        it = iter(loader)
        firsts.append(_made_at(next(it)[0]))
        for _ in range(len(loader) - 2):
            next(it)
        _until_idle(log)
        left.append(time.monotonic_ns())
        loader.set_epoch(epoch + 1)
    assert firsts[1] < left[0] and firsts[2] < left[1]


def test_nvjpeg_reads_the_next_epochs_first_batches_before_the_pass_is_left(data, tmp_path):
    """nvjpeg's workers read the next epoch's first batches while a pass left one batch early ends: the first
    ``next()`` of the epoch takes bytes already read, as one mid-epoch does."""
    log = tmp_path / "read.log"
    loader = _nvjpeg(data, 2)
    loader._data.dataset = _Logged(loader._data.dataset, log)  # a line a file read
    it = iter(loader)
    for _ in range(len(loader) - 1):
        next(it)
    _until_idle(log)
    assert len(log.read_text().splitlines()) > len(loader) * KW["batch_size"]  # was the epoch's own files only


def test_nvjpeg_reads_a_file_changed_after_its_read_ahead_as_it_is_when_its_pass_runs(tmp_path):
    root = make_folder(tmp_path / "data", 4, 6)
    log = tmp_path / "read.log"
    loader = _nvjpeg(root, 2)
    loader._data.dataset = _Logged(loader._data.dataset, log)
    it = iter(loader)
    for _ in range(len(loader) - 1):
        next(it)
    _until_idle(log)  # epoch 1's first batches read
    assert len(log.read_text().splitlines()) > len(loader) * KW["batch_size"]
    path = loader._data.dataset.samples[loader.sampler.batches(1)[0][0]][0]
    photo(np.random.default_rng(7), 64, 80).save(path, quality=80)  # another image, another size
    loader.set_epoch(1)
    got = next(iter(loader))
    fresh = _nvjpeg(root, 0)
    fresh.set_epoch(1)
    _assert_same([got], [next(iter(fresh))])


def _resplit_state(data) -> dict:
    """A state saved at epoch 1, sample 6, by a loader of batch 3: another batch size re-splits the epoch's rest."""
    saver = gpupipe.build_loader(data, "pillow", num_workers=0, **{**KW, "batch_size": 3})
    saver.set_epoch(1)
    it = iter(saver)
    next(it), next(it)
    return pickle.loads(pickle.dumps(saver.state_dict()))


@pytest.mark.parametrize("backend", [*DECODERS, "nvjpeg"])
def test_batches_read_ahead_are_not_delivered_after_a_resume_that_re_splits_the_epoch(data, backend):
    state = _resplit_state(data)
    fresh = _build(data, backend, 0)
    with pytest.warns(ResumeNotice):
        fresh.load_state_dict(state)
    expected = list(fresh)
    streaming = _build(data, backend, 2)
    list(streaming)  # epoch 0 whole: epoch 1's first batches are read ahead, as the sampler dealt them then
    with pytest.warns(ResumeNotice):
        streaming.load_state_dict(state)
    _assert_same(list(streaming), expected)


def _ct(data, aa="ctaugment", **kw):
    args = {**KW, "num_workers": 1, "prefetch_factor": 1, "seed": 3, **kw}
    return gpupipe.build_loader(data, "pillow", recipe=Recipe(32, auto_augment=aa), **args)


def test_ctaugment_draws_in_workers_across_passes_left_early_as_each_pass_on_its_own(data):
    """The workers draw each batch from the snapshot its clock names, batches read ahead included: a run whose
    passes are left early delivers what a run that loads the same state before each pass does."""
    streaming = _ct(data)
    got, states = [], []
    for epoch in range(3):
        streaming.set_epoch(epoch)
        it = iter(streaming)
        for _ in range(len(streaming) - 1):
            got.append(next(it))
            _feedback(streaming.ctaugment, len(got))
        streaming.set_epoch(epoch + 1)
        states.append(pickle.loads(pickle.dumps(streaming.state_dict())))
    expected = []
    for epoch in range(3):
        fresh = _ct(data)
        if epoch:
            fresh.load_state_dict(states[epoch - 1])
        it = iter(fresh)
        for _ in range(len(fresh) - 1):
            expected.append(next(it))
            _feedback(fresh.ctaugment, len(expected))
    _assert_same(got, expected)


def test_ctaugment_batches_read_ahead_are_drawn_again_after_loading_other_weights(data):
    fast = "ctaugment-d0.5"  # rates that move at once: another run's weights draw other ops
    other = _ct(data, fast)
    for k, _ in enumerate(other):
        _feedback(other.ctaugment, k)
    state = pickle.loads(pickle.dumps(other.state_dict()))  # epoch 1 from its start, other weights
    fresh = _ct(data, fast)
    fresh.load_state_dict(state)
    expected = list(fresh)
    streaming = _ct(data, fast)
    list(streaming)  # epoch 1's first batch is drawn ahead, from this run's weights (never updated)
    streaming.load_state_dict(state)
    _assert_same(list(streaming), expected)
    unloaded = _ct(data, fast)
    unloaded.set_epoch(1)
    assert not torch.equal(next(iter(unloaded))[0], expected[0][0])  # what the batch read ahead held


def test_each_epoch_is_shuffled_and_dealt_once(data, monkeypatch):
    """An epoch's order (a shuffle of the whole data set: tens of milliseconds at ImageNet's size, on the training
    thread) is made once, by the plan running into it, not again by each pass that starts there and its sizes."""
    from gpupipe.data.sampler import ShardSampler

    dealt = []
    real = ShardSampler.order
    monkeypatch.setattr(ShardSampler, "order", lambda self, epoch: dealt.append(epoch) or real(self, epoch))
    loader = gpupipe.build_loader(data, "pillow", num_workers=2, **KW)
    _epochs_left_early(loader)
    assert sorted(set(dealt)) == dealt and dealt[:3] == [0, 1, 2]  # each once, in order (3 if read ahead)


@pytest.mark.parametrize("backend", DECODERS)
def test_without_a_pin_thread_batches_are_taken_off_the_workers_on_the_loaders_own_thread(data, backend, monkeypatch):
    """Where batches go to a device and no pin thread takes them (the meta device, which stands in for CUDA; CUDA with
    ``pin_memory=False``), each is unpickled off the workers' queue and copied out of its worker's buffer on the
    loader's own thread, one batch ahead, as DataLoader's pin thread does on CUDA: the training thread takes it ready
    (turbojpeg's simulated step: next() 2.8 -> 1.6 ms a 32-batch). On a CPU device (the copy is the batch's last step
    there) and with no workers, the training thread takes them itself."""
    import threading

    from gpupipe.backends.cpu_stream import Stream
    from gpupipe.bench.host_budget import meta_loader

    takers: list[str] = []
    real = Stream._next
    monkeypatch.setattr(Stream, "_next", lambda self: takers.append(threading.current_thread().name) or real(self))
    on_meta = meta_loader(str(data), backend, Recipe(32), 4, 1)
    assert len(list(on_meta)) == len(on_meta) and set(takers) == {"gpupipe-take"} and on_meta.thread_cpu[0] > 0
    for workers in (0, 1):
        takers.clear()
        on_cpu = gpupipe.build_loader(data, backend, num_workers=workers, **KW)
        assert len(list(on_cpu)) == len(on_cpu) and set(takers) == {threading.current_thread().name}
    no_workers = meta_loader(str(data), backend, Recipe(32), 4, 0)
    takers.clear()
    assert len(list(no_workers)) == len(no_workers) and set(takers) == {threading.current_thread().name}


@pytest.mark.slow
def test_a_take_thread_outliving_its_dropped_loader_is_still_ended_at_exit(data):
    """A loader dropped mid-pass stops its take thread, which ends after the batch it waits for; the exit hook must
    still end it if the process exits first: a daemon thread inside torch's C++ copy when the interpreter finalizes
    aborts the process ("terminate called without an active exception", status 134: seen 1 run in 5 before). Run in
    a process of its own, where no other test's thread is running."""
    import subprocess
    import sys

    code = f"""
import gc
from gpupipe.plumbing.decode_ahead import DecodeAhead
from gpupipe.bench.host_budget import meta_loader
from gpupipe.recipe import Recipe
loader = meta_loader({str(data)!r}, "pillow", Recipe(32), 4, 1)
it = iter(loader)
next(it)
thread = loader._ahead._thread
del it, loader
gc.collect()
DecodeAhead._close_all()  # what the exit hook runs
print("alive" if thread.is_alive() else "ended")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["ended"], done.stderr


@pytest.mark.slow  # a fresh interpreter, run to its exit
def test_what_a_decode_thread_drops_on_its_way_out_is_finalized_before_the_interpreter():
    """A decode thread drops what it was given as it ends (``Thread.run`` deletes its arguments): the dali loader's
    ``_deliver`` holds the loader, and a dropped loader's DALI pipeline then shuts down on that thread, in C++. The
    exit hook waits for it: ended at finalization instead, it aborted the process ("terminate called without an
    active exception", seen 1 run in 5 of ``gpupipe.bench.sim_step``). Here a slow ``__del__`` stands in for it."""
    import subprocess
    import sys

    code = """
import time
import torch
from gpupipe.plumbing.decode_ahead import DecodeAhead

class Pipeline:
    def decode(self, work):
        return work
    def __del__(self):
        time.sleep(0.5)  # a shutdown that waits for its own threads, the GIL released
        print("shut down", flush=True)

pipeline = Pipeline()
ahead = DecodeAhead(iter(range(3)), pipeline.decode, torch.device("cpu"), lambda r: [])
del pipeline
assert list(ahead) == [0, 1, 2]
del ahead  # the thread, about to end, holds the pipeline last
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["shut", "down"], (done.stdout, done.stderr)
