"""gpupipe with the real Accelerate (1.15): ``prepare(model, optimizer)`` with the loader beside it, ``prepare(loader)``
handing the loader back unchanged, and ``register_for_checkpointing(loader)`` + ``save_state`` mid-epoch +
``load_state`` giving exactly the straight run's batches on 2 ranks (torchrun, gloo), under Accelerate's bf16 autocast
on gpupipe's normalised batches (examples/accelerate_loop.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import gpupipe

from .common_utils import CPU_LOADER_BACKENDS, REPO_ROOT, SHUTDOWN_SEEN, make_folder, same_device, shutdown_watch

accelerate = pytest.importorskip("accelerate")

EXAMPLE = REPO_ROOT / "examples" / "accelerate_loop.py"
SAMPLES = 48  # one image per class: a label names its sample


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("accelerate"), SAMPLES, 1, sizes=((40, 48), (36, 36), (48, 40)))


@pytest.fixture()
def accelerator():
    from accelerate.state import AcceleratorState

    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def _torchrun(data, out, record, backend, *flags):
    record.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE)]
    cmd += [str(data), "--out", str(out), "--record", str(record), "--backend", backend, "--precision", "bf16"]
    watch = shutdown_watch(record.parent / "watch")
    env = {**os.environ, "PYTHONPATH": f"{watch}{os.pathsep}{REPO_ROOT}", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*cmd, *flags], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert SHUTDOWN_SEEN not in r.stderr  # each rank left after end_training, not through the interpreter's shutdown
    assert r.stdout.count("done: 48 images") == 1, r.stdout  # the main process says how it ended
    ranks = [[json.loads(line) for line in open(record / f"rank{rank}.jsonl")] for rank in range(2)]
    return ranks, (record / "weights.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_save_state_mid_epoch_and_load_state_resume_exactly(data, tmp_path, backend):
    # 48 samples, 2 ranks, batches of 4: 6 steps an epoch; the state is saved after step 5 (mid-epoch 0)
    straight, weights = _torchrun(data, tmp_path / "state", tmp_path / "straight", backend, "--save-at", "5")
    resumed, resumed_weights = _torchrun(data, tmp_path / "state", tmp_path / "resumed", backend, "--resume")
    for rank in range(2):
        assert len(straight[rank]) == 12 and straight[rank][5:] == resumed[rank]  # labels and pixels, 2 epochs
        assert {r["computed"] for r in straight[rank] + resumed[rank]} == {"torch.bfloat16"}  # Accelerate's autocast
    assert resumed_weights == weights  # and so the same model at the end
    for epoch in range(2):  # each rank its own shard
        shards = [{y for r in straight[rank] if r["epoch"] == epoch for y in r["labels"]} for rank in range(2)]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(SAMPLES))


def _loader(data, **kw):
    return gpupipe.build_loader(data, "pillow", batch_size=4, image_size=16, num_workers=0, device="cpu", **kw)


def test_prepare_hands_the_loader_back_unchanged(data, accelerator):
    """Accelerate wraps only torch DataLoaders: a gpupipe loader given to ``prepare`` comes back as it was (it shards
    and places batches itself), so passing it or not makes no difference."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(data)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader and accelerator.prepare(loader) is loader
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)
    reference = _loader(data)
    for (x, y), (xr, yr) in zip(prepared, reference, strict=True):
        assert torch.equal(x, xr) and torch.equal(y, yr)


def test_register_for_checkpointing_saves_the_delivered_position(data, accelerator, tmp_path):
    loader = _loader(data)
    accelerator.register_for_checkpointing(loader)
    batches = iter(loader)
    seen = [next(batches)[1] for _ in range(3)]
    accelerator.save_state(tmp_path / "state")
    after = [y for _, y in batches]
    fresh = _loader(data)
    accelerator._custom_objects[0] = fresh  # a new process would register its own loader
    accelerator.load_state(tmp_path / "state")
    assert {k: fresh.state_dict()[k] for k in ("epoch", "batch")} == {"epoch": 0, "batch": 3}
    rest = [y for _, y in fresh]
    assert len(seen) + len(rest) == len(loader)
    assert all(torch.equal(a, b) for a, b in zip(rest, after, strict=True))


@pytest.mark.gpu
def test_fp16_autocast_on_the_device_stage_batches(data):
    from accelerate.state import AcceleratorState

    accelerator = accelerate.Accelerator(mixed_precision="fp16")
    try:
        loader = gpupipe.build_loader(
            data, "pillow", batch_size=4, image_size=16, num_workers=0, device=accelerator.device, channels_last=True
        )
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, SAMPLES))
        # lr 1e-3: 784 inputs of unit scale make a step of lr 0.1 diverge (fp32 included), and fp16 logits then overflow
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        assert accelerator.scaler is not None  # fp16 on CUDA: the GradScaler is in the loop
        losses = []
        for images, labels in loader:
            assert same_device(images.device, accelerator.device) and images.dtype == torch.float32  # cuda:0, cuda
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        assert len(losses) == len(loader) and bool(torch.isfinite(torch.stack(losses)).all())
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
