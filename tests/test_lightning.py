"""gpupipe inside the real Lightning (2.6): ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` over a
LightningDataModule of gpupipe loaders, as examples/lightning_ddp.py runs it. Each rank reads its own shard in equal
steps, and a mid-epoch ``ModelCheckpoint`` resumed with ``fit(ckpt_path=...)`` trains and validates on exactly the
straight run's batches (labels and pixels) on every rank, with gradient accumulation and a validation loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .common_utils import CPU_LOADER_BACKENDS, REPO_ROOT, SHUTDOWN_SEEN, make_folder, shutdown_watch

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

EXAMPLE = REPO_ROOT / "examples" / "lightning_ddp.py"
SAMPLES = 48  # one image per class: a label names its sample


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("lightning"), SAMPLES, 1, sizes=((40, 48), (36, 36), (48, 40)))


def _fit(data, out, record, backend, *extra):
    record.parent.mkdir(parents=True, exist_ok=True)  # the --record folder itself the example makes
    cmd = [sys.executable, str(EXAMPLE), str(data), "--val", str(data), "--out", str(out), "--record", str(record)]
    watch = shutdown_watch(record.parent / "watch")
    env = {**os.environ, "PYTHONPATH": f"{watch}{os.pathsep}{REPO_ROOT}"}
    r = subprocess.run([*cmd, "--backend", backend, *extra], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert SHUTDOWN_SEEN not in r.stderr  # both ranks left once the group was destroyed, not through the shutdown
    assert r.stdout.count("done: ") == 1 and "val_loss" in r.stdout, r.stdout  # rank 0 says how it ended
    return [[json.loads(line) for line in open(record / f"rank{rank}.jsonl")] for rank in range(2)]


def _train(records):
    return [(r["epoch"], r["batch"], r["labels"], r["pixels"]) for r in records if r["stage"] == "train"]


def _val(records):
    return [(r["epoch"], r["batch"], r["labels"], r["pixels"]) for r in records if r["stage"] == "val"]


RUNS = [pytest.param(b, False, id=b) for b in CPU_LOADER_BACKENDS]
RUNS += [pytest.param("pillow", True, id="pillow-plain-datamodule")]  # build_loader alone, no gpupipe.lightning


@pytest.mark.parametrize("backend, plain", RUNS)
def test_a_mid_epoch_checkpoint_resumes_to_the_straight_runs_batches(data, tmp_path, backend, plain):
    flags = ["--plain"] if plain else []
    straight = _fit(data, tmp_path / "run", tmp_path / "straight", backend, "--keep", "-1", *flags)
    # 48 samples, 2 ranks, batches of 4: 6 batches a rank an epoch; 2 accumulated batches an optimizer step, so the
    # checkpoint of step 2 is taken after batch 4 of epoch 0 (mid-epoch)
    ckpt = tmp_path / "run" / "epoch=0-step=2.ckpt"
    resumed = _fit(data, tmp_path / "resumed-run", tmp_path / "resumed", backend, "--ckpt", str(ckpt), *flags)
    for rank in range(2):
        assert len(_train(straight[rank])) == 12  # 2 epochs, equal steps on every rank
        rest = [b for b in _train(straight[rank]) if (b[0], b[1]) >= (0, 4)]
        assert _train(resumed[rank]) == rest  # the same batches, labels and pixels, from where it stopped
        assert _val(resumed[rank]) == _val(straight[rank]) and len(_val(straight[rank])) == 2 * 6
    for epoch in range(2):  # each rank its own shard: disjoint, together the whole data set
        shards = [{y for e, _, ys, _ in _train(straight[rank]) if e == epoch for y in ys} for rank in range(2)]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(SAMPLES))
    val = [{y for _, _, ys, _ in _val(straight[rank]) for y in ys} for rank in range(2)]
    assert not val[0] & val[1] and val[0] | val[1] == set(range(SAMPLES))  # evaluation: every sample once
