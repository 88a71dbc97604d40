"""The training core on the CPU: accumulation, precision, resume after a kill, DDP through torchrun."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpupipe.train import checkpoint
from gpupipe.train.config import TrainConfig, load_config
from gpupipe.train.loop import train

from .conftest import make_folder
from .probe import Tiny


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


def _torchrun(*args, timeout=300):
    probe = os.path.join(os.path.dirname(__file__), "probe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", probe, *args]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def test_ddp_no_sync_accumulation_equals_one_big_batch(data, tmp_path):
    """2 ranks x 2 micro-batches of 4 under gloo DDP == one process with batches of 16 (float64, 1e-6); gradients
    are all-reduced once per optimizer step (no_sync on the other micro-batches), not once per micro-batch."""
    torch.manual_seed(0)
    init = Tiny().double().state_dict()
    torch.save(init, tmp_path / "init.pt")
    model = Tiny().double()
    model.load_state_dict(init)
    model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
    cfg = _cfg(data, tmp_path / "big", batch_size=16, epochs=1, optimizer="sgd", momentum=0.0, clip=None, model="tiny")
    train(cfg, model=model)
    out = tmp_path / "ddp"
    out.mkdir()
    _torchrun("tiny64", str(out), str(tmp_path / "init.pt"), str(data), "4", "2")
    big, ddp = _weights(tmp_path / "big"), _weights(out)
    for k in big:
        torch.testing.assert_close(big[k], ddp[k], rtol=0, atol=1e-6)
    ranks = [torch.load(out / f"probe-rank{r}.pt", weights_only=True) for r in (0, 1)]
    steps = 32 // 16
    assert [r["allreduces"] for r in ranks] == [steps, steps]  # one bucket, once per step
    for k in big:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k


def test_torchrun_two_ranks(data, tmp_path):
    """``torchrun ... -m gpupipe train --device cpu``: disjoint shards, identical parameters, rank 0 alone logs."""
    out = tmp_path / "ddp"
    _torchrun("cli", "--", "train", "--data", str(data), "--out", str(out), "--model", "test_resnet", "--epochs", "2",
              "--batch-size", "4", "--image-size", "32", "--workers", "0", "--device", "cpu", "--accum", "2")
    assert (out / "checkpoints" / "last.pt").exists()
    assert (out / "metrics.jsonl").read_text().count("\n") == 2  # one row per epoch: rank 0 alone wrote it
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "probe-rank0.pt",
                                                     "probe-rank1.pt", "tb"]
    ranks = [torch.load(out / f"probe-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for epoch in (0, 1):
        shards = [{i for e, i in r["seen"] if e == epoch} for r in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(32))  # 32 samples, no padding needed
    saved = _weights(out)
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k]), k
        assert torch.equal(v, saved[k]), k


def _probe(*args):
    return [sys.executable, os.path.join(os.path.dirname(__file__), "probe.py"), *args]


def test_kill_during_checkpoint_write_keeps_the_previous_one(data, tmp_path):
    """SIGKILL in the middle of the 3rd checkpoint write: the 2nd stays loadable, and resuming from it ends with the
    straight run's weights."""
    subprocess.run(_cli(data, tmp_path / "straight", "--save-every", "3"), check=True)
    out = tmp_path / "killed"
    proc = subprocess.run(_probe("kill-in-save", "3", "--", *_cli(data, out, "--save-every", "3")[3:]), timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert list((out / "checkpoints").glob(".last.pt.tmp-*"))  # the torn write is there, beside the good file
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert state["step"] == 6  # the saves at steps 3 and 6 made it; the 3rd (the epoch end, step 8) was torn
    subprocess.run(_cli(data, out, "--resume", "--save-every", "3"), check=True)
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not list((out / "checkpoints").glob(".last.pt.tmp-*"))  # the next save cleared the torn one


def test_a_rank_that_dies_stops_the_other_in_bounded_time(data, tmp_path):
    """Two ranks started by hand (no torchrun agent to kill the survivor): rank 1 exits after 2 batches; rank 0,
    blocked in an all-reduce, must fail with an error well within its --dist-timeout-s, not wait forever."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _cli(data, tmp_path / "run", "--dist-timeout-s", "30")[3:]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(_probe("rank-exits", "1", "2", "--", *args), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert procs[1].wait(timeout=120) == 3
    t0 = time.monotonic()
    try:
        code = procs[0].wait(timeout=60)
    finally:
        procs[0].kill()
    assert code != 0
    assert time.monotonic() - t0 < 60
