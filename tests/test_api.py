"""The contract every backend keeps, whatever the user did before: eval delivers each sample exactly once, in
dataset order; a bad file is named or skipped; a file gone between epochs and a format only Pillow reads behave as
on pillow. Parametrised over every decoding backend that delivers on the CPU (the registry says which)."""

import io
import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe._system import usable_cores

from .common_utils import (
    CPU_LOADER_BACKENDS,
    GPU_DECODERS,
    make_folder,
    photo,
)

KW = dict(image_size=32, device="cpu", normalize=False)  # the default workers: every usable core (2 in CI)


def _labels(batches) -> list[int]:
    return [int(v) for _, y in batches for v in y]


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_eval_after_a_partial_pass_gives_every_sample_once(unique_folder, backend):
    loader = gpupipe.build_loader(unique_folder, backend, batch_size=4, train=False, **KW)
    next(iter(loader))  # a partial pass, left unfinished
    for _ in loader:  # and one broken off by the user
        break
    full = list(loader)
    assert _labels(full) == list(range(13))  # one image per class: each label is one sample, in dataset order
    assert [len(y) for _, y in full] == [4, 4, 4, 1]
    assert _labels(list(loader)) == list(range(13))  # and again


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_an_older_iterator_stops_instead_of_mixing(unique_folder, backend):
    loader = gpupipe.build_loader(unique_folder, backend, batch_size=4, train=False, **KW)
    first = iter(loader)
    next(first)
    assert _labels(list(loader)) == list(range(13))
    with pytest.raises(gpupipe.GpupipeError, match="iterated again"):
        next(first)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_eval_ranks_share_the_samples_without_duplicates(unique_folder, backend):
    seen = []
    for rank in range(3):
        loader = gpupipe.build_loader(unique_folder, backend, batch_size=2, train=False, rank=rank, world_size=3, **KW)
        got = _labels(list(loader))
        assert len(got) == sum(len(b) for b in loader.sampler.batches(0))
        seen += got
    assert sorted(seen) == list(range(13))  # 5 + 4 + 4: unequal shards, nothing padded


@pytest.fixture()
def first_bad(tmp_path):
    """A truncated JPEG that sorts first, so it lands in the very first batch."""
    root = make_folder(tmp_path / "data", 2, 5)
    buf = io.BytesIO()
    photo(np.random.default_rng(3), 90, 120).save(buf, "JPEG", quality=95)
    (root / "c00" / "000_truncated.jpg").write_bytes(buf.getvalue()[:-400])
    return root


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
@pytest.mark.parametrize("train", [False, True])
def test_a_bad_file_in_the_first_batch_is_named(first_bad, backend, train):
    loader = gpupipe.build_loader(first_bad, backend, batch_size=4, train=train, **KW)
    with pytest.raises(gpupipe.DecodeError, match=r"000_truncated\.jpg") as e:
        list(loader)
    assert e.value.backend == backend
    assert str(e.value).endswith(  # the fix, as the command line names it
        '; to go on: on_error="skip" leaves such files out (listed in loader.skipped), and `gpupipe check` on the '
        "same source lists every unreadable file"
    )
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_skip_mode_eval_delivers_exactly_the_good_files(first_bad, backend):
    loader = gpupipe.build_loader(first_bad, backend, batch_size=4, train=False, on_error="skip", **KW)
    batches = list(loader)
    good = [label for path, label in loader.dataset.samples if "truncated" not in path]
    assert _labels(batches) == good  # each good file once, in order: no padding with duplicates
    assert [len(y) for _, y in batches] == [4, 4, 2]
    assert [os.path.basename(p) for p, _ in loader.skipped] == ["000_truncated.jpg"]
    assert [reason for _, reason in loader.skipped] == [
        "truncated (the data ends before the image does)"
    ]  # one wording


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_file_deleted_between_epochs_behaves_as_on_pillow(tmp_path, backend):
    root = make_folder(tmp_path / "data", 2, 4)
    loader = gpupipe.build_loader(root, backend, batch_size=4, train=True, on_error="skip", **KW)
    strict = gpupipe.build_loader(root, backend, batch_size=4, train=False, **KW)
    list(loader), list(strict)
    (root / "c01" / "002.jpg").unlink()
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4]  # refilled: equal steps
    assert [(os.path.basename(p), r.split(" (")[0]) for p, r in loader.skipped] == [("002.jpg", "cannot read the file")]
    with pytest.raises(gpupipe.DecodeError, match=r"002\.jpg.*cannot read the file"):
        list(strict)


def _read_ahead(loader) -> str:
    """Epoch 0 whole, epoch 1's first batches read ahead meanwhile: the path of one of their files."""
    list(loader)
    if hasattr(loader, "_stream"):  # a CPU stream: the first one taken from its workers now (a read-ahead batch)
        assert loader._stream().peek(1) is not None
    else:  # dali: its works made ahead, given to DALI's threads (which read them meanwhile)
        time.sleep(1)
    return loader.dataset.samples[loader.sampler.batches(1)[0][0]][0]


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_file_rewritten_between_epochs_keeping_its_size_and_times_is_read_again(tmp_path, backend):
    """``cp -p`` of a fix, ``touch -r``: the same size and modification time, another image."""
    root = make_folder(tmp_path / "data", 2, 4)
    kw = dict(batch_size=4, seed=1, **KW)
    for path in root.rglob("*.jpg"):  # room for another image of the same size
        path.write_bytes(path.read_bytes() + bytes(4096))
    loader = gpupipe.build_loader(root, backend, num_workers=2, **kw)
    path = _read_ahead(loader)
    st, old = os.stat(path), open(path, "rb").read()
    buf = io.BytesIO()
    photo(np.random.default_rng(9), *Image.open(path).size[::-1]).save(buf, "JPEG", quality=80)
    assert len(buf.getvalue()) <= len(old)
    with open(path, "r+b") as f:
        f.write(buf.getvalue())  # in place, the size kept
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    fresh = gpupipe.build_loader(root, backend, num_workers=0, **kw)
    _same(_epoch(loader, 1), _epoch(fresh, 1))


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_made_unreadable_between_epochs_is_an_error_as_without_read_ahead(tmp_path, backend, on_error):
    root = make_folder(tmp_path / "data", 2, 4)
    if _reads_mode_000(tmp_path):
        pytest.skip("root reads a file of mode 000 (test_files.py: a chmod moves the stamp, so it is read again)")
    loader = gpupipe.build_loader(root, backend, batch_size=4, num_workers=2, on_error=on_error, **KW)
    path = _read_ahead(loader)
    os.chmod(path, 0)
    if on_error == "raise":
        with pytest.raises(gpupipe.DecodeError, match=f"{os.path.basename(path)}.*cannot read the file"):
            _epoch(loader, 1)
        return
    assert sum(len(y) for _, y in _epoch(loader, 1)) == 8  # refilled
    assert [p for p, _ in loader.skipped] == [path]


def _reads_mode_000(folder) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"x")
    probe.chmod(0)
    try:
        probe.read_bytes()
        return True
    except PermissionError:
        return False


def _same(got, expected) -> None:
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(y, ey) and torch.equal(x, ex)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_gif_in_a_file_list_is_decoded_like_pillow(tmp_path, backend):
    rng = np.random.default_rng(5)
    rows = []
    for i in range(5):
        name = f"{i}.gif" if i == 2 else f"{i}.jpg"
        img = photo(rng, 70, 90)
        img.save(tmp_path / name, "GIF" if name.endswith("gif") else "JPEG", quality=95)
        rows.append(f"{name},{i % 2}")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    loader = gpupipe.build_loader(tmp_path / "list.csv", backend, batch_size=5, train=False, **KW)
    ref = gpupipe.build_loader(tmp_path / "list.csv", "pillow", batch_size=5, train=False, **KW)
    (x, y), (rx, ry) = next(iter(loader)), next(iter(ref))
    assert torch.equal(y, ry)
    assert (x.float() - rx.float()).abs().mean() < 2
    if backend in ("dali", "turbojpeg"):
        assert loader.fallbacks == 1  # what the backend cannot decode itself, Pillow did


def test_read_image_returns_a_cpu_tensor_by_default(unique_folder):
    path = next(unique_folder.rglob("*.jpg"))
    for backend in CPU_LOADER_BACKENDS:
        img = gpupipe.read_image(path, backend)
        assert img.device.type == "cpu" and img.dtype == torch.uint8


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_DECODERS)
def test_gpu_error_batches_and_devices(first_bad, backend):
    """Skip mode on CUDA: the empty batch of a failure is made on the loader's device and joins CUDA batches."""
    loader = gpupipe.build_loader(
        first_bad,
        backend,
        batch_size=4,
        train=False,
        on_error="skip",
        image_size=32,
        num_workers=1,
        device="cuda:0",
        normalize=False,
    )
    batches = list(loader)
    assert all(x.device == torch.device("cuda", 0) for x, _ in batches)
    assert [os.path.basename(p) for p, _ in loader.skipped] == ["000_truncated.jpg"]
    img = gpupipe.read_image(next(first_bad.rglob("001.jpg")), backend, device="cuda:0")
    assert img.device == torch.device("cuda", 0)


def _child_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _epoch(loader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_resolution_schedule_changes_the_size_per_epoch_in_the_same_workers(unique_folder, backend):
    """Each epoch's batches at its scheduled size, from the same worker processes (and DALI pipeline) throughout."""
    before = _child_pids()
    kw = {**KW, "image_size": None, "recipe": gpupipe.Recipe(size=[16, 24, 16])}
    loader = gpupipe.build_loader(unique_folder, backend, batch_size=4, **kw)
    sizes, workers, pipes = [], [], []
    for epoch in range(3):
        sizes.append({tuple(x.shape[-2:]) for x, _ in _epoch(loader, epoch)})
        workers.append(_child_pids() - before)
        pipes.append(getattr(loader, "_pipe", None))
    assert sizes == [{(16, 16)}, {(24, 24)}, {(16, 16)}]
    # persistent: no worker pool made again (dali reads a folder's files in DALI's threads: only its header scan's)
    assert (workers[0] or backend == "dali") and workers[0] == workers[1] == workers[2]
    assert pipes[0] is pipes[1] is pipes[2] and getattr(loader, "pipelines_built", 1) == 1  # DALI's: never rebuilt


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_scheduled_epoch_is_that_size_s_epoch_and_resumes_mid_epoch(unique_folder, backend):
    """The crops are functions of (seed, epoch, index): epoch 1 of [16, 24] is epoch 1 at a fixed 24, and a loader
    resumed at its batch 1 delivers the rest of it."""
    kw = {**KW, "image_size": None, "batch_size": 4, "seed": 3}
    fixed = _epoch(gpupipe.build_loader(unique_folder, backend, recipe=gpupipe.Recipe(24), **kw), 1)
    scheduled = gpupipe.build_loader(unique_folder, backend, recipe=gpupipe.Recipe(size=[16, 24]), **kw)
    assert [x.shape[-1] for x, _ in _epoch(scheduled, 0)] == [16] * len(fixed)
    straight = _epoch(scheduled, 1)
    resumed = gpupipe.build_loader(unique_folder, backend, recipe=gpupipe.Recipe(size=[16, 24]), **kw)
    resumed.load_state_dict({"epoch": 1, "batch": 1})
    for got in (straight, [*straight[:1], *resumed]):
        assert len(got) == len(fixed)
        for (x, y), (fx, fy) in zip(got, fixed, strict=True):
            assert torch.equal(x, fx) and torch.equal(y, fy)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_eval_runs_at_its_own_size(unique_folder, backend):
    """eval_size, whatever the train schedule: the same batches as a recipe of that size."""
    kw = {**KW, "image_size": None, "batch_size": 4, "train": False}
    recipe = gpupipe.Recipe(size=gpupipe.ResolutionSchedule(16, 24, 0, 2, step=8), eval_size=20)
    got = list(gpupipe.build_loader(unique_folder, backend, recipe=recipe, **kw))
    same = list(gpupipe.build_loader(unique_folder, backend, recipe=gpupipe.Recipe(20), **kw))
    assert all(torch.equal(x, sx) for (x, _), (sx, _) in zip(got, same, strict=True)) and got[0][0].shape[-1] == 20


_AUGMENT_PATHS = {  # what the device stage may still do on uint8 after the workers: each must see uint8
    "plain": {},
    "ctaugment": {"recipe": gpupipe.Recipe(32, auto_augment="ctaugment")},
    "ctaugment-probe": {"recipe": gpupipe.Recipe(32, auto_augment="ctaugment-probe")},
    "rand+batch-transforms": {
        "recipe": gpupipe.Recipe(32, auto_augment="rand-m9-mstd0.5-inc1"),
        "transforms": lambda x: x.flip(-2),
        "transforms_mode": "batch",
    },
}


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
@pytest.mark.parametrize("path", list(_AUGMENT_PATHS))
def test_every_worker_count_gives_the_same_normalised_batches(unique_folder, backend, path):
    """Normalised, as users read it, at 0 workers, 1, and every usable core (the default: there the CPU workers may
    normalise, and whatever the device stage still does must get uint8)."""
    kw = {**_AUGMENT_PATHS[path], "image_size": None, "device": "cpu", "batch_size": 4, "seed": 1}
    got = {}
    for workers in sorted({0, 1, usable_cores()}):
        loader = gpupipe.build_loader(unique_folder, backend, num_workers=workers, **kw)
        got[workers] = [next(it) for it in [iter(loader)] for _ in range(2)]
    ref = got.pop(0)
    for workers, batches in got.items():
        for (x, y), (rx, ry) in zip(batches, ref, strict=True):
            assert x.dtype == torch.float32 and torch.equal(y, ry), workers
            torch.testing.assert_close(x, rx, msg=f"{workers} workers")


def test_an_eval_loader_given_augmentation_policies_says_it_ignores_them(folder, recwarn):
    recipe = gpupipe.Recipe(32, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    with pytest.warns(UserWarning, match="an eval loader applies no augmentation policy: the recipe's auto_augment, "):
        gpupipe.build_loader(folder, "synthetic", batch_size=4, train=False, device="cpu", recipe=recipe)
    recwarn.clear()
    gpupipe.build_loader(folder, "synthetic", batch_size=4, train=False, device="cpu", recipe=recipe.for_eval())
    gpupipe.build_loader(folder, "synthetic", batch_size=4, train=True, device="cpu", recipe=recipe)
    assert not [w for w in recwarn if "augmentation policy" in str(w.message)]
