"""backend="dali" keeps the whole contract: the recipe's own crops (so pixels agree with pillow), exact resume, one
pipeline per loader. Runs DALI's CPU pipelines (``device="cpu"``); the ``gpu`` tests run the same on CUDA."""

import io
import os
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe.backends import handover
from gpupipe.recipe import Recipe

from .common_utils import assert_resume_is_exact, cpu_and_cuda, ctrl_c_mid_pass, decode_tolerance, encoded, photo

pytestmark = pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="DALI is not installed")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Photo-like JPEGs of ImageNet-like sizes, two of them with an EXIF orientation that turns them."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(11)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for i in range(10):
            h, w = [(375, 500), (500, 375), (300, 420)][i % 3]
            exif = Image.Exif()
            if i in (4, 7):
                exif[0x0112] = 6 if i == 4 else 8
            photo(rng, h, w).save(root / f"c{c}" / f"{i:02d}.jpg", quality=92, exif=exif)
    return root


@pytest.fixture(scope="module")
def photo_shards(photos, tmp_path_factory):
    """The photos as tar shards: read through the feed (DALI reads only local files itself)."""
    from gpupipe.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("photo-shards") / "out"
    prepare(photos, out, PrepareOptions(), workers=1)
    return out


def _all(loader):
    batches = list(loader)
    return torch.cat([x.cpu() for x, _ in batches]).float(), torch.cat([y.cpu() for _, y in batches])


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("workers", [1, 2])  # DALI's threads (and at 2, header-scan processes)
def test_dali_uses_the_recipes_boxes(photos, device, train, workers):
    kw = dict(batch_size=8, train=train, image_size=224, num_workers=workers, normalize=False, seed=3)
    dali = gpupipe.build_loader(photos, "dali", device=device, **kw)
    pillow = gpupipe.build_loader(photos, "pillow", device="cpu", **kw)
    for epoch in (0, 1):
        dali.set_epoch(epoch)
        pillow.set_epoch(epoch)
        (x, y), (rx, ry) = _all(dali), _all(pillow)
        assert torch.equal(y, ry)
        per_image = (x - rx).abs().mean(dim=(1, 2, 3))
        # same crop and flip; only interpolation differs (and on CUDA, the JPEG decode: GPU_DECODE_SLACK)
        assert per_image.max() <= decode_tolerance(device, 2.0), per_image


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_dali_resumes_mid_epoch_with_identical_pixels(photos, device):
    kw = dict(batch_size=4, train=True, image_size=64, num_workers=1, normalize=False, seed=9, device=device)
    assert_resume_is_exact(lambda: gpupipe.build_loader(photos, "dali", **kw), epoch=1, batch=2)


def test_one_pipeline_per_loader_across_epochs(photos):
    for train in (True, False):
        loader = gpupipe.build_loader(
            photos, "dali", batch_size=8, train=train, image_size=32, num_workers=1, device="cpu"
        )
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sum(len(y) for _, y in loader) == (16 if train else 20)
        assert loader.pipelines_built == 1


def test_only_the_failing_file_leaves_dali(tmp_path):
    """A batch DALI fails on is narrowed by Pillow: the bad file is reported, its batch-mates still decode in DALI
    (a fresh pipeline), and later batches carry on."""
    rng = np.random.default_rng(2)
    (tmp_path / "a").mkdir()
    for i in range(8):
        photo(rng, 80, 100).save(tmp_path / "a" / f"{i}.jpg", quality=90)
    buf = io.BytesIO()
    photo(rng, 80, 100).save(buf, "JPEG", quality=90, progressive=True)
    corrupt = bytearray(buf.getvalue())  # its header sound (given to DALI), its second scan's overwritten
    second_scan = corrupt.find(b"\xff\xda", corrupt.find(b"\xff\xda") + 2)
    corrupt[second_scan + 2 : second_scan + 12] = bytes(range(250, 256)) + bytes(4)
    (tmp_path / "a" / "3.jpg").write_bytes(corrupt)
    loader = gpupipe.build_loader(
        tmp_path, "dali", batch_size=4, train=False, image_size=32, num_workers=1, device="cpu", on_error="skip"
    )
    assert sum(len(y) for _, y in loader) == 7
    assert [p.rsplit("/", 1)[-1] for p, _ in loader.skipped] == ["3.jpg"]
    assert loader.fallbacks == 0  # nothing was left to Pillow but the verdict
    assert loader.pipelines_built == 2  # DALI's failure invalidated the first pipeline


def test_an_empty_batch_is_made_only_for_a_batch_with_no_image_left(tmp_path, monkeypatch):
    """A batch of decoded images is assembled from them alone (making an empty batch for every batch cost the loader's
    thread an allocation each); a batch whose every file is bad is the empty batch (then left out)."""
    from gpupipe.backends import dali as dali_backend

    made = []
    real = dali_backend.empty_batch
    monkeypatch.setattr(dali_backend, "empty_batch", lambda *a, **k: made.append(1) or real(*a, **k))
    rng = np.random.default_rng(4)
    (tmp_path / "a").mkdir()
    for i in range(4):
        photo(rng, 60, 80).save(tmp_path / "a" / f"{i}.jpg", quality=90)
    for i in range(4, 8):
        (tmp_path / "a" / f"{i}.jpg").write_bytes(b"not a jpeg")
    loader = gpupipe.build_loader(
        tmp_path, "dali", batch_size=4, train=False, image_size=32, num_workers=1, device="cpu", on_error="skip"
    )
    shapes = [(tuple(x.shape), x.dtype) for x, _ in loader]
    assert shapes == [((4, 3, 32, 32), torch.float32)]  # the empty batch is not delivered
    assert len(made) == 1 and len(loader.skipped) == 4


@pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="DALI is not installed")
def test_worker_forked_beside_a_dead_dali_pipeline_does_not_hang(folder):
    """A DALI pipeline left in a garbage cycle used to be freed inside the next forked DataLoader worker, where its
    shutdown waited for threads that only exist in the parent: the worker hung before its first batch."""
    import gc

    from gpupipe.backends.dali_graph import build_pipeline
    from gpupipe.backends.gpu_feed import eval_windows

    files = [str(p) for p in sorted(folder.rglob("*.jpg"))][:2]
    pipe = build_pipeline(Recipe(32), train=False, batch_size=2, device=torch.device("cpu"), num_threads=1)
    pipe.feed_input("enc", [np.fromfile(f, dtype=np.uint8) for f in files])
    sizes = np.array([Image.open(f).size[::-1] for f in files])
    _feed_crops(pipe, Recipe(32), False, eval_windows(Recipe(32), sizes[:, 0], sizes[:, 1]))
    pipe.run()
    pipe.cycle = pipe  # unreachable once deleted, but only the cycle collector frees it
    gc.disable()
    try:
        del pipe
        loader = torch.utils.data.DataLoader(
            range(4), batch_size=2, num_workers=1, timeout=60, worker_init_fn=lambda _: gc.collect()
        )
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    finally:
        gc.enable()
        gc.collect()


def test_the_next_epoch_is_scheduled_before_this_one_ends(photos):
    """DALI never runs dry at an epoch edge: the next epoch's first batches are in flight when the last ones are
    delivered, and what they hold is what a fresh loader gives for that epoch (or they are dropped: set_epoch)."""
    kw = dict(batch_size=4, train=True, image_size=48, num_workers=1, normalize=False, seed=4, device="cpu")

    def epoch_of_fresh(epoch):
        fresh = gpupipe.build_loader(photos, "dali", **kw)
        fresh.set_epoch(epoch)
        return list(fresh)

    loader = gpupipe.build_loader(photos, "dali", **kw)
    list(loader)
    assert [(w.epoch, w.number, w.scheduled) for w in loader._carry] == [(1, k, True) for k in range(4)]
    for (a, la), (b, lb) in zip(list(loader), epoch_of_fresh(1), strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    loader.set_epoch(5)  # not the epoch scheduled ahead (2): those batches are dropped
    for (a, la), (b, lb) in zip(list(loader), epoch_of_fresh(5), strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert loader.pipelines_built == 1


def _restarts(monkeypatch) -> list:
    """The feed streams restarted (a new plan: what was in flight dropped), each time it happens."""
    from gpupipe.backends.dali_files import FileStream
    from gpupipe.backends.dali_stream import FeedStream

    restarts = []
    for stream in (FeedStream, FileStream):

        def restart(self, requests, real=stream.restart):
            restarts.append(self)
            return real(self, requests)

        monkeypatch.setattr(stream, "restart", restart)
    return restarts


@pytest.mark.parametrize("source", ["folder", "shards"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_pass_left_one_batch_short_goes_on_into_the_next_epoch(photos, photo_shards, monkeypatch, workers, source):
    """``gpupipe train --accum 2`` takes all but the last batch of an odd epoch: the stream of batches still goes on
    into the next epoch (its first batches already decoded), with no restart of the feed nor a new pipeline, and the
    batches are those of full passes; a resume mid-epoch after such passes is exact."""
    restarts = _restarts(monkeypatch)
    data = photos if source == "folder" else photo_shards
    kw = dict(batch_size=4, train=True, image_size=32, num_workers=workers, normalize=False, seed=5, device="cpu")
    loader = gpupipe.build_loader(data, "dali", **kw)
    straight = gpupipe.build_loader(data, "dali", **kw)
    for epoch in range(3):
        it = iter(loader)
        short = [next(it) for _ in range(len(loader) - 1)]
        del it
        straight.set_epoch(epoch)
        for (a, la), (b, lb) in zip(short, list(straight)[:-1], strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb)
    loader._ahead.join()  # the pass's thread, which may have made the epoch's last batch ahead (then dropped)
    assert restarts.count(loader._feed) == 1 and loader.pipelines_built == 1
    ahead = [(w.epoch, w.number) for w in loader._carry]
    assert (3, 0) in ahead and min(ahead) >= (2, 4)  # the next epoch's start is made
    assert loader._scheduled == sum(bool(w.gpu) for w in loader._carry)  # none taken and lost
    loader.load_state_dict({"epoch": 3, "batch": 2})  # not where the stream stands: it restarts there
    straight.set_epoch(3)
    for (a, la), (b, lb) in zip(list(loader), list(straight)[2:], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert restarts.count(loader._feed) == 2


@pytest.mark.parametrize("beyond", [0, 1])
def test_a_pass_left_up_to_the_limit_short_goes_on_and_one_left_more_restarts(photos, monkeypatch, beyond):
    """A pass left a few batches short: the loader's thread made the next two during the step (one waiting, one in
    hand: dropped with the pass), and the next pass fetches and drops the ``_LEFT_OVER`` after them and goes on with
    the works in flight (no restart of the feed); one left a batch more drops everything in flight and restarts the
    feed at its first batch.
    Either way its batches are a fresh loader's, and a whole pass after it starts warm: its first batch was scheduled
    in DALI before it began."""
    from gpupipe.backends.dali import _LEFT_OVER, DaliLoader

    scheduled, lost = [], []
    submit, decoded_or_lost = DaliLoader._submit, DaliLoader._decoded_or_lost
    monkeypatch.setattr(DaliLoader, "_submit", lambda self, w: scheduled.append((self, w.tag)) or submit(self, w))
    monkeypatch.setattr(
        DaliLoader, "_decoded_or_lost", lambda self, w: lost.append((self, w.tag)) or decoded_or_lost(self, w)
    )
    restarts = _restarts(monkeypatch)
    kw = dict(batch_size=2, train=True, image_size=32, num_workers=0, normalize=False, seed=5, device="cpu")
    loader = gpupipe.build_loader(photos, "dali", **kw)
    left = 2 + _LEFT_OVER + beyond
    it = iter(loader)
    for _ in range(len(loader) - left):
        next(it)
    deadline = time.monotonic() + 30  # the step: the thread takes the next works, up to its full queue
    while loader._carry.owed() > _LEFT_OVER + beyond and time.monotonic() < deadline:
        time.sleep(0.01)
    del it
    loader._ahead.join()
    assert loader._carry.owed() == _LEFT_OVER + beyond
    loader.set_epoch(1)
    got = list(loader)
    assert restarts.count(loader._feed) == 1 + beyond and loader.pipelines_built == 1
    if not beyond:
        assert [tag for who, tag in lost if who is loader] == [
            (0, k) for k in range(len(loader) - _LEFT_OVER, len(loader))
        ]
    fresh = gpupipe.build_loader(photos, "dali", **kw)
    fresh.set_epoch(1)
    for (a, la), (b, lb) in zip(got, list(fresh), strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)
    loader._ahead.join()
    assert (loader, (2, 0)) in scheduled  # before epoch 2's pass
    loader.set_epoch(2)
    assert len(list(loader)) == len(loader) and restarts.count(loader._feed) == 1 + beyond


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_outputs_are_handed_to_the_loader_threads_stream(photos, device):
    """DALI's outputs are bound to the stream of the loader's thread on CUDA (without one, ``share_outputs`` makes the
    host wait for DALI's stream every batch; torch's current stream waits for that one on the GPU), to none on the
    CPU; the images are the same either way."""
    loader = gpupipe.build_loader(photos, "dali", batch_size=4, image_size=32, num_workers=1, device=device)
    streams = []
    it = iter(loader)
    first = next(it)[0]
    pipe = loader._pipe
    share = pipe.share

    def spy(stream):
        streams.append(stream)
        return share(stream)

    pipe.share = spy
    images = [x for x, _ in it][-1]  # (the loader's thread fetched the next one or two before the spy)
    want = loader._ahead.stream if images.is_cuda else None  # the loader thread's: torch's current one waits for it
    assert streams and all(s == want for s in streams)
    assert images.shape == first.shape and images.device.type == torch.device(device).type


def test_the_feed_sends_batches_by_name_not_by_file_descriptor(photo_shards, monkeypatch):
    """Receiving a shared-memory file descriptor costs the training thread a connection to the worker's resource
    sharer (with its authentication handshake) every batch; the feed's workers share by name instead."""
    from torch.multiprocessing import reductions

    received, real = [], reductions.rebuild_storage_fd

    def rebuild_storage_fd(*args):  # pickled by name, as the real one (the forked workers hold it too)
        received.append(1)
        return real(*args)

    rebuild_storage_fd.__module__, rebuild_storage_fd.__qualname__ = real.__module__, real.__qualname__
    monkeypatch.setattr(reductions, "rebuild_storage_fd", rebuild_storage_fd)
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    batches = [x for x, _ in loader]
    assert len(batches) == 5 and received == []


@pytest.mark.parametrize("workers", [2, 8])  # the default here (one feed worker), and two feed workers
def test_the_feed_goes_on_across_epochs_and_is_received_off_the_training_thread(photo_shards, monkeypatch, workers):
    """Epoch after epoch, the feed's DataLoader is iterated once (a new ``iter()`` each epoch would drop what its
    worker had started on, read it again and make the training thread wait for the worker's answer), and its works
    are taken from it on the feed's own thread, not the training thread; a pass that does not follow on (another
    epoch) starts the feed again, with the batches a fresh loader gives."""
    from torch.utils.data import dataloader

    resets, receivers, real_reset = [], set(), dataloader._MultiProcessingDataLoaderIter._reset
    real_next = dataloader._MultiProcessingDataLoaderIter.__next__

    def _reset(self, *args, **kwargs):
        resets.append(1)
        return real_reset(self, *args, **kwargs)

    def __next__(self):
        receivers.add(threading.current_thread().name)
        return real_next(self)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_reset", _reset)
    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__next__", __next__)
    kw = dict(batch_size=4, image_size=32, num_workers=workers, normalize=False, seed=3, device="cpu")
    loader = gpupipe.build_loader(photo_shards, "dali", **kw)
    seen = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        seen.append([y for _, y in loader])
    assert len(resets) == 1 and receivers == {"gpupipe-dali-feed"}
    loader.set_epoch(7)
    again = [y for _, y in loader]
    assert len(resets) == 2
    fresh = gpupipe.build_loader(photo_shards, "dali", **kw)
    fresh.set_epoch(7)
    assert all(torch.equal(a, b) for a, b in zip(again, [y for _, y in fresh], strict=True))
    fresh.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(seen[1], [y for _, y in fresh], strict=True))


def test_a_dropped_loader_ends_its_feed_thread_and_workers(photo_shards):
    """The feed's thread holds the DataLoader's iterator (and so its worker): a loader that is dropped mid-epoch ends
    both, rather than leaving them to the end of the process."""
    import gc
    import time

    children = __import__("multiprocessing").active_children
    before = set(children())  # (another test's loader, not yet collected, may still have its own)
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    it = iter(loader)
    next(it)
    workers = [p for p in children() if p not in before]
    assert any(t.name == "gpupipe-dali-feed" for t in threading.enumerate()) and workers
    del it, loader
    gc.collect()
    deadline = time.monotonic() + 60  # a hang guard: the thread ends within a put's 0.1 s wait
    while any(t.name == "gpupipe-dali-feed" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "gpupipe-dali-feed" for t in threading.enumerate())
    assert not handover._mapped  # the workers' buffers it kept mapped, let go of
    while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in workers)


def test_a_batch_the_feed_cannot_pad_reaches_dali_without_a_copy(tmp_path, monkeypatch):
    """Files of very different sizes are not padded to one array (the padding would outweigh the bytes): DALI then
    takes each sample where the feed's worker put it, as a TensorCPU over the shared buffer made on the feed's thread,
    not as a TensorListCPU made from the list, which copies every byte with the GIL held in the training process
    (about 7 ms a 256-batch); the images are those of the list fed with no workers."""
    from gpupipe.backends.dali import DaliLoader
    from gpupipe.prepare import PrepareOptions, prepare

    rng = np.random.default_rng(2)
    for c in range(2):
        (tmp_path / "src" / f"c{c}").mkdir(parents=True)
        for i in range(8):
            side = 200 if i == 0 else 24  # in each batch of 8, one noisy photo many times the others' bytes
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                tmp_path / "src" / f"c{c}" / f"{i}.jpg", quality=95
            )
    fed, submit, copies = [], DaliLoader._submit, []

    def zero_copy(work):
        """Whether each fed sample's data lies in the worker's buffer, at its own offset."""
        base, starts = work.encoded.data_ptr(), np.cumsum([0, *work.lengths.tolist()])[:-1]
        at = [x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr() for x in work.batch()]
        return at == [base + int(k) for k in starts]

    def spy(self, work):
        batch = work.batch()
        fed.append((type(batch).__name__, type(batch[0]).__name__ if isinstance(batch, list) else None))
        copies.append(isinstance(batch, list) and not zero_copy(work))
        return submit(self, work)

    monkeypatch.setattr(DaliLoader, "_submit", spy)
    kw = dict(batch_size=8, image_size=16, normalize=False, device="cpu", train=False)
    shards = tmp_path / "shards"
    prepare(tmp_path / "src", shards, PrepareOptions(), workers=1)  # the feed reads shards, not local files
    batches = list(gpupipe.build_loader(shards, "dali", num_workers=1, **kw))
    assert len(fed) >= 2 and set(fed) == {("list", "TensorCPU")}  # (and the next epoch's first ones, read ahead)
    assert not any(copies)
    fed.clear()
    inline = list(gpupipe.build_loader(shards, "dali", num_workers=0, **kw))  # fed as a list of numpy views
    assert len(fed) >= 2 and set(fed) == {("list", "ndarray")}
    for (a, la), (b, lb) in zip(batches, inline, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_batches_go_through_dalis_pipeline_object_not_its_python_wrapper(photos, monkeypatch):
    """The installed DALI is driven per batch through its C++ pipeline directly: the Python wrapper's ``feed_input``,
    ``schedule_run`` and ``share_outputs`` (about 0.5 ms of the training thread per batch, mostly checks that hold once
    built) are never called; the batches are the wrapper's, pixel for pixel. Driven so, DALI's operators may each hold
    two outputs (its default queue depth), so none waits for the next to let go of its last one; through the wrapper
    one (its first ``schedule_run`` would run as many batches as the depth, before the second is fed)."""
    from nvidia.dali.pipeline import Pipeline

    from gpupipe.backends.dali_graph import Driver

    def loader():
        return gpupipe.build_loader(photos, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu", seed=3)

    with monkeypatch.context() as m:
        m.setattr(Driver, "_CALLS", ("NoSuchCall",))  # as with a DALI whose pipeline object lacks the calls
        through_wrapper = loader()
        wrapped = [[x.clone() for x in batch] for batch in through_wrapper]
        assert through_wrapper._pipe is not None and through_wrapper._pipe.direct is None
        assert through_wrapper._pipe.pipe.prefetch_queue_depth == 1
    calls = []

    def spied(name):
        real = getattr(Pipeline, name)
        return lambda self, *a, **k: calls.append(name) or real(self, *a, **k)

    for name in ("feed_input", "schedule_run", "share_outputs", "release_outputs"):
        monkeypatch.setattr(Pipeline, name, spied(name))
    direct = loader()
    batches = list(direct)
    assert direct._pipe is not None and direct._pipe.direct is not None and not calls
    assert direct._pipe.pipe.prefetch_queue_depth == 2
    for (a, la), (b, lb) in zip(wrapped, batches, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize(
    "recipe, train",
    [
        (Recipe(32), True),
        (Recipe(32), False),
        (Recipe(32, crop="pad"), True),
    ],
    ids=["train", "eval", "pad"],
)
def test_no_operator_of_the_graph_derives_the_crop(recipe, train):
    """The crop's fields are fed each as the operator that reads it takes it (:func:`crop_inputs`): the graph's CPU
    operators are those that read, decode, cut, resize and normalise, none that picks a field out of a row or casts it
    (each was one more operator per batch, at which DALI's threads sleep and wake). The reflected pad crop has shape
    operators of its own, which build the reflected image (its anchor is fed shifted, checked by the pixels tests)."""
    from gpupipe.backends.dali_graph import build_pipeline, crop_inputs

    pipe = build_pipeline(recipe, train=train, batch_size=2, device=torch.device("cpu"), num_threads=1, files=True)
    ops = {op.name: getattr(op._op, "schema_name", type(op._op).__name__) for op in pipe._ops}
    assert not {"_TensorSubscript", "Cast", "ArithmeticGenericOp"} & set(ops.values()), ops
    fed = {name for name, kind in ops.items() if kind == "ExternalSource"}
    rows = np.zeros((2, 6), np.int64) if train else np.zeros((2, 8), np.float32)
    assert fed == {"paths", *crop_inputs(recipe, train, rows)}


def test_dali_keeps_no_python_object_of_the_small_inputs(photos):
    """The crop's fields and the path rows are copied by DALI as they are fed. An input read in place holds the fed
    array, and DALI lets go of it in its own threads once the batch is done with it, which takes the GIL: any Python
    running in the process (the loader's thread making the next work, the training step) then left DALI's threads
    idle with batches scheduled. Here DALI holds no fed array past the feed (the driver keeps the path rows, let go
    on the thread that fetches their batch: a fifo among them is opened if that wait is long), and the batch still
    comes out right."""
    import sys

    from gpupipe.backends.dali_files import FileTable
    from gpupipe.backends.dali_graph import Driver, build_pipeline, crop_inputs
    from gpupipe.sources.open import open_source

    dataset = open_source(photos)
    chosen = np.arange(2)
    recipe = Recipe(32)
    graph = build_pipeline(recipe, train=True, batch_size=2, device=torch.device("cpu"), num_threads=1, files=True)
    pipe = Driver(graph)
    sides = [Image.open(dataset.samples[k][0]).size for k in chosen]
    crops = np.array([[0, 0, h // 2, w // 2, k, 32] for k, (w, h) in enumerate(sides)], np.int64)
    fed = {"paths": FileTable(dataset, 10**8).paths(chosen), **crop_inputs(recipe, True, crops)}
    held = {name: sys.getrefcount(fed[name]) for name in fed}
    for name in fed:
        pipe.feed(name, fed[name])
    assert {name: sys.getrefcount(fed[name]) - (name == "paths") for name in fed} == held
    pipe.run()
    (out,) = pipe.share(None)
    assert np.array(out.as_tensor()).shape == (2, 3, 32, 32)
    pipe.release()
    assert {name: sys.getrefcount(fed[name]) for name in fed} == held


def test_dalis_threads_run_below_the_training_thread_where_batches_go_to_a_gpu(photos):
    """DALI decodes in threads of the training process: where batches go to a device other than the CPU they run
    WORKER_NICENESS below it, as the decode workers of the other backends do, and under SCHED_IDLE (its threads
    outnumber the cores left beside the training thread, and a thread only nicer still takes that thread's core when
    it wakes), so the thread that launches the GPU's work never waits behind a decode; on the CPU (the model computes
    beside them) they keep its priority and policy."""
    import dataclasses
    import os

    from gpupipe._system import WORKER_NICENESS

    def thread_ids() -> set[int]:  # this process's threads (Linux task ids)
        return {int(t) for t in os.listdir("/proc/self/task")}

    def thread_name(tid: int) -> str:  # as the kernel keeps it; "" once it is gone
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""

    from gpupipe.backends import get
    from gpupipe.data.device import DeviceStage

    def dali_threads(device):
        recipe = Recipe(32)
        loader = gpupipe.build_loader(photos, "dali", batch_size=4, num_workers=2, device="cpu", recipe=recipe)
        if device != "cpu":
            stage = DeviceStage(torch.device(device), recipe)
            loader = get("dali").make_loader(dataclasses.replace(loader.parts, stage=stage))
        before = thread_ids()
        next(iter(loader))
        new = thread_ids() - before
        return [(os.getpriority(os.PRIO_PROCESS, t), os.sched_getscheduler(t)) for t in new if "DALI" in thread_name(t)]

    base, policy = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)
    assert dali_threads("cpu") and all(p == (base, policy) for p in dali_threads("cpu"))
    lowered = dali_threads("meta")
    assert lowered and all(p == (min(19, base + WORKER_NICENESS), os.SCHED_IDLE) for p in lowered)


def test_the_training_thread_only_takes_finished_batches(photos, photo_shards, monkeypatch):
    """Feeding DALI (each batch's rows and paths, or the feed's works), running, fetching and assembling its batches
    happen on the loader's own thread: the training thread's ``next()`` only takes a finished batch (about 1.2 ms
    of its time per 256-batch when it did all this itself); its CPU time is counted in ``loader.thread_cpu``."""
    from gpupipe.backends.dali import DaliLoader
    from gpupipe.backends.dali_files import FileStream
    from gpupipe.backends.dali_graph import Driver
    from gpupipe.backends.dali_stream import FeedStream

    callers = set()

    def spied(cls, name):
        real = getattr(cls, name)
        return lambda self, *a, **k: callers.add(threading.current_thread().name) or real(self, *a, **k)

    for cls, name in [(Driver, "feed"), (Driver, "run"), (Driver, "share"), (Driver, "release"), (FileStream, "next")]:
        monkeypatch.setattr(cls, name, spied(cls, name))
    for cls, name in [(FeedStream, "next"), (DaliLoader, "_assemble")]:
        monkeypatch.setattr(cls, name, spied(cls, name))
    for data in (photos, photo_shards):
        loader = gpupipe.build_loader(data, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
        for _ in range(2):
            assert len(list(loader)) == len(loader)
        assert loader.thread_cpu[0] > 0
    assert callers == {"gpupipe-dali"}


def test_a_collected_loaders_feed_thread_is_waited_for_at_exit(photo_shards, monkeypatch):
    """A loader from shards collected in a reference cycle: its feed's receiving thread was told to stop but not
    waited for, and a script that ended right after ``gc.collect()`` aborted while that thread still let go of the
    workers' buffers and their DataLoader iteration ("terminate called without an active exception", or the
    iteration's semaphores reported leaked), 6 runs of 10. The exit hook now waits for such threads too."""
    import gc

    from gpupipe.backends.dali_stream import _Receiver

    monkeypatch.setattr(_Receiver, "_orphans", [])
    monkeypatch.setattr(_Receiver, "_exiting", False)  # the hook run below sets it
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=2, device="cpu")
    next(iter(loader))
    loader.me = loader  # type: ignore[attr-defined]
    receiving = [t for t in threading.enumerate() if t.name == "gpupipe-dali-feed"]
    assert receiving
    del loader
    gc.collect()
    assert set(receiving) <= set(_Receiver._orphans)  # told to stop, and kept for the exit hook
    _Receiver._stop_all()  # as at exit
    assert not any(t.is_alive() for t in receiving)


def test_the_exit_hook_waits_for_the_feed_threads_within_one_deadline(monkeypatch):
    """Feed threads that do not end: the exit hook waits for them all within its one bound (5 s), not 5 s each in
    turn (three such threads held the exit for 15 s)."""
    from gpupipe.backends import dali_stream

    clock = [0.0]
    waits: list[float] = []

    class Stuck:
        def is_alive(self) -> bool:
            return True

        def join(self, timeout: float) -> None:
            waits.append(timeout)
            clock[0] += timeout

    monkeypatch.setattr(dali_stream.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(dali_stream._Receiver, "_orphans", [Stuck(), Stuck(), Stuck()])
    monkeypatch.setattr(dali_stream._Receiver, "_exiting", False)
    dali_stream._Receiver._stop_all(timeout=5.0)
    assert len(waits) == 3 and sum(waits) == 5.0


def test_a_loader_collected_after_the_exit_hook_has_its_feed_thread_waited_for(photo_shards, monkeypatch):
    """A loader from shards in a reference cycle collected after the exit hook has run (as the interpreter ends): its
    feed's receiving thread was told to stop and kept for a hook that had run already, so the process could end while
    the thread still let go of the workers' buffers. Its finalizer now waits for it."""
    import gc

    from gpupipe.backends.dali_stream import _Receiver

    monkeypatch.setattr(_Receiver, "_orphans", [])
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=2, device="cpu")
    next(iter(loader))
    loader.me = loader  # type: ignore[attr-defined]
    receiving = [t for t in threading.enumerate() if t.name == "gpupipe-dali-feed"]
    assert receiving
    monkeypatch.setattr(_Receiver, "_exiting", True)  # as after the hook
    del loader
    gc.collect()
    assert not any(t.is_alive() for t in receiving)


_IGNORING_CTRL_C = """
import signal, sys, time
import gpupipe
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started so, as ``nohup cmd &`` starts a script
loader = gpupipe.build_loader(sys.argv[1], "dali", batch_size=4, image_size=16, num_workers=2, device="cpu")
seen = 0
for epoch in range(3):
    for k, (_, labels) in enumerate(loader):
        seen += len(labels)
        if epoch == 1 and k == 1:
            print("in the second pass", flush=True)
        time.sleep(0.05)
print("done", seen, flush=True)
"""


@pytest.mark.slow  # a script run for three passes
def test_a_script_that_ignores_ctrl_c_reads_on_through_one_sent_to_its_group(photo_shards):
    """A script started with SIGINT ignored (``nohup``), reading shards through the feed's workers, gets a Ctrl-C sent
    to its process group: it reads on to its end. The workers, forked by the zygote, took Python's own SIGINT handler
    back and died of it: "DataLoader worker (pid(s) ...) exited unexpectedly", 1 run of 1."""
    code, out, err = ctrl_c_mid_pass(_IGNORING_CTRL_C, photo_shards, ignored=True, after=0.2)
    assert (code, out) == (0, f"done {3 * 4 * (20 // 4)}\n"), err


def _buffers_handed_back_while_dali_reads(monkeypatch) -> list[int]:
    """Spies that note each feed worker's buffer handed back (to be written again) while a batch DALI reads in place
    from it is still in flight: scheduled, and neither fetched nor ended by a shut-down of its pipeline."""
    from nvidia.dali.pipeline import Pipeline

    from gpupipe.backends.dali import DaliLoader

    in_dali: list[int] = []  # the leases of the batches in flight, oldest first
    early: list[int] = []
    submit, fetch, shutdown = DaliLoader._submit, DaliLoader._fetch, Pipeline._shutdown
    give_back = handover._Lease.give_back

    def submitted(self, work):
        submit(self, work)
        if work.lease is not None:
            in_dali.append(id(work.lease))

    def fetched(self):
        out = fetch(self)
        if in_dali:
            in_dali.pop(0)
        return out

    def shut(self):
        shutdown(self)
        in_dali.clear()

    def given_back(self):
        if self._flat is not None and id(self) in in_dali:
            early.append(id(self))
        give_back(self)

    monkeypatch.setattr(DaliLoader, "_submit", submitted)
    monkeypatch.setattr(DaliLoader, "_fetch", fetched)
    monkeypatch.setattr(Pipeline, "_shutdown", shut)  # (also DALI's own ``__del__``'s)
    monkeypatch.setattr(handover._Lease, "give_back", given_back)
    return early


@pytest.mark.parametrize("end", ["close", "error", "drop", "cycle"])
def test_a_feed_workers_buffer_goes_back_only_once_dali_is_done_with_it(photo_shards, monkeypatch, end):
    """From shards (and Parquet, object storage) DALI reads each batch's bytes in place, in the buffer its feed worker
    wrote (no copy), which goes back to the worker once the batch's work is dropped. A pass's end with batches still
    scheduled (the next epoch's first ones, at the end of an epoch) dropped them while DALI still decoded them: at
    ``close()`` (the worker wrote over them as it stopped: "Not a JPEG file", a crop window past another image's
    edges, on stderr), after an error, and when the loader was dropped. The pipeline now holds them until the batch is
    fetched or the pipeline shut down (dropped: a while after DALI's own shut-down)."""
    import gc

    from gpupipe.backends.dali import DaliLoader

    early = _buffers_handed_back_while_dali_reads(monkeypatch)
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    if end == "error":
        assemble = DaliLoader._assemble
        calls = iter(range(1000))

        def failing(self, work, decoded):
            if next(calls) == 2:
                raise RuntimeError("a batch failed")
            return assemble(self, work, decoded)

        monkeypatch.setattr(DaliLoader, "_assemble", failing)
        with pytest.raises(RuntimeError, match="a batch failed"):
            list(loader)
        assert loader._pipe is not None and loader._pipe.in_flight.batches  # what it still reads is held
    else:
        assert len(list(loader)) == len(loader)  # the next epoch's first batches are scheduled now
    flight = loader._pipe.in_flight
    assert flight.batches and all(hold is not None for _, hold in flight.batches)
    if end in ("drop", "cycle"):
        if end == "cycle":  # collected by the cycle collector, which runs the finalizers of its garbage in any order
            loader.me = loader
        del loader
        gc.collect()
    else:
        loader.close()
    assert not early
    assert flight.shut and not flight.batches  # and let go of once the pipeline was shut down: no buffer kept


@pytest.mark.parametrize("left", [0, 1])
def test_an_epochs_first_batch_is_not_held_back_by_the_feeds_next_read(photo_shards, monkeypatch, left):
    """A pass that goes on with batches already in flight (the next epoch's first ones, read and scheduled while the
    last pass ended, also one left ``left`` batches short) hands its first batch over before it asks the feed for a
    work more: the feed's next one may still be read by a worker (it waits for its pass to begin), and the first
    ``next()`` of the epoch used to wait for that read."""
    from gpupipe.backends.dali import DaliLoader

    events: list[str] = []
    take, deliver = DaliLoader._take, DaliLoader._deliver

    def noted(event: str) -> None:
        events.append((threading.current_thread(), event))

    monkeypatch.setattr(DaliLoader, "_take", lambda self: noted("take") or take(self))

    def delivered(self, work):
        batch = deliver(self, work)
        noted(f"delivered {work.epoch}:{work.number}")
        return batch

    monkeypatch.setattr(DaliLoader, "_deliver", delivered)
    loader = gpupipe.build_loader(photo_shards, "dali", batch_size=4, image_size=32, num_workers=1, device="cpu")
    first = iter(loader)
    for _ in range(len(loader) - left):
        next(first)
    loader.set_epoch(1)
    last = loader._ahead._thread  # the last pass's (it may still deliver the batch it made ahead)
    second = iter(loader)
    next(second)
    deadline = time.monotonic() + 30  # the loader's thread goes on to its next take (a busy machine: not at once)
    while "take" not in (now := [e for thread, e in events if thread not in (last, threading.current_thread())]):
        assert time.monotonic() < deadline, now
        time.sleep(0.01)
    assert now[0] == "delivered 1:0"
    assert len(list(second)) == len(loader) - 1


@pytest.mark.slow  # a fresh interpreter with DALI, run to its exit
def test_a_process_that_exits_mid_pass_ends_the_loaders_thread_before_dali_shuts_down(photos):
    """The loader's thread is ended at exit before DALI's own exit hook shuts its pipelines down (DALI is imported
    after the first such thread began: hooks run last-registered first); else the thread fed a pipeline DALI had
    shut down, and DALI's hook failed its assertion that no pipeline was left."""
    import subprocess
    import sys

    code = (
        "import gpupipe, sys\n"
        f"loader = gpupipe.build_loader({str(photos)!r}, 'dali', batch_size=4, image_size=32, num_workers=1, "
        "device='cpu')\n"
        "it = iter(loader)\n"
        "next(it), next(it)\n"
        "print('left mid-pass')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "left mid-pass" in done.stdout, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_batches_for_a_device_reach_the_training_thread_on_it(photos, monkeypatch):
    """For a device other than the CPU, the loader's thread puts each batch there (the labels copied from page-locked
    memory on CUDA; DALI's images are there already, and on the meta device, which stands in for CUDA, its CPU
    outputs are moved): the device stage on the training thread copies no batch (host budget on a folder:
    0.49 -> 0.13 ms a 256-batch on the meta device)."""
    from gpupipe.bench.host_budget import meta_loader
    from gpupipe.plumbing.host_pack import HostPack

    senders: list[str] = []
    real = HostPack.send
    monkeypatch.setattr(
        HostPack, "send", lambda self, d: senders.append(threading.current_thread().name) or real(self, d)
    )
    loader = meta_loader(str(photos), "dali", Recipe(32), 4, 1)
    batches = list(loader)
    assert len(batches) == len(loader) and all(x.is_meta and y.is_meta for x, y in batches)
    assert threading.current_thread().name not in senders


@pytest.mark.parametrize("left_at", [2, 3])
def test_a_pass_left_early_behind_a_slow_step_loses_no_scheduled_batch(photos, left_at):
    """The loader's thread runs ahead of a slow training step; a pass left a few batches short must not lose a work
    it already took from the stream (scheduled in DALI, its output at the head of DALI's queue): every later batch
    would then be the one before's images with the next one's labels. The next epoch is a fresh loader's."""
    import time

    kw = dict(batch_size=4, image_size=32, num_workers=0, normalize=False, seed=5, device="cpu")
    loader = gpupipe.build_loader(photos, "dali", **kw)
    it = iter(loader)
    for _ in range(left_at):
        next(it)
        time.sleep(0.3)  # the step: the thread has made the next batch and taken the one after
    del it
    loader.set_epoch(1)
    got = list(loader)
    loader._ahead.join()
    assert loader._scheduled == sum(bool(w.gpu) for w in loader._carry)
    fresh = gpupipe.build_loader(photos, "dali", **kw)
    fresh.set_epoch(1)
    for (a, la), (b, lb) in zip(got, list(fresh), strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)


def _os_threads(at_most: int) -> int:
    """This process's OS threads, once those that have just ended in Python have left (at most 2 s)."""
    deadline = time.monotonic() + 2
    while len(os.listdir("/proc/self/task")) > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("source", ["files", "shards"])
def test_a_loader_holds_as_many_threads_after_each_epoch(photos, photo_shards, source):
    """No thread of a pass outlives it (the pass's thread is waited for as it ends), and none is made later on."""
    data = photos if source == "files" else photo_shards
    loader = gpupipe.build_loader(data, "dali", batch_size=4, num_workers=2, device="cpu", image_size=32)
    python, first = [], 0
    for epoch in range(6):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        python.append(threading.active_count())
        first = first or len(os.listdir("/proc/self/task"))
    assert python == python[:1] * 6
    assert _os_threads(at_most=first) <= first


# -- pixels: a dataset of arrays fed to DALI as they are --------------------------------------------------------------

PIXEL_RECIPES = {
    "random-resized": dict(image_size=24),
    "pad-zero": dict(recipe=gpupipe.Recipe(32, crop="pad", padding=4, padding_mode="zero")),
    "pad-reflect": dict(recipe=gpupipe.Recipe(32, crop="pad", padding=4, padding_mode="reflect")),
    "resize": dict(recipe=gpupipe.Recipe(48, crop="resize")),
}


@pytest.fixture
def no_cpu_crop(monkeypatch):
    """The feed crops no pixels on the CPU (in its worker too: forked after this)."""
    from gpupipe.backends import gpu_feed

    def refused(*args, **kw):
        raise AssertionError("the feed cropped pixels on the CPU")

    monkeypatch.setattr(gpu_feed, "crop_resize", refused)


def _pixel_sources(rng) -> dict[str, object]:
    """CIFAR-like ``(images, labels)`` arrays (one shape: a dense batch), and a dataset of HWC arrays of several
    shapes (one sample at a time)."""
    same = np.stack([np.asarray(photo(rng, 32, 32)) for _ in range(12)])
    shapes = [(32, 40), (44, 32), (36, 36)]
    mixed = [(np.asarray(photo(rng, *shapes[i % 3])), i % 3) for i in range(12)]
    return {"arrays": (torch.from_numpy(same), np.arange(12) % 4), "dataset": mixed}


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("name", list(PIXEL_RECIPES))
def test_pixels_are_cropped_by_dali_as_pillow_crops_them(device, name, no_cpu_crop):
    """Items that are pixels go to DALI raw (the feed crops none), with the recipe's boxes: Pillow's samples and
    labels within resampling's difference, train and eval, in the caller (dense and listed batches) and through the
    feed's worker (shared memory)."""
    sources = _pixel_sources(np.random.default_rng(4))
    for (kind, source), train, workers in zip(
        [*sources.items()] * 2, (True, True, False, False), (0, 1, 1, 0), strict=True
    ):
        kw = dict(batch_size=4, train=train, num_workers=workers, normalize=False, seed=6, **PIXEL_RECIPES[name])
        dali = gpupipe.build_loader(source, "dali", device=device, **kw)
        (x, y), (rx, ry) = _all(dali), _all(gpupipe.build_loader(source, "pillow", device="cpu", **kw))
        assert torch.equal(y.cpu(), ry) and x.shape == rx.shape and dali.fallbacks == 0
        per_image = (x.cpu() - rx).abs().mean(dim=(1, 2, 3))
        assert per_image.max() < 1.5, (kind, train, per_image)  # a box off by a pixel or a missed flip: tens


def test_pixels_resume_mid_epoch_exactly(no_cpu_crop):
    source = _pixel_sources(np.random.default_rng(2))["dataset"]
    kw = dict(batch_size=3, train=True, image_size=24, num_workers=1, normalize=False, seed=9, device="cpu")
    assert_resume_is_exact(lambda: gpupipe.build_loader(source, "dali", **kw), epoch=1, batch=2)


def test_the_feed_hands_pixels_over_raw_with_their_crops():
    """A batch's work holds the samples' pixels as they are (one dense array of one shape) and the recipe's rows,
    nothing cropped in the worker."""
    from gpupipe.backends.dali_feed import DaliFeed
    from gpupipe.sources.dataset import open_dataset

    images, labels = _pixel_sources(np.random.default_rng(1))["arrays"]
    dataset = open_dataset((images, labels))
    recipe = gpupipe.Recipe(32, crop="pad", padding=4)
    assert dataset.holds_pixels()
    work = DaliFeed(dataset, recipe, True, 3, 1 << 30, pixels=True).work(2, [5, 0, 7])
    assert work.cpu == {} and work.gpu == [0, 1, 2]
    assert work.encoded is not None and torch.equal(work.encoded, images[[5, 0, 7]])
    assert work.shapes is not None and work.shapes.tolist() == [[32, 32, 3]] * 3
    boxes = recipe.plan_boxes(True, 3, 2, np.array([5, 0, 7]), np.full(3, 32), np.full(3, 32))
    assert work.rows is not None and np.array_equal(work.rows[:, :5], boxes) and (work.rows[:, 5] == 32).all()


def test_an_encoded_item_among_pixels_is_decoded_whole_for_dali(no_cpu_crop):
    """A dataset of pixels with an encoded image among them (rare): DALI's pipeline has no decoder, so Pillow decodes
    that one whole (a fallback) and DALI crops it with the rest."""
    items = _pixel_sources(np.random.default_rng(7))["dataset"]
    items[5] = (encoded(Image.fromarray(items[5][0]), "PNG"), items[5][1])
    kw = dict(batch_size=4, train=True, image_size=24, num_workers=0, normalize=False, seed=1, device="cpu")
    dali = gpupipe.build_loader(items, "dali", **kw)
    (x, y), (rx, ry) = _all(dali), _all(gpupipe.build_loader(items, "pillow", **kw))
    assert torch.equal(y, ry) and (x - rx).abs().mean(dim=(1, 2, 3)).max() < 1.5
    assert dali.fallbacks == 1


def _feed_crops(pipe, recipe, train: bool, rows: np.ndarray) -> None:
    """A batch's crop rows fed to a loader's graph, as the loader feeds them (DALI copies them)."""
    from gpupipe.backends.dali_graph import crop_inputs

    for name, data in crop_inputs(recipe, train, rows).items():
        pipe.feed_input(name, data)


def _eval_outputs(recipe, images, rows, whole: bool = False) -> list[np.ndarray]:
    """The loader's eval graph run on pixels ``images`` with the eval rows ``rows`` (``whole``: the window widened to
    the whole image, the crop in its pixels)."""
    from gpupipe.backends.dali_graph import build_pipeline

    if whole:
        rows = rows.copy()
        rows[:, 4:8] += np.tile(rows[:, 0:2], 2)
        rows[:, 0:2] = 0
        rows[:, 2:4] = [im.shape[:2] for im in images]
    pipe = build_pipeline(
        recipe, train=False, batch_size=len(images), device=torch.device("cpu"), num_threads=2, pixels=True
    )
    pipe.feed_input("pix", images)
    _feed_crops(pipe, recipe, False, rows)
    (out,) = pipe.run()
    return [np.array(out.at(k)).transpose(1, 2, 0) for k in range(len(images))]


def _resized_and_sliced(recipe, samples, rows, encoded: bool = False) -> list[np.ndarray]:
    """What eval's crop should be, computed the long way: each sample (pixels, or ``encoded`` JPEGs decoded whole by
    DALI) resized whole to torchvision's ``Resize`` size and sliced at the recipe's offsets (``rows``:
    :func:`~gpupipe.backends.gpu_feed.eval_rows`), HWC."""
    from nvidia.dali import fn, pipeline_def, types

    side = recipe.eval_side

    @pipeline_def(batch_size=len(samples), num_threads=1, device_id=None, prefetch_queue_depth=1)
    def sliced():
        if encoded:
            enc = fn.external_source(name="in", dtype=types.UINT8, ndim=1)
            images = fn.decoders.image(enc, device="cpu", output_type=types.RGB)
        else:
            images = fn.external_source(name="in", dtype=types.UINT8, ndim=3, layout="HWC")
        meta = fn.external_source(name="meta", dtype=types.INT64, ndim=1)
        size = [fn.cast(meta[k], dtype=types.FLOAT) for k in (1, 0)]
        images = fn.resize(images, resize_x=size[0], resize_y=size[1], antialias=True, interp_type=types.INTERP_LINEAR)
        return fn.slice(images, meta[2:4], types.Constant([side, side], dtype=types.INT64), axis_names="HW")

    pipe = sliced()
    pipe.build()
    pipe.feed_input("in", samples)
    pipe.feed_input("meta", list(rows))
    (out,) = pipe.run()
    return [np.array(out.at(k)) for k in range(len(samples))]


def test_the_eval_crop_is_the_whole_image_resized_and_cut():
    """eval decodes only the window its resize reads, and resizes the crop in it (DALI's region of interest): the
    pixels of torchvision's Resize + CenterCrop, the whole image resized and the window sliced at the recipe's offsets,
    within a level for any size (float rounding in the resize's weights), never a pixel out of place (noise images: a
    shift shows). Where every coordinate is exact in float32 (scales of a few bits, shrinking and enlarging), the
    window gives what the whole image gives, but for a rare level (the order of DALI's passes depends on the input's
    size): it holds every pixel the resize reads, and two pixels less on each side does not."""

    from gpupipe.backends.gpu_feed import eval_rows, eval_windows

    rng = np.random.default_rng(4)

    # resize 64, crop 32: each size's scale (0.5 to 4) and crop offsets are exact in float32, and so the crop in the
    # window and in the whole image
    exact = Recipe(32, crop_pct=0.5)
    sizes = [(128, 200), (256, 128), (32, 48), (96, 144), (192, 288), (80, 120), (48, 72), (160, 240), (112, 168)]
    sizes += [(w, h) for h, w in sizes]
    any_size = [tuple(hw) for hw in rng.integers(20, 400, (60, 2)).tolist()]
    for recipe, shapes in ((exact, sizes), (Recipe(32), any_size)):
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
        heights, widths = np.array([h for h, _ in shapes]), np.array([w for _, w in shapes])
        windows = eval_windows(recipe, heights, widths)
        ours = _eval_outputs(recipe, images, windows)
        theirs = _resized_and_sliced(recipe, images, eval_rows(recipe, heights, widths))
        for k, hw in enumerate(shapes):
            diff = np.abs(ours[k].astype(int) - theirs[k])
            assert diff.max() <= 1, hw
            assert diff.mean() < 0.02, hw
        if recipe is exact:
            assert (windows[:, 2] * windows[:, 3] < heights * widths).sum() >= len(shapes) // 2  # less than the image
            whole = _eval_outputs(recipe, images, windows, whole=True)
            short = windows.copy()  # two pixels less each side: no longer all the resize reads
            short[:, 0:2] += 2
            short[:, 2:4] -= 4
            short[:, 4:8] -= 2
            for a, b in zip(ours, whole, strict=True):
                diff = np.abs(a.astype(int) - b)
                assert diff.max() <= 1 and (diff > 0).mean() < 0.001  # the order of DALI's passes: a rare level
            cut_short = _eval_outputs(recipe, images, short)
            wrong = [np.abs(c.astype(int) - b).max() > 1 for c, b in zip(cut_short, whole, strict=True)]
            assert sum(wrong) >= len(wrong) // 2  # (the window's edges are whole pixels: some have one to spare)


def test_the_eval_window_holds_the_crop_and_its_resizes_reach():
    """The window decoded for eval: whole pixels inside the image, around the crop by at least the resize's support
    (a pixel enlarging, the scale shrinking) and a pixel more, and no more than that beyond it."""
    from gpupipe.backends.gpu_feed import eval_rows, eval_windows

    rng = np.random.default_rng(0)
    heights, widths = rng.integers(1, 5000, 4000), rng.integers(1, 5000, 4000)
    for recipe in (Recipe(224), Recipe(160, crop_pct=0.95), Recipe(33, crop_pct=0.5), Recipe(32, crop="resize")):
        win = eval_windows(recipe, heights, widths).astype(np.float64)
        rows = eval_rows(recipe, heights, widths)
        assert (win[:, :4] == np.round(win[:, :4])).all() and (win[:, :2] >= 0).all() and (win[:, 2:4] >= 1).all()
        assert (win[:, 0] + win[:, 2] <= heights).all() and (win[:, 1] + win[:, 3] <= widths).all()
        axes = ((heights, rows[:, 0], rows[:, 2]), (widths, rows[:, 1], rows[:, 3]))
        for axis, (length, resized, offset) in enumerate(axes):
            scale = length / resized
            start, end = win[:, 4 + axis] + win[:, axis], win[:, 6 + axis] + win[:, axis]
            assert np.allclose(start, offset * scale, atol=1e-3)
            assert np.allclose(end - start, recipe.eval_side * scale, atol=1e-3)
            support = np.maximum(scale, 1.0)
            lo, hi = win[:, axis], win[:, axis] + win[:, 2 + axis]
            first, last = start + 0.5 * scale, end - 0.5 * scale  # the first and last output pixel's centre
            assert ((lo == 0) | (lo <= first - support - 1 + 1e-3)).all()  # (the crop's ends in float32)
            assert ((hi == length) | (hi >= last + support + 1 - 1e-3)).all()
            assert (lo >= first - support - 2.001).all() and (hi <= last + support + 2.001).all()


def test_the_eval_window_is_cut_from_the_upright_image_in_every_orientation(tmp_path):
    """A JPEG turned by its EXIF orientation (all eight) has its eval window and crop placed in the upright image, as
    the recipe computes them: the loader's graph gives what DALI's decode of the whole image, resized and cut at the
    recipe's offsets, gives, within a level (blocky noise: a window placed in the stored image's axes shows)."""

    from gpupipe.backends.dali_graph import build_pipeline
    from gpupipe.backends.gpu_feed import eval_rows, eval_windows

    rng, recipe = np.random.default_rng(3), Recipe(48)
    datas, upright = [], []
    for orientation in range(1, 9):
        h, w = (150, 221) if orientation % 2 else (173, 120)
        blocks = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        exif = Image.Exif()
        exif[0x0112] = orientation
        datas.append(encoded(Image.fromarray(blocks).resize((w, h), Image.NEAREST), "JPEG", quality=95, exif=exif))
        upright.append((w, h) if orientation >= 5 else (h, w))
    heights, widths = np.array([h for h, _ in upright]), np.array([w for _, w in upright])

    ours = build_pipeline(recipe, train=False, batch_size=8, device=torch.device("cpu"), num_threads=1)
    samples = [np.frombuffer(d, np.uint8) for d in datas]
    ours.feed_input("enc", samples)
    _feed_crops(ours, recipe, False, eval_windows(recipe, heights, widths))
    (a,) = ours.run()
    theirs = _resized_and_sliced(recipe, samples, eval_rows(recipe, heights, widths), encoded=True)
    for k in range(8):
        diff = np.abs(np.array(a.at(k)).transpose(1, 2, 0).astype(int) - theirs[k])
        assert diff.max() <= 1, (k + 1, diff.max())
