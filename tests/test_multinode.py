"""Two "nodes" on this machine: two ``torchrun --nnodes 2 --rdzv-backend c10d`` agents of one process each, training
from prepared shards on a local S3-compatible server (moto's, on 127.0.0.1): every rank reads its own shard of the
samples, both take the same number of steps, and a run stopped after an epoch resumes to the straight run's
weights, bit for bit."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.train import checkpoint

from .common_utils import make_folder

PROBE = os.path.join(os.path.dirname(__file__), "probe.py")


@pytest.fixture(scope="module")
def shards_url(s3, tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("multinode"), 4, 8)  # 32 samples
    out = tmp_path_factory.mktemp("multinode-prepared") / "out"
    prepare(folder, out, PrepareOptions(shard_size=16 * 1024))
    return s3.upload(out, "multinode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(data: str, out, *extra: str, mode: tuple[str, ...] = ("cli",), status: int = 0) -> None:
    """Both agents at once, as two machines would start them (SLURM: one ``srun`` task per node)."""
    port = _free_port()
    train = ["train", "--data", data, "--out", str(out), "--model", "test_resnet", "--batch-size", "4"]
    train += ["--image-size", "32", "--workers", "0", "--device", "cpu", *extra]
    agents = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)),
                *("--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
                *("--rdzv-id", f"gpupipe-test-{port}", PROBE, *mode, "--", *train),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        _, err = agent.communicate(timeout=400)
        assert (agent.returncode == 0) == (status == 0), err[-3000:]


def _ranks(out):
    return [torch.load(out / f"probe-rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.slow
def test_two_nodes_train_from_s3_and_resume_exactly(shards_url, tmp_path):
    straight = tmp_path / "straight"
    _two_nodes(shards_url, straight, "--epochs", "2")
    ranks = _ranks(straight)
    for epoch in (0, 1):
        shards = [[i for e, i in r["seen"] if e == epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1]) == 16  # equal steps: 4 batches of 4 each
        assert not set(shards[0]) & set(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(32))
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k]), k

    stopped = tmp_path / "stopped"  # both ranks stop after 6 of their 8 batches (checkpoints every 3 steps)
    _two_nodes(shards_url, stopped, "--epochs", "2", "--save-every", "3", mode=("all-exit", "6"), status=3)
    _two_nodes(shards_url, stopped, "--epochs", "2", "--save-every", "3", "--resume")
    resumed = _ranks(stopped)
    assert [len(r["seen"]) for r in resumed] == [8, 8]  # epoch 1's last 2 batches of 4, per rank
    for r, s in zip(resumed, ranks, strict=True):
        assert r["seen"] == s["seen"][-8:]  # the same samples, in the same order, as the straight run's
    a = checkpoint.load(f"{straight}/checkpoints/last.pt")["model"]
    b = checkpoint.load(f"{stopped}/checkpoints/last.pt")["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
