"""train/precision.py: the optimizer step says whether it was taken; only fp16's scaler skips one."""

import pytest
import torch
from torch import nn

from gpupipe.train.precision import Precision


def _step(precision: Precision, grad: float) -> tuple[bool, torch.Tensor, torch.Tensor]:
    model = nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        loss = model(torch.ones(1, 2)).sum()
    precision.backward(loss)
    model.weight.grad.fill_(grad)
    return precision.step(optimizer), before, model.weight.detach()


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_without_a_scaler_every_step_is_taken(name):
    precision = Precision(name, torch.device("cpu"))
    assert not precision.scaler.is_enabled()
    taken, before, after = _step(precision, float("inf"))
    assert taken and not torch.equal(before, after)


def test_fp16_scaler_skips_a_step_with_inf_gradients_and_says_so():
    precision = Precision("fp16", torch.device("cpu"))
    taken, before, after = _step(precision, 1.0)
    assert taken and not torch.equal(before, after)
    taken, before, after = _step(precision, float("inf"))
    assert not taken and torch.equal(before, after)


def test_clipping_bounds_the_gradient_norm():
    precision = Precision("fp32", torch.device("cpu"), clip=0.5)
    model = nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad.fill_(10.0)
    assert precision.step(optimizer)
    assert torch.linalg.vector_norm(model.weight.grad) == pytest.approx(0.5, rel=1e-4)


def test_an_fp16_resume_from_a_run_without_a_scaler_starts_a_fresh_one():
    fp32 = Precision("fp32", torch.device("cpu"))
    fp16 = Precision("fp16", torch.device("cpu"))
    fp16.load_state_dict(fp32.state_dict())
    assert fp16.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
