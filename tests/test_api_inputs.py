"""``build_loader`` given what a new user gives it: a transform with a bug, a CSV list with absolute paths, an
image size of 0."""


import pytest
import torch
from torchvision import transforms as T

import gpupipe

BACKENDS = [b for b in ("pillow", "turbojpeg", "dali") if b in gpupipe.available_backends()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_bug_in_the_users_transform_is_raised_as_the_transforms_not_skipped_as_data(folder, backend, on_error):
    tf = T.Compose([T.ToTensor(), T.Normalize((0.5,), (0.5,))])  # torchvision's PIL habit: gpupipe gives tensors
    for train in (False, True):
        loader = gpupipe.build_loader(
            folder,
            backend,
            batch_size=4,
            train=train,
            image_size=32,
            device="cpu",
            num_workers=1,
            transforms=tf,
            on_error=on_error,
        )
        with pytest.raises(gpupipe.TransformError) as e:
            next(iter(loader))
        msg = str(e.value)
        assert "ToTensor()" in msg and "TypeError: pic should be PIL Image" in msg  # the member that raised
        assert "cannot decode" not in msg and loader.skipped == []
        if backend != "dali":  # decoded in workers, which know the file
            assert msg.startswith(str(folder)) and msg.split(":")[0].endswith(".jpg")


def test_a_transform_that_works_is_unchanged(folder):
    loader = gpupipe.build_loader(
        folder,
        "pillow",
        batch_size=4,
        image_size=32,
        device="cpu",
        num_workers=0,
        normalize=False,
        transforms=[T.RandomErasing(p=1.0)],
    )
    images, _ = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)


@pytest.mark.parametrize("size", [0, -1])
def test_image_size_zero_is_an_error_not_224(folder, size):
    with pytest.raises(ValueError, match=f"image_size must be >= 1, got {size}"):
        gpupipe.build_loader(folder, "pillow", image_size=size, device="cpu", num_workers=0)
