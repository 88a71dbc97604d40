"""train/checkpoint.py: what a checkpoint holds, its digest, the kept earlier ones, a full disk, planted links."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from gpupipe.train import checkpoint
from gpupipe.train.checkpoint import CheckpointError, TrainState
from gpupipe.train.precision import Precision

from .common_utils import REPO_ROOT


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 4))  # mostly tensor data
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    return TrainState(model, optimizer, scheduler, Precision("fp32", torch.device("cpu")))


def _train_steps(state: TrainState, n: int) -> None:
    x = torch.linspace(-1, 1, 256).reshape(4, 64)
    for _ in range(n):
        loss = state.model(x).square().mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1


def _save(path, state: TrainState, keep: int = 2, batch: int = 0) -> None:
    checkpoint.save(
        path, state, loader={"epoch": 1, "batch": batch}, running={"loss": 1.5}, config={"lr": 0.1}, keep=keep
    )


def test_save_and_restore_give_back_the_model_optimizer_schedule_and_rngs(tmp_path):
    a = _state()
    _train_steps(a, 3)
    path = tmp_path / "checkpoints" / "last.pt"
    _save(path, a, batch=5)
    expected_rand = torch.rand(3)  # what the RNG gives after the save: the resumed run must draw the same

    b = _state(seed=1)
    saved = checkpoint.load_for_resume(path)
    checkpoint.restore(saved, b)
    assert torch.equal(torch.rand(3), expected_rand)
    assert saved["loader"] == {"epoch": 1, "batch": 5} and saved["running"] == {"loss": 1.5}
    assert b.step == 3 and saved["config"] == {"lr": 0.1}
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    _train_steps(a, 1)
    _train_steps(b, 1)  # the optimizer's moments came back too: one more step agrees
    for va, vb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(va, vb)


def _flip_middle(path, n: int = 64) -> None:
    """What the probe did: 64 bytes in the middle of the file inverted, in place."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    with open(path, "r+b") as f:  # in place: the damage reaches every name of the file
        f.write(data)


def test_flipped_bytes_are_refused_naming_the_file_and_the_previous_good_one(tmp_path):
    state = _state()
    path = tmp_path / "last.pt"
    for _ in range(3):
        _train_steps(state, 2)
        _save(path, state, batch=state.step)
    assert sorted(p.name for p in checkpoint.kept(tmp_path)) == ["step-00000004.pt", "step-00000006.pt"]
    _flip_middle(path)
    assert checkpoint.load(path)  # torch alone does not notice: the probe resumed with changed weights
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_for_resume(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: cannot resume from it (damaged")
    previous = tmp_path / "step-00000004.pt"
    assert f"previous good checkpoint is {previous} (epoch 1, batch 4, step 4)" in msg
    assert f"--resume-from {previous}" in msg
    assert checkpoint.load_for_resume(previous)["step"] == 4


@pytest.mark.parametrize(
    "content, cause",
    [
        (b"", "empty"),
        (b"hello", "not a gpupipe train checkpoint: 5 bytes, no digest"),  # the probe: "(101)"
        (os.urandom(5000), "no gpupipe digest"),
        ("truncated", "no gpupipe digest"),
        ("no digest", "no gpupipe digest"),
        ("foreign", "not a gpupipe train checkpoint: no model"),
    ],
)
def test_broken_files_are_one_line_naming_the_file_and_cause(tmp_path, content, cause):
    path = tmp_path / "last.pt"
    if content == "truncated":
        _save(path, _state(), keep=1)
        content = path.read_bytes()[:1000]
    elif content == "no digest":  # a plain torch.save of a whole checkpoint
        _save(tmp_path / "whole.pt", _state(), keep=1)
        torch.save(checkpoint.load(tmp_path / "whole.pt"), path)
        content = path.read_bytes()
    elif content == "foreign":  # a whole file with a digest, holding something else
        checkpoint.save_atomic({"hello": torch.zeros(2)}, path, keep=1)
        content = path.read_bytes()
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_for_resume(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: cannot resume from it ({cause}")
    assert "no earlier good checkpoint is kept" in msg and "delete it" in msg


@pytest.mark.parametrize("keep", [2, 3])
def test_the_last_n_are_kept_and_older_ones_removed(tmp_path, keep):
    state = _state()
    path = tmp_path / "last.pt"
    for _ in range(5):
        _train_steps(state, 1)
        _save(path, state, keep=keep)
    names = [p.name for p in checkpoint.kept(tmp_path)]
    assert names == [f"step-{s:08d}.pt" for s in range(5, 5 - keep, -1)]
    assert os.path.samefile(path, tmp_path / names[0])  # the newest is last.pt: a hard link, no extra space
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, "last.pt"])  # no temp file left


def test_a_planted_link_at_the_temp_name_is_not_followed(tmp_path):
    """The temp file is created exclusively: a symlink planted at its (predictable) name is replaced, not written
    through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    path = tmp_path / "ckpt" / "last.pt"
    path.parent.mkdir()
    (path.parent / f".last.pt.tmp-{os.getpid()}").symlink_to(victim)
    _save(path, _state())
    assert victim.read_text() == "user data"
    assert checkpoint.load_for_resume(path)["step"] == 0


_WRITE_UNTIL_FULL = """
import sys, torch
from torch import nn
sys.path.insert(0, {repo!r})
from gpupipe.train import checkpoint
path = sys.argv[1]
checkpoint.save_atomic({{"step": 1, "w": torch.zeros(1000)}}, path)  # the previous, good checkpoint
try:
    checkpoint.save_atomic({{"step": 2, "w": torch.zeros(2_000_000)}}, path)  # 8 MB: more than the disk holds
except checkpoint.CheckpointError as e:
    print(e)
    sys.exit(1)
"""


@contextlib.contextmanager
def small_disk(tmp_path, size: int = 1 << 20):
    """``(folder, limit)``: a real tmpfs of ``size`` bytes where this process may mount one (root, in a machine or a
    privileged container), ``limit`` None; else a plain folder and ``limit``, a ``preexec_fn`` that sets the same
    limit on file sizes (RLIMIT_FSIZE: writes beyond it fail with EFBIG, as writes to a full disk with ENOSPC)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode == 0:
        try:
            yield mnt, None
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
    else:

        def limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

        yield mnt, limit


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "write.py"
    script.write_text(_WRITE_UNTIL_FULL.format(repo=str(REPO_ROOT)))
    with small_disk(tmp_path) as (disk, limit):
        path = disk / "last.pt"
        r = subprocess.run(
            [sys.executable, str(script), str(path)], capture_output=True, text=True, preexec_fn=limit, timeout=60
        )
        assert r.returncode == 1 and not r.stderr, r.stderr
        line = r.stdout.strip()
        assert "\n" not in line and line.startswith(f"{path}: cannot write the checkpoint (")
        assert "No space left on device" in line or "File too large" in line
        assert "previous checkpoint, if any, is intact" in line
        assert checkpoint.verify(path) is None
        assert checkpoint.load(path)["step"] == 1
        assert [p.name for p in disk.iterdir() if p.name.startswith(".")] == []  # the torn temp file is gone


def test_torn_temp_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        torn, busy = tmp_path / f".last.pt.tmp-{dead.pid}", tmp_path / f".last.pt.tmp-{live.pid}"
        torn.write_bytes(b"PK half")
        busy.write_bytes(b"PK being written")
        _save(tmp_path / "last.pt", _state())
        assert not torn.exists() and busy.exists()
    finally:
        live.kill()
        live.wait()


def test_an_fp16_run_resumed_from_a_checkpoint_of_a_plain_optimizer_keeps_its_fused_one(tmp_path):
    """A checkpoint's param groups carry the saving run's implementation (``fused``: None): loaded as they are, an
    fp16 run's fused SGD (GradScaler hands it its inf check) became a plain one, whose first step then failed."""
    old = _state()
    old.optimizer = torch.optim.SGD(old.model.parameters(), lr=0.1, momentum=0.9)
    old.scheduler = torch.optim.lr_scheduler.LambdaLR(old.optimizer, lambda s: 1.0)
    _train_steps(old, 2)
    _save(tmp_path / "last.pt", old)
    new = _state()
    new.optimizer = torch.optim.SGD(new.model.parameters(), lr=0.1, momentum=0.9, fused=True)
    new.scheduler = torch.optim.lr_scheduler.LambdaLR(new.optimizer, lambda s: 1.0)
    new.precision = Precision("fp16", torch.device("cpu"))
    checkpoint.restore(checkpoint.load_for_resume(tmp_path / "last.pt"), new)
    assert new.optimizer.param_groups[0]["fused"] and "momentum_buffer" in new.optimizer.state[new.model[0].weight]
    with new.precision.autocast():
        loss = new.model(torch.ones(4, 64)).float().square().mean()
    new.precision.backward(loss)
    new.precision.step(new.optimizer)  # was: AssertionError("Expected grad_scale and found_inf to be None")


def test_in_a_copied_run_folder_the_offer_is_the_step_file_of_the_damaged_save(tmp_path):
    """``cp -r`` gives every file the copy's modification time, the older step file possibly the newest: the time
    each checkpoint records still orders them."""
    state = _state()
    run = tmp_path / "run"
    for _ in range(3):
        _train_steps(state, 2)
        _save(run / "last.pt", state, batch=state.step)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("step-00000006.pt", "step-00000004.pt", "last.pt"):  # the older step file copied last: newest
        shutil.copyfile(run / name, copy / name)
    assert checkpoint.kept(copy)[0].name == "step-00000004.pt"
    _flip_middle(copy / "last.pt")
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_for_resume(copy / "last.pt")
    same_save = copy / "step-00000006.pt"
    assert f"previous good checkpoint is {same_save} (epoch 1, batch 6, step 6)" in str(e.value)
    good = checkpoint.newest_good(copy / "last.pt")
    assert good is not None and good[0] == same_save and good[1]["step"] == 6


def test_a_checkpoint_without_a_recorded_save_time_is_ordered_by_its_modification_time(tmp_path):
    state = _state()
    for _ in range(3):
        _train_steps(state, 2)
        _save(tmp_path / "last.pt", state, batch=state.step)
    for name in ("step-00000004.pt", "step-00000006.pt"):  # as saved before checkpoints recorded the time
        saved = checkpoint.load(tmp_path / name)
        del saved["saved_at"]
        checkpoint.save_atomic(saved, tmp_path / f"old-{name}", keep=1)
        os.replace(tmp_path / f"old-{name}", tmp_path / name)
    os.utime(tmp_path / "step-00000004.pt", ns=(1, 1))  # the oldest
    (tmp_path / "last.pt").write_bytes(b"torn")
    good = checkpoint.newest_good(tmp_path / "last.pt")
    assert good is not None and good[0].name == "step-00000006.pt"
