"""gpupipe/train/resume.py: a resume refuses data whose classes changed since the checkpoint (the model's outputs
are the checkpoint's classes: a renamed folder would re-label every sample, an added one change the head)."""

import shutil
import subprocess

import pytest

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
