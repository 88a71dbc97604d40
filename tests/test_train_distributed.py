"""gpupipe/train/distributed.py: the launcher's variables read, or refused in one line naming them (a value that is no
number, a set no launch could make)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gpupipe.train import checkpoint
from gpupipe.train.distributed import Distributed, ranks_from_env

from .common_utils import REPO_ROOT, gpupipe_cli, make_folder, train_args


@pytest.mark.parametrize(
    "env, ranks",
    [
        ({}, (1, 0, 0)),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, (2, 1, 1)),
        ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, (4, 3, 1)),  # a second node
        ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, (1, 0, 0)),
        ({"LOCAL_RANK": "0"}, (1, 0, 0)),
    ],
)
def test_ranks_as_torchrun_sets_them(monkeypatch, env, ranks):
    _set(monkeypatch, env)
    assert ranks_from_env() == ranks


@pytest.mark.parametrize(
    "env, named",
    [
        ({"RANK": "1"}, "RANK without WORLD_SIZE"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK without WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE 2 without RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK 2 is not below WORLD_SIZE 2"),
        ({"WORLD_SIZE": "1", "RANK": "1"}, "RANK 1 is not below WORLD_SIZE 1"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "1"}, "LOCAL_RANK 1 above RANK 0"),
    ],
)
def test_inconsistent_variables_are_refused_by_name(monkeypatch, env, named):
    _set(monkeypatch, env)
    with pytest.raises(ValueError, match="torchrun") as e:
        ranks_from_env()
    assert named in str(e.value) and "\n" not in str(e.value)


def _set(monkeypatch, env: dict) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("name", ["LOCAL_RANK", "RANK", "WORLD_SIZE"])
def test_a_launcher_variable_that_is_no_number_is_named(monkeypatch, name):
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ValueError, match=f"environment variable {name}='abc': expected a whole number >= 0"):
        Distributed("cpu")


@pytest.mark.slow
def test_a_stray_rank_is_one_line_before_anything_is_written(tmp_path):
    """``RANK=1`` left in a shell, no ``WORLD_SIZE``: not a run as rank 1 that trains, saves nothing and exits 0."""
    data, out = make_folder(tmp_path / "data", 2, 2), tmp_path / "run"
    run = gpupipe_cli("train", *train_args(data, out, epochs=1), env={"RANK": "1"})
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "RANK=1" in lines[0] and "without WORLD_SIZE" in lines[0], run.stderr
    assert not out.exists()


def _count_collectives(data, out, **overrides) -> list[list[str]]:
    """``gpupipe train`` on two gloo ranks under tests/test_sync.py's counter (tests/probe.py count): rank 0's
    collectives per micro-batch, the epoch's end falling to its last."""
    probe = os.path.join(os.path.dirname(__file__), "probe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", probe, "count"]
    args = train_args(data, out, **{"epochs": 1, "log_every": 1000, **overrides})
    subprocess.run([*cmd, "--", "train", *args], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return [collectives for _, collectives in torch.load(out / "count-rank0.pt", weights_only=True)["steps"]]


@pytest.mark.slow
def test_an_epoch_end_averages_the_buffers_in_one_all_reduce_and_gathers_none(tmp_path):
    """timm's test_resnet (BatchNorm: 2 floating buffers per norm layer) on two ranks: the epoch's end was one
    all-reduce per buffer, then one all-gather per buffer for the checkpoint. Now: the epoch's metrics, one flat
    all-reduce of the buffers, the barrier after the save, the stop check. A mid-epoch checkpoint (--save-every)
    still gathers each rank's buffers, which differ there, in the first epoch and after an epoch's end alike."""
    data = make_folder(tmp_path / "data", 2, 8)  # 2 micro-batches per rank and epoch
    steps = _count_collectives(data, tmp_path / "end")
    assert steps[-1] == ["all_reduce", "all_reduce", "barrier", "all_reduce"], steps[-1]  # the last: the stop check
    mid = _count_collectives(data, tmp_path / "mid", save_every=1, epochs=2)
    assert len(mid) == 4 and mid[-1] == steps[-1], mid
    gathers = [segment.count("all_gather") for segment in mid]
    assert gathers[0] == gathers[2] > 0 and gathers[1] == gathers[3] == 0, mid


def _two_ranks(data, val, out, *extra: str) -> subprocess.CompletedProcess:
    """``gpupipe train`` on two gloo ranks (torchrun), as a user launches it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "gpupipe"]
    args = train_args(data, out, *extra, val=val, epochs=2, log_every=1, save_every=2, keep_checkpoints=8)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*cmd, "train", *args], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _epoch_lines(out) -> list[dict]:
    """The epochs' figures in metrics.jsonl that do not depend on the clock."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("images_per_s", "data_wait", "startup_s")} for line in lines]


@pytest.mark.slow
def test_a_two_rank_run_resumed_mid_epoch_ends_as_the_straight_run_in_every_tensor_and_figure(tmp_path):
    """Stopped mid-epoch (the checkpoint of step 6: epoch 1, batch 2 of 4 per rank, each rank's BatchNorm statistics
    its own) and resumed on two ranks: every tensor of the last checkpoint (weights, BatchNorm buffers, optimizer) and
    every logged figure of the epochs is the straight run's, to the bit. DDP's construction broadcasts rank 0's
    buffers: rank 1 resumed with rank 0's statistics, and its loss sums were rank 0's."""
    data, val = make_folder(tmp_path / "data", 2, 16), make_folder(tmp_path / "val", 2, 4, seed=1)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _two_ranks(data, val, straight)
    saved = checkpoint.load(straight / "checkpoints" / "step-00000006.pt")
    assert saved["loader"] == {**saved["loader"], "epoch": 1, "batch": 2}
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "checkpoints" / "step-00000006.pt", resumed / "checkpoints" / "last.pt")
    run = _two_ranks(data, val, resumed, "--resume")
    assert "resumed from epoch 1, batch 2 (optimizer step 6)" in run.stderr
    a, b = (checkpoint.load(out / "checkpoints" / "last.pt") for out in (straight, resumed))
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for k, v in a["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, b["optimizer"]["state"][k][name]), (k, name)
    assert _epoch_lines(resumed) == _epoch_lines(straight)[1:]
