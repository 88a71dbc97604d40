"""train/precision.py: only fp16's scaler skips a step, and with the optimizer ``gpupipe train`` builds no step (skipped
or not, clipped or not) makes the host wait: the skip is counted on the device and read when asked."""

import itertools

import pytest
import torch
from torch import nn

from gpupipe.train import checkpoint
from gpupipe.train.build import build_optimizer
from gpupipe.train.loop import train
from gpupipe.train.precision import Precision

from .common_utils import train_config
from .test_sync import CopyAndSyncCounter

CPU = torch.device("cpu")


def _step(precision: Precision, grad: float, model=None, optimizer=None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    model = model or nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        loss = model(torch.ones(1, model.in_features)).float().sum()
    precision.backward(loss)
    model.weight.grad.fill_(grad * precision.scaler.get_scale() if precision.scaler.is_enabled() else grad)
    precision.step(optimizer)
    return precision.skipped_steps() == 0, before, model.weight.detach().clone()


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_without_a_scaler_every_step_is_taken(name):
    precision = Precision(name, CPU)
    assert not precision.scaler.is_enabled()
    taken, before, after = _step(precision, float("inf"))
    assert taken and not torch.equal(before, after)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_scaler_skips_a_step_with_inf_gradients_and_says_so(fused):
    precision = Precision("fp16", CPU)
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    taken, before, after = _step(precision, 1.0, model, optimizer)
    assert taken and not torch.equal(before, after)
    taken, before, after = _step(precision, float("inf"), model, optimizer)
    assert not taken and torch.equal(before, after)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_an_fp16_step_with_gpupipe_trains_optimizer_makes_the_host_wait_for_nothing(tmp_path, optimizer, clip):
    """The CPU stands in for the device (tests/test_sync.py's counter): GradScaler's ``found_inf.item()`` was one sync
    an optimizer step. Four steps: the first overflows fp16 at the first scale (65536), the third has inf gradients;
    no sync, and both skips are still told."""
    cfg = train_config(tmp_path, tmp_path / "out", precision="fp16", optimizer=optimizer, clip=clip)
    model = nn.Linear(4, 3)
    optimizer_ = build_optimizer(cfg, model)
    precision = Precision("fp16", CPU, clip=clip)
    weights, counter = [model.weight.detach().clone()], CopyAndSyncCounter(CPU)
    for grad in (1.0, 1.0, float("inf"), 1.0):
        with precision.autocast():
            loss = model(torch.ones(1, 4)).float().sum()  # a criterion's output: fp32
        with counter.counting():
            precision.backward(loss)
            for p in model.parameters():
                p.grad.mul_(grad)
            precision.step(optimizer_)
        weights.append(model.weight.detach().clone())
        optimizer_.zero_grad(set_to_none=True)
    assert counter.syncs == []
    assert precision.skipped_steps() == 2 and precision.skipped_steps() == 0  # read, then counted afresh
    assert [not torch.equal(a, b) for a, b in itertools.pairwise(weights)] == [False, True, False, True]


def test_a_skipped_first_fused_sgd_step_leaves_no_uninitialised_momentum():
    """torch's fused SGD makes its momentum buffers with ``empty_like`` on the first step and fills them in the kernel
    that a skipped step never runs: the next steps would add garbage (NaN). After a skipped first step the fused
    steps equal the default implementation's."""
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(64, 8, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, fused=fused)
        precision = Precision("fp16", CPU)
        taken = [_step(precision, g, model, optimizer)[0] for g in (float("inf"), 1.0, 0.5)]
        runs.append(model.weight.detach())
        assert taken == [False, True, True]
    assert runs[1].isfinite().all()
    torch.testing.assert_close(runs[1], runs[0])


def test_the_momentum_buffers_are_checked_until_every_parameter_has_one_not_every_step(monkeypatch):
    """The check loops over every parameter in Python: it ran before every fp16 step. Now it runs until each parameter
    has its buffer (one without a gradient yet keeps it going), and again when a parameter is added."""
    from gpupipe.train import precision as module

    calls = []
    real = module._zero_momentum
    monkeypatch.setattr(module, "_zero_momentum", lambda optimizer: calls.append(1) or real(optimizer))
    torch.manual_seed(0)
    model, unused = nn.Linear(8, 2), nn.Linear(8, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *unused.parameters()], lr=0.1, momentum=0.9, fused=True)
    precision = Precision("fp16", CPU)
    for _ in range(3):
        _step(precision, 1.0, model, optimizer)
    assert len(calls) == 3  # ``unused`` has no gradient: not done
    optimizer.param_groups[0]["params"] = list(model.parameters())  # every one has its buffer: the checks end
    for _ in range(3):
        _step(precision, 1.0, model, optimizer)
    assert len(calls) == 3
    extra = nn.Parameter(torch.zeros(2))
    optimizer.add_param_group({"params": [extra]})
    extra.grad = torch.zeros(2)
    _step(precision, 1.0, model, optimizer)
    assert len(calls) == 4 and optimizer.state[extra]["momentum_buffer"] is not None


def test_clipping_bounds_the_gradient_norm():
    precision = Precision("fp32", CPU, clip=0.5)
    model = nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad.fill_(10.0)
    precision.step(optimizer)
    assert torch.linalg.vector_norm(model.weight.grad) == pytest.approx(0.5, rel=1e-4)


def test_an_fp16_resume_from_a_run_without_a_scaler_starts_a_fresh_one():
    fp32 = Precision("fp32", CPU)
    fp16 = Precision("fp16", CPU)
    fp16.load_state_dict(fp32.state_dict())
    assert fp16.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()


@pytest.mark.slow
def test_an_fp16_run_resumed_mid_epoch_ends_with_the_straight_runs_weights_and_scale(folder, tmp_path):
    """The fused optimizer's state, the scaler's scale and growth tracker and the schedule (which counts skipped steps)
    are in the checkpoint: resumed from a mid-epoch one, the run ends as the straight one, bit for bit."""
    kw = dict(precision="fp16", clip=1.0, epochs=2, batch_size=4, save_every=2, keep_checkpoints=10)
    straight = train(train_config(folder, tmp_path / "a", **kw))
    mid = sorted((tmp_path / "a" / "checkpoints").glob("step-*.pt"))[1]  # epoch 0's step 4 of 6
    resumed = train(train_config(folder, tmp_path / "b", resume_from=str(mid), **kw))
    a, b = (checkpoint.load(tmp_path / run / "checkpoints" / "last.pt") for run in ("a", "b"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] < 65536.0  # fp16 overflowed at the first scale
    assert a["scheduler"] == b["scheduler"] and a["step"] == b["step"]
    assert straight["fp16_skipped_steps"] == resumed["fp16_skipped_steps"]  # epoch 1's, read at its end
