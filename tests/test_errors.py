"""gpupipe/errors.py: gpupipe's own exceptions, their messages and their pickling."""

import pickle

import torch
from torchvision.transforms import v2

from gpupipe import TransformError


def test_a_transform_is_named_on_one_line():
    """torchvision's Compose writes each member on a line of its own, indented: the message kept the newlines."""
    compose = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.RandomApply([v2.Grayscale()])])
    e = TransformError("a.jpg", repr(compose), "TypeError: no")
    assert e.transform == "Compose(ToDtype(scale=True), RandomApply(Grayscale(num_output_channels=1)))"
    assert "\n" not in str(e) and str(e).startswith(f"a.jpg: your transforms= failed in {e.transform}: TypeError: no")
    assert pickle.loads(pickle.dumps(e)).transform == e.transform
