"""The synthetic backend (gpupipe/backends/synthetic.py): random images made once on the device, real labels in the
sampler's order, so that it stands in for a real backend in the end-to-end bench."""

import pytest
import torch

import gpupipe

from .common_utils import assert_resume_is_exact, make_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("synthetic"), 3, 5)  # 15 images: batches of 4 leave a tail of 3


def _loader(root, backend="synthetic", **kw):
    opts = {"batch_size": 4, "train": True, "image_size": 16, "num_workers": 0, "device": "cpu", "seed": 3}
    return gpupipe.build_loader(root, backend, **{**opts, **kw})


def test_labels_follow_the_sampler_as_a_real_backend_does(folder):
    synthetic, pillow = _loader(folder, drop_last=False), _loader(folder, "pillow", drop_last=False)
    for epoch in (0, 1):
        synthetic.set_epoch(epoch)
        pillow.set_epoch(epoch)
        got = [(x.shape, y) for x, y in synthetic]
        want = [(x.shape, y) for x, y in pillow]
        assert [s for s, _ in got] == [s for s, _ in want]  # the tail batch too: 4, 4, 4, 3
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert [len(y) for _, y in synthetic] == [4, 4, 4, 3]


def test_images_are_random_made_once_and_seeded(folder):
    raw = _loader(folder, train=False, normalize=False, drop_last=False)
    batches = [x for x, _ in raw]
    assert batches[0].dtype == torch.uint8 and batches[0].shape == (4, 3, 16, 16)
    assert int(batches[0].min()) < 16 and int(batches[0].max()) > 240  # uniform over 0..255, not a constant
    assert all(torch.equal(b, batches[0]) for b in batches[1:3])  # the same tensor every step: it costs nothing
    assert torch.equal(batches[3], batches[0][:3])  # the tail is its first rows
    again = next(iter(_loader(folder, train=False, normalize=False)))[0]
    other = next(iter(_loader(folder, train=False, normalize=False, seed=4)))[0]
    assert torch.equal(again, batches[0]) and not torch.equal(other, batches[0])


def test_normalised_train_batches_and_resume(folder):
    x, y = next(iter(_loader(folder)))
    assert x.dtype == torch.float32 and x.shape == (4, 3, 16, 16) and y.dtype == torch.int64
    assert -3 < float(x.min()) < -1.5 and 1.5 < float(x.max()) < 3  # ImageNet mean/std applied on the device
    assert_resume_is_exact(lambda: _loader(folder), epoch=1, batch=2)


def test_a_resolution_schedule_gives_each_epoch_its_size(folder):
    loader = _loader(folder, image_size=None, recipe=gpupipe.Recipe(size=[16, 24]))
    for epoch, side in ((0, 16), (1, 24), (2, 24), (0, 16)):
        loader.set_epoch(epoch)
        assert {tuple(x.shape[-2:]) for x, _ in loader} == {(side, side)}


def test_repr_says_no_workers_whatever_num_workers_says(folder):
    """It decodes nothing: the num_workers it is given start no process, and its repr said '2 workers'."""
    text = repr(_loader(folder, num_workers=2))
    assert "no workers, random pixels made once" in text and "2 workers" not in text, text
