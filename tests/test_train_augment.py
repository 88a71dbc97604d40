"""``gpupipe train`` with timm's augmentation flags: RandAugment, MixUp/CutMix, random erasing, model EMA."""

import subprocess

import pytest
import torch

from gpupipe.train import checkpoint

from .common_utils import killed_at_first_checkpoint, make_folder, train_cli

pytest.importorskip("timm")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("train_aug"), 4, 4)


def _cli(data, out, **overrides):
    """A quick run with timm's flags, ``--smoothing`` (timm's name for --label-smoothing) among them."""
    timm_flags = {
        "val": data,
        "epochs": 1,
        "batch_size": 8,
        "aa": "rand-m9-mstd0.5-inc1",
        "mixup": 0.2,
        "cutmix": 1.0,
        "reprob": 0.25,
        "model_ema": True,
        "model_ema_decay": 0.9,
    }
    return train_cli(data, out, "--smoothing", "0.1", **{**timm_flags, **overrides})


@pytest.mark.slow
def test_trains_with_timm_flags_and_checkpoints_the_ema(data, tmp_path):
    out = tmp_path / "run"
    subprocess.run(_cli(data, out), check=True)
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert state["config"]["aa"] == "rand-m9-mstd0.5-inc1" and state["config"]["label_smoothing"] == 0.1
    assert state["model_ema"].keys() == state["model"].keys()
    differs = [
        k
        for k in state["model"]
        if state["model"][k].is_floating_point() and not torch.equal(state["model"][k], state["model_ema"][k])
    ]
    assert differs  # the EMA lags the model
    metrics = (out / "metrics.jsonl").read_text()
    assert '"ema_val_acc"' in metrics and '"val_acc"' in metrics


@pytest.mark.slow
def test_bad_policy_is_a_clear_error(data, tmp_path):
    proc = subprocess.run(_cli(data, tmp_path / "bad", aa="rand-q3"), capture_output=True, text=True)
    assert proc.returncode == 2 and "unsupported RandAugment" in proc.stderr


@pytest.mark.slow
def test_killed_augmented_run_resumes_to_the_straight_runs_weights(data, tmp_path):
    """RandAugment, erasing and MixUp/CutMix are keyed by sample and step, the EMA is checkpointed: a run killed
    mid-epoch and resumed ends where the straight run does."""

    def cli(out, **extra):
        return _cli(data, out, epochs=2, batch_size=4, save_every=2, **extra)

    subprocess.run(cli(tmp_path / "straight"), check=True)
    out = tmp_path / "killed"
    ckpt = killed_at_first_checkpoint(cli(out), out)
    subprocess.run(cli(out, resume=True), check=True)
    a, b = checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.pt"), checkpoint.load(ckpt)
    for part in ("model", "model_ema"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
