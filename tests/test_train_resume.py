"""gpupipe/train/resume.py: a resume refuses data whose classes changed since the checkpoint (the model's outputs
are the checkpoint's classes: a renamed folder would re-label every sample, an added one change the head)."""

import shutil
import subprocess
from dataclasses import asdict

import pytest
import torch

from gpupipe.train.loop import train

from .common_utils import make_folder, train_cli, train_config

pytestmark = pytest.mark.slow  # a training run, then gpupipe train in a process


@pytest.mark.parametrize(
    "change, said",
    [
        ("rename", "added 'c01-renamed'; gone 'c01'; 3 then, 3 now"),
        ("add", "added 'c03'; 3 then, 4 now"),
    ],
)
def test_a_resume_on_data_whose_classes_changed_is_refused_saying_what_changed(tmp_path, change, said):
    data, out = make_folder(tmp_path / "data", 3, 2), tmp_path / "run"
    train(train_config(data, out, epochs=1, batch_size=2))
    if change == "rename":
        (data / "c01").rename(data / "c01-renamed")
    else:
        shutil.copytree(data / "c00", data / "c03")
    args = train_cli(data, out, "--resume", "--allow-config-change", epochs=2, batch_size=2)
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {out}/checkpoints/last.pt: the data's classes changed since this checkpoint")
    assert f"({said}): its labels would mean other classes" in lines[0], lines[0]


def test_a_resume_on_data_with_files_added_goes_on_with_a_notice(tmp_path):
    """Files added in the same classes: the checkpoint's place in the epoch's order does not carry over (the order
    follows from the samples), so the run says so in one line and trains the epoch over the files there are now."""
    data, out = make_folder(tmp_path / "data", 3, 2), tmp_path / "run"
    train(train_config(data, out, epochs=1, batch_size=2))
    make_folder(tmp_path / "more", 3, 1, seed=1)
    for c in range(3):
        shutil.copy(tmp_path / "more" / f"c{c:02d}" / "000.jpg", data / f"c{c:02d}" / "new.jpg")
    args = train_cli(data, out, "--resume", "--allow-config-change", epochs=2, batch_size=2)
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "the data changed since this checkpoint (6 samples then, 9 now; the classes are the same)" in log, log
    assert "epoch 1 starts again from its first batch" in log


def test_on_changed_data_restarts_the_epoch_and_keeps_an_unchanged_position(tmp_path):
    import gpupipe
    from gpupipe.train.resume import on_changed_data

    data = make_folder(tmp_path / "data", 2, 4)
    kw = {"batch_size": 2, "image_size": 32, "device": "cpu", "num_workers": 0, "seed": 5}
    loader = gpupipe.build_loader(data, "pillow", **kw)
    it = iter(loader)
    next(it)
    position = loader.state_dict()
    assert on_changed_data(position, gpupipe.build_loader(data, "pillow", **kw), tmp_path) == (position, None)
    shutil.copy(data / "c00" / "000.jpg", data / "c00" / "extra.jpg")
    grown = gpupipe.build_loader(data, "pillow", **kw)
    with pytest.raises(ValueError, match="samples 8 -> 9"):  # what the loader itself says of such a state
        grown.load_state_dict(position)
    restart, notice = on_changed_data(position, grown, tmp_path)
    assert restart == {"epoch": 0, "batch": 0} and "8 samples then, 9 now" in notice
    grown.load_state_dict(restart)
    fresh = gpupipe.build_loader(data, "pillow", **kw)
    for (x, y), (fx, fy) in zip(grown, fresh, strict=True):
        assert torch.equal(x, fx) and torch.equal(y, fy)


def test_a_refused_resume_lists_every_changed_key_the_changeable_ones_too(tmp_path):
    """The probe: ``--image-size 64 --lr 0.3 --resume`` listed only image_size."""
    from gpupipe.train.config import TrainConfig
    from gpupipe.train.resume import check_resumable

    saved = {**asdict(TrainConfig(data=str(tmp_path), image_size=32, lr=0.05))}
    with pytest.raises(ValueError) as e:
        check_resumable(saved, TrainConfig(data=str(tmp_path), image_size=64, lr=0.3), tmp_path / "last.pt")
    assert str(e.value) == (
        f"{tmp_path / 'last.pt'}: cannot resume with image_size 32 -> 64: they decide the checkpoint's shapes or the "
        "data order; restore them, or start a new run in another --out (also changed, which --allow-config-change "
        "allows: lr 0.05 -> 0.3)"
    )
