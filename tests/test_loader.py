"""The batch contract, the same for every backend."""

import gc
import multiprocessing.resource_tracker
import os
import threading
import time

import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

import gpupipe

from .common_utils import (
    CPU_LOADER_BACKENDS,
    GPU_DECODERS,
    assert_resume_is_exact,
    cpu_and_cuda,
    decode_tolerance,
    float_tiff,
    make_folder,
    two_rank_epochs,
)

ALL = [*CPU_LOADER_BACKENDS, "synthetic"]


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("backend", ALL)
def test_eval_contract(folder, backend, device):
    loader = gpupipe.build_loader(
        folder, backend, batch_size=5, train=False, image_size=32, num_workers=1, device=device
    )
    assert loader.dataset.samples == ImageFolder(str(folder)).samples
    batches = list(loader)
    assert len(batches) == len(loader) == 5  # 24 samples, last batch partial
    images = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    assert images.shape == (24, 3, 32, 32) and images.dtype == torch.float32
    assert images.device.type == device
    assert labels.dtype == torch.int64 and labels.shape == (24,)
    assert labels.tolist() == [label for _, label in loader.dataset.samples]  # dataset order


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("backend", ALL)
def test_uint8_batches(folder, backend, device):
    loader = gpupipe.build_loader(
        folder, backend, batch_size=8, train=True, image_size=40, num_workers=0, normalize=False, device=device
    )
    x, y = next(iter(loader))
    assert x.shape == (8, 3, 40, 40) and x.dtype == torch.uint8 and y.shape == (8,)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_train_epoch_holds_every_sample_once_in_a_new_order(unique_folder, backend):
    loader = gpupipe.build_loader(
        unique_folder,
        backend,
        batch_size=4,
        train=True,
        image_size=24,
        num_workers=1,
        drop_last=False,
        device="cpu",
        seed=3,
    )
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        orders.append(torch.cat([y for _, y in loader]).tolist())
    n = len(loader.dataset)
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    loader.set_epoch(1)
    assert torch.cat([y for _, y in loader]).tolist() == orders[1]  # seeded: the same epoch again


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_two_shards_take_equal_steps_and_cover_the_data(unique_folder, backend):
    steps, seen = two_rank_epochs(unique_folder, backend)
    assert steps[0] == steps[1]
    assert seen[0] | seen[1] == set(range(13))
    assert len(seen[0] & seen[1]) <= 1  # 13 over 2 ranks: one sample pads the short shard


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_eval_pixels_agree_with_pillow(folder, backend):
    def pixels(b):
        loader = gpupipe.build_loader(
            folder, b, batch_size=8, train=False, image_size=64, num_workers=0, normalize=False, device="cpu"
        )
        return torch.cat([x for x, _ in loader]).float()

    assert (pixels(backend) - pixels("pillow")).abs().mean() <= 1.0


def test_eval_pixels_agree_with_torchvision(folder):
    from torchvision import transforms as T

    tv = ImageFolder(str(folder), T.Compose([T.Resize(73), T.CenterCrop(64), T.PILToTensor()]))
    ref = torch.stack([tv[i][0] for i in range(len(tv))]).float()
    loader = gpupipe.build_loader(
        folder, "pillow", batch_size=8, train=False, image_size=64, num_workers=0, normalize=False, device="cpu"
    )
    assert (torch.cat([x for x, _ in loader]).float() - ref).abs().mean() <= 1.0


def test_normalisation_and_transforms(folder, monkeypatch):
    raw = gpupipe.build_loader(
        folder, "pillow", batch_size=4, train=False, image_size=32, num_workers=0, normalize=False, device="cpu"
    )
    norm = gpupipe.build_loader(
        folder,
        "pillow",
        batch_size=4,
        train=False,
        image_size=32,
        num_workers=0,
        device="cpu",
        transforms=[lambda x: x.flip(-1)],
        channels_last=True,
    )
    x8, _ = next(iter(raw))
    xf, _ = next(iter(norm))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(xf, (x8.flip(-1).float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)  # on uint8, first
    assert xf.is_contiguous(memory_format=torch.channels_last)
    # on a CPU whose cores the workers all take, the workers normalise (in parallel): the same numbers
    monkeypatch.setattr("gpupipe.data.placement.usable_cores", lambda: 2)
    par = gpupipe.build_loader(
        folder,
        "pillow",
        batch_size=4,
        train=False,
        image_size=32,
        num_workers=2,
        device="cpu",
        transforms=[lambda x: x.flip(-1)],
        channels_last=True,
    )
    xp, _ = next(iter(par))
    torch.testing.assert_close(xp, xf, rtol=0, atol=0)
    assert xp.dtype == torch.float32 and xp.is_contiguous(memory_format=torch.channels_last)


def test_resume_mid_epoch_gives_the_same_batches(folder):
    kw = dict(batch_size=4, train=True, image_size=24, num_workers=0, normalize=False, device="cpu", seed=5)
    assert_resume_is_exact(lambda: gpupipe.build_loader(folder, "pillow", **kw), epoch=2, batch=3)


def _labels(batches):
    return [lb.tolist() for _, lb in batches]


def test_state_after_a_full_pass_points_at_the_next_epoch(unique_folder):
    kw = dict(batch_size=3, train=True, image_size=16, num_workers=0, normalize=False, device="cpu", seed=1)
    loader = gpupipe.build_loader(unique_folder, "pillow", **kw)
    first = _labels(loader)
    assert {k: loader.state_dict()[k] for k in ("epoch", "batch")} == {"epoch": 1, "batch": 0}
    resumed = gpupipe.build_loader(unique_folder, "pillow", **kw)
    resumed.load_state_dict(loader.state_dict())
    second = _labels(resumed)
    assert len(second) == len(first) and second != first  # the whole next epoch, in its own order


def test_set_epoch_of_the_loaded_epoch_keeps_the_position(unique_folder):
    """The README loop: load_state_dict mid-epoch, then ``for epoch ...: loader.set_epoch(epoch)``."""
    kw = dict(batch_size=3, train=True, image_size=16, num_workers=0, normalize=False, device="cpu", seed=1)
    straight = gpupipe.build_loader(unique_folder, "pillow", **kw)
    straight.set_epoch(2)
    expected = _labels(straight)
    loader = gpupipe.build_loader(unique_folder, "pillow", **kw)
    loader.load_state_dict({"epoch": 2, "batch": 2})
    loader.set_epoch(2)
    assert _labels(loader) == expected[2:]
    loader.set_epoch(2)  # asked again after the resumed pass: the whole epoch
    assert _labels(loader) == expected


def test_a_pass_cut_short_is_followed_by_the_next_epoch(unique_folder):
    kw = dict(batch_size=3, train=True, image_size=16, num_workers=0, normalize=False, device="cpu", seed=1)
    loader = gpupipe.build_loader(unique_folder, "pillow", **kw)
    epochs = []
    for _ in range(3):
        for step, _ in enumerate(loader):  # a cap of 2 steps per epoch
            if step == 2:
                break
            epochs.append(loader.sampler.epoch)
    assert epochs == [0, 0, 1, 1, 2, 2]
    loader.set_epoch(1)  # the user's choice wins over moving on
    ref = gpupipe.build_loader(unique_folder, "pillow", **kw)
    ref.set_epoch(1)
    assert _labels(loader) == _labels(ref)


def test_recipe_size_and_image_size_never_disagree_silently(folder):
    kw = dict(batch_size=4, train=False, num_workers=0, normalize=False, device="cpu")
    assert gpupipe.build_loader(folder, "pillow", **kw).recipe.size == 224
    x, _ = next(iter(gpupipe.build_loader(folder, "pillow", recipe=gpupipe.Recipe(size=24), **kw)))
    assert x.shape[-2:] == (24, 24)
    same = gpupipe.build_loader(folder, "pillow", recipe=gpupipe.Recipe(size=24), image_size=24, **kw)
    assert same.recipe.size == 24
    with pytest.raises(ValueError, match=r"image_size=32 and recipe\.size=24 disagree"):
        gpupipe.build_loader(folder, "pillow", recipe=gpupipe.Recipe(size=24), image_size=32, **kw)


def test_unknown_backend_and_bad_options(folder):
    with pytest.raises(ValueError, match="valid names: auto, pillow"):
        gpupipe.build_loader(folder, "pil")
    with pytest.raises(ValueError, match="on_error"):
        gpupipe.build_loader(folder, "pillow", on_error="ignore")
    with pytest.raises(ValueError, match="no full batch"):
        gpupipe.build_loader(folder, "pillow", batch_size=1000, train=True, device="cpu")


def test_missing_dependency_says_how_to_install(folder):
    if "pillow-simd" in gpupipe.available_backends():
        pytest.skip("pillow-simd is installed here")
    with pytest.raises(ModuleNotFoundError, match="pillow-simd"):
        gpupipe.build_loader(folder, "pillow-simd", device="cpu")


def test_auto_picks_a_usable_backend(folder):
    loader = gpupipe.build_loader(folder, "auto", batch_size=4, train=False, image_size=24, num_workers=0, device="cpu")
    assert loader.backend in gpupipe.available_backends()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_DECODERS)
def test_gpu_backends_contract_and_parity(folder, backend):
    def run(b, device):
        loader = gpupipe.build_loader(
            folder, b, batch_size=8, train=False, image_size=64, num_workers=1, normalize=False, device=device
        )
        batches = list(loader)
        return torch.cat([x.cpu() for x, _ in batches]).float(), torch.cat([y.cpu() for _, y in batches])

    x, y = run(backend, "cuda")
    ref_x, ref_y = run("pillow", "cpu")
    assert torch.equal(y, ref_y)
    assert (x - ref_x).abs().mean() <= decode_tolerance("cuda", 1.0)  # nvJPEG's IDCT and chroma upsampling
    train = gpupipe.build_loader(folder, backend, batch_size=8, train=True, image_size=64, num_workers=1, device="cuda")
    images, labels = next(iter(train))
    assert images.is_cuda and images.shape == (8, 3, 64, 64) and labels.dtype == torch.int64


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loaders_and_check_flag_float_images(tmp_path, backend):
    from gpupipe.cli import main

    root = make_folder(tmp_path / "data", 2, 3)
    float_tiff(root / "c01" / "zz_float.tif")
    loader = gpupipe.build_loader(
        root, backend, batch_size=2, train=False, image_size=16, num_workers=0, device="cpu", on_error="skip"
    )
    list(loader)
    assert [(p.rsplit("/", 1)[-1], "mode F" in r) for p, r in loader.skipped] == [("zz_float.tif", True)]
    if backend == "pillow":
        assert main(["check", str(root), "--workers", "1"]) == 1


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_raises_in_the_main_process(dirty_folder, backend):
    loader = gpupipe.build_loader(
        dirty_folder, backend, batch_size=4, train=False, image_size=32, num_workers=1, device="cpu"
    )
    with pytest.raises(gpupipe.DecodeError, match=r"zz_truncated\.jpg|zz_empty\.jpg"):
        list(loader)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_skips_refills_and_reports(dirty_folder, backend):
    loader = gpupipe.build_loader(
        dirty_folder,
        backend,
        batch_size=4,
        train=True,
        image_size=32,
        num_workers=1,
        device="cpu",
        on_error="skip",
        drop_last=False,
    )
    batches = list(loader)
    assert len(batches) == len(loader)
    assert [len(y) for _, y in batches] == [len(b) for b in loader.sampler.batches(0)]  # full batches, equal steps
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in loader.skipped) == ["zz_empty.jpg", "zz_truncated.jpg"]
    assert all(reason for _, reason in loader.skipped)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_pixel_limit_from_the_header(tmp_path, backend):
    """A picture over the limit is refused from its header by every loader (DALI included: it has no limit of its
    own), raised in the main process or skipped and reported."""
    root = make_folder(tmp_path / "data", 2, 4)
    Image.new("RGB", (1200, 1000)).save(root / "c01" / "zz_big.jpg")
    kw = dict(batch_size=4, image_size=32, num_workers=1, device="cpu", max_pixels=1_000_000)
    with pytest.raises(gpupipe.DecodeError, match=r"zz_big\.jpg.*1200x1000 = 1200000 pixels exceeds the limit"):
        list(gpupipe.build_loader(root, backend, train=False, **kw))
    loader = gpupipe.build_loader(root, backend, train=True, on_error="skip", drop_last=False, **kw)
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4, 1]
    assert [p.rsplit("/", 1)[-1] for p, _ in loader.skipped] == ["zz_big.jpg"]


def _in_a_small_dev_shm(size: str = "1m") -> list[str] | None:
    """The command prefix that runs a command with a ``size`` ``/dev/shm`` of its own (a mount namespace: ``unshare
    -m`` as root, ``unshare -rm`` with user namespaces), or None where this machine cannot make one."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return None
    mount = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"'
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):
        prefix = [*unshare, "sh", "-c", mount]
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


@pytest.mark.slow
def test_a_small_dev_shm_is_named_with_the_fix(folder):
    """1 MB of /dev/shm: torch's worker error ("Caught RuntimeError in DataLoader worker process 0") hid the cause on
    the last line of a traceback; now one line names it and the fix."""
    import subprocess
    import sys

    prefix = _in_a_small_dev_shm()
    if prefix is None:
        pytest.skip("cannot make a mount namespace here (unshare -m needs root or user namespaces)")
    script = (  # as gpupipe train reads batches: WorkerLost is what its loop saves a checkpoint on
        "import sys, gpupipe\n"
        "from gpupipe.train.stop import next_batch\n"
        "loader = gpupipe.build_loader(sys.argv[1], 'pillow', batch_size=8, image_size=224, num_workers=2, "
        "device='cpu')\n"
        "it = iter(loader)\n"
        "try:\n    while True:\n        next_batch(it, 300)\n"
        "except gpupipe.GpupipeError as e:\n    sys.exit(f'{type(e).__name__}: {e}')\n"
    )
    run = subprocess.run([*prefix, sys.executable, "-c", script, str(folder)], capture_output=True, text=True)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert last.startswith("WorkerLost: ") and "unable to allocate shared memory" in last and "No space left" in last
    assert "--shm-size" in last and "--ipc=host" in last and "fewer workers" in last


_SHM_LEFT = """
import gc, os, sys
import gpupipe
from gpupipe.data.loader import WorkerResourceError
def run(steps, **kw):
    loader = gpupipe.build_loader(sys.argv[1], "pillow", num_workers=2, device="cpu", **kw)
    error = ""
    try:
        for k, _ in enumerate(loader):
            if k + 1 == steps:
                break
    except WorkerResourceError as e:
        error = str(e)
    del loader
    gc.collect()
    print(repr((error, sorted(os.listdir("/dev/shm")))))
run(None, batch_size=8, image_size=224)  # 16 buffers of 1.2 MB do not fit: WorkerResourceError
run(3, batch_size=4, image_size=64)  # dropped mid-epoch
run(None, batch_size=4, image_size=64)  # a whole pass, then dropped
"""


@pytest.mark.slow
def test_no_shared_memory_is_left_behind(folder):
    """With an 8 MB /dev/shm, the workers' batch buffers filled it: the run failed (rightly, naming /dev/shm) but left
    sparse and full ``torch_*`` files there for the process's life: a partly made buffer, each worker's pool (killed
    after 5 s, the iterator held by the failure's traceback), messages never read. Nothing is left on any exit path:
    the failure, a loader dropped mid-epoch, a whole pass."""
    import ast
    import subprocess
    import sys

    prefix = _in_a_small_dev_shm("8m")
    if prefix is None:
        pytest.skip("cannot make a mount namespace here (unshare -m needs root or user namespaces)")
    run = subprocess.run([*prefix, sys.executable, "-c", _SHM_LEFT, str(folder)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    (error, left), *others = [ast.literal_eval(line) for line in run.stdout.splitlines()]
    assert "\n" not in error and "/dev/shm is full or too small" in error and "--shm-size" in error, error
    assert left == [] and others == [("", []), ("", [])]


_CAUGHT_THEN_ANOTHER = """
import gc, sys
import gpupipe
def bad(x):
    raise RuntimeError("boom")
kw = dict(batch_size=4, image_size=32, device="cpu", num_workers=2)
loader = gpupipe.build_loader(sys.argv[1], transforms=bad, transforms_mode="batch", **kw)
try:
    next(iter(loader))
except gpupipe.TransformError:
    print("caught")
loader = gpupipe.build_loader(sys.argv[1], transforms=lambda x: (gc.collect(), x)[1], **kw)  # the workers collect
print(len(list(loader)) == len(loader))
"""


@pytest.mark.slow
def test_a_caught_transform_error_leaves_no_iterator_for_the_next_workers_to_stop(folder):
    """A user's script: the failed loader's DataLoader iterator is left in a reference cycle (the error's
    traceback); a worker of the next loader that collects garbage must not run its ``__del__`` ("Exception ignored
    ... AssertionError: can only test a child process")."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CAUGHT_THEN_ANOTHER, str(folder)], capture_output=True, text=True)
    assert r.stdout.split() == ["caught", "True"], r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr


def _tasks() -> int:
    """This process's OS threads (DALI's C++ threads among them, which ``threading`` does not list)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("case", ["pillow", "turbojpeg", "dali", "dali-shards", "nvjpeg", "synthetic"])
def test_close_ends_every_process_and_thread_at_once_and_a_closed_loader_says_so(folder, tmp_path, case):
    """In the middle of a pass, with the garbage collector off: after ``close()`` (the end of a ``with`` block) no
    worker, feed process or thread of the loader's is left, a second close does nothing, and the pass, or a new one,
    raises ``LoaderClosedError``. dali reads a folder with its own threads, shards with feed processes; nvjpeg's loader
    whole, its device side on the CPU."""
    from .test_pool import _children

    backend = case.split("-")[0]
    kw = dict(batch_size=4, num_workers=2, device="cpu", image_size=32)
    if backend not in gpupipe.available_backends() and backend != "nvjpeg":
        pytest.skip(f"no {backend}")
    data = folder
    if case == "dali-shards":
        from gpupipe.prepare import PrepareOptions, prepare

        data = tmp_path / "shards"
        prepare(folder, data, PrepareOptions(), workers=1)
    from gpupipe.plumbing.reaper import Reaper

    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's own thread pool, started before the count
    Reaper().drop(None)  # the process's one thread that frees buffers (every loader's, ended at exit)
    if backend == "dali":  # and dali's one thread that lets a read blocked on a fifo go (it never ends): run alone,
        from gpupipe.backends import dali_fifos  # the test would count it as the loader's

        dali_fifos._watching()
    # multiprocessing's resource tracker, which a fork server's workers (their named semaphores) start for the
    # process's life
    multiprocessing.resource_tracker.ensure_running()
    tasks, threads, children = _tasks(), set(threading.enumerate()), set(_children(os.getpid()))
    gc.disable()
    try:
        with _built(data, backend, kw) as loader:
            it = iter(loader)
            next(it)
            if backend != "synthetic":
                assert set(_children(os.getpid())) - children or _tasks() > tasks, "nothing started"
        loader.close()
        # a queue's feeder thread ends just after its queue is closed: a moment's grace, no more
        left = lambda: (set(_children(os.getpid())) - children, set(threading.enumerate()) - threads, _tasks() > tasks)
        deadline = time.monotonic() + 3
        while any(left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        processes, python_threads, os_threads = left()
        assert not processes, "worker processes outlived close()"
        assert not python_threads, "threads outlived close()"
        assert not os_threads, "OS threads (DALI's) outlived close()"
    finally:
        gc.enable()
    assert repr(loader).endswith(", closed>")
    with pytest.raises(gpupipe.LoaderClosedError, match=r"loader of .* was closed: build a new one"):
        next(it)
    with pytest.raises(gpupipe.LoaderClosedError):
        iter(loader)


def _built(data, backend: str, kw: dict):
    from .test_nvjpeg import _CpuNvjpegLoader

    if backend == "nvjpeg":
        return _CpuNvjpegLoader(gpupipe.build_loader(data, "pillow", **kw).parts)
    return gpupipe.build_loader(data, backend, **kw)


def test_repr_says_backend_source_size_batches_workers_and_device(folder):
    loader = gpupipe.build_loader(
        folder, "synthetic", batch_size=5, train=False, image_size=32, num_workers=1, device="cpu"
    )
    assert repr(loader) == (
        f"<SyntheticLoader synthetic {str(folder)!r}: 24 images, 5 batches of 5, eval, no workers, random pixels "
        "made once, device cpu>"
    )


def test_stats_count_what_the_loop_was_given_and_how_long_it_waited(tmp_path, caplog):
    """Two eval passes over 7 files, one unreadable (skipped): every batch and image counted, the skipped file once
    a pass; the caller's own time between batches (a sleep here) is in ``seconds`` but not in ``waited_s``. The
    ``gpupipe`` logger says at DEBUG what was built and when each pass began and ended."""
    import logging

    root = make_folder(tmp_path / "data", 1, 6)
    (root / "c00" / "bad.jpg").write_bytes(b"not an image")
    with caplog.at_level(logging.DEBUG, logger="gpupipe"):
        loader = gpupipe.build_loader(
            root, "pillow", batch_size=4, train=False, image_size=32, num_workers=0, device="cpu", on_error="skip"
        )
        for _ in range(2):
            for _ in loader:
                time.sleep(0.05)
    stats = loader.stats
    assert (stats.batches, stats.images, stats.skipped) == (4, 12, 2)
    assert 0 < stats.waited_s < stats.seconds
    assert stats.seconds - stats.waited_s >= 2 * 0.05  # the loop's own time between batches is no wait
    assert stats.images_per_s == pytest.approx(12 / stats.seconds)
    assert str(stats).startswith("4 batches, 12 images, ") and str(stats).endswith(", 2 skipped")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("built <CpuLoader pillow") for m in messages), messages
    assert sum("a pass of epoch" in m and "begins at batch 0 (2 batches)" in m for m in messages) == 2, messages
    assert sum("ended: 2 batches; so far" in m for m in messages) == 2, messages
    stats.reset()
    assert (stats.batches, stats.images, stats.skipped, stats.seconds) == (0, 0, 0, 0.0)
