"""The training core on the CPU: accumulation, precision, resume after a kill, DDP through torchrun."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from gpupipe.train import checkpoint
from gpupipe.train.config import TrainConfig, load_config
from gpupipe.train.loop import train

from .conftest import make_folder


class Tiny(nn.Module):
    """No BatchNorm: micro-batches and one big batch must give the same gradients."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean((2, 3)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("train"), 4, 8)


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model="test_resnet", epochs=2, batch_size=8, image_size=32, workers=0,
                device="cpu", lr=0.05, warmup_epochs=0.5, log_every=1)
    return TrainConfig(**{**base, **kw})


def _weights(out):
    return checkpoint.load(f"{out}/checkpoints/last.pt")["model"]


def test_accumulation_equals_one_big_batch(data, tmp_path):
    torch.manual_seed(0)
    init = Tiny().double().state_dict()

    def run(batch, accum, out):
        model = Tiny().double()
        model.load_state_dict(init)
        # the loader delivers float32; the model computes in float64
        cfg = _cfg(data, out, batch_size=batch, accum=accum, epochs=1, optimizer="sgd", momentum=0.0, clip=None)
        model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
        train(cfg, model=model)
        return _weights(out)

    big, micro = run(16, 1, tmp_path / "big"), run(4, 4, tmp_path / "micro")
    for k in big:
        torch.testing.assert_close(big[k], micro[k], rtol=0, atol=1e-6)


def test_bf16_and_fp16_with_clipping_run(data, tmp_path):
    for p in ("bf16", "fp16"):
        metrics = train(_cfg(data, tmp_path / p, precision=p, clip=1.0, epochs=1))
        assert metrics["train_loss"] == metrics["train_loss"]  # not NaN


def test_outputs_and_refusing_to_overwrite(data, tmp_path):
    out = tmp_path / "run"
    metrics = train(_cfg(data, out, val=str(data), epochs=1))
    assert {"epoch", "train_loss", "images_per_s", "data_wait", "val_loss", "val_acc"} <= metrics.keys()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1
    assert list((out / "tb").iterdir())
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert {"model", "optimizer", "scaler", "scheduler", "epoch", "step", "rng", "loader"} <= state.keys()
    with pytest.raises(FileExistsError, match="--resume"):
        train(_cfg(data, out, epochs=1))


def _cli(data, out, *extra):
    return [sys.executable, "-m", "gpupipe", "train", "--data", str(data), "--out", str(out), "--model", "test_resnet",
            "--epochs", "2", "--batch-size", "4", "--image-size", "32", "--workers", "0", "--device", "cpu",
            "--lr", "0.05", *extra]


@pytest.mark.parametrize("save_every", [0, 3])
def test_killed_run_resumes_to_the_straight_runs_weights(data, tmp_path, save_every):
    subprocess.run(_cli(data, tmp_path / "straight", "--save-every", str(save_every)), check=True)
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cli(data, out, "--save-every", str(save_every)))
    ckpt = out / "checkpoints" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(_cli(data, out, "--resume", "--save-every", str(save_every)), check=True)
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert checkpoint.load(ckpt)["loader"]["epoch"] == 2  # the run's own epoch count, not more


def test_config_file_overrides_only_what_it_names(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nprecision: bf16\n")
    cfg = load_config(str(f), {"lr": 0.5, "model": None})
    assert (cfg.epochs, cfg.precision, cfg.lr, cfg.model) == (3, "bf16", 0.5, TrainConfig.model)
    f.write_text("epocs: 3\n")
    with pytest.raises(Exception, match="epocs"):
        load_config(str(f))
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


def test_torchrun_two_ranks(data, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "gpupipe",
           "train", "--data", str(data), "--out", str(out), "--model", "test_resnet", "--epochs", "1",
           "--batch-size", "4", "--image-size", "32", "--workers", "0", "--device", "cpu", "--accum", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, timeout=300)
    assert (out / "checkpoints" / "last.pt").exists()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1  # rank 0 alone wrote it
