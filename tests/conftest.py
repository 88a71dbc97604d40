import random

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe import backends

# From the registry: every decoding backend usable here that delivers on the CPU (pillow, turbojpeg, DALI's CPU
# pipeline...), and the ones among them that decode image by image in DataLoader workers.
CPU_LOADER_BACKENDS = [
    b for b in gpupipe.available_backends() if backends.get(b).read is not None and "cpu" in backends.get(b).devices
]
DECODERS = [b for b in backends.cpu_decoders() if b in gpupipe.available_backends()]


def cpu_and_cuda():
    return ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def prevent_leaking_rng():
    """torchvision's habit: a test may use the global RNGs, but must not change them for the next test."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)


def photo(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """A smooth, photo-like image (JPEG-friendly), distinct per rng."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a = rng.uniform(0, 255, 3)
    b = rng.uniform(0.1, 0.5, 3)
    img = a + 60 * np.sin(x[..., None] * b / 7 + y[..., None] * b[::-1] / 11)
    img += rng.normal(0, 3, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_folder(root, classes: int, per_class: int, seed: int = 0, sizes=((120, 180), (200, 150), (96, 96))):
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"c{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = sizes[(c + i) % len(sizes)]
            photo(rng, h, w).save(d / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """4 classes x 6 JPEGs of mixed sizes."""
    return make_folder(tmp_path_factory.mktemp("folder"), 4, 6)


@pytest.fixture(scope="session")
def unique_folder(tmp_path_factory):
    """13 classes of one image each: a label identifies its sample."""
    return make_folder(tmp_path_factory.mktemp("unique"), 13, 1, seed=1)
