"""One backend registry: every name comes from it, and a backend added there works everywhere."""

import re

import pytest
import torch

import gpupipe
from gpupipe import backends
from gpupipe.backends.cpu import cpu_decoder_spec
from gpupipe.backends.pillow import PillowDecoder


class _ToyDecoder(PillowDecoder):
    name = "toy"


@pytest.fixture()
def toy():
    backends.register(cpu_decoder_spec("toy", "Pillow under another name", _ToyDecoder, lambda: None))
    yield "toy"
    backends.unregister("toy")


def test_a_backend_added_in_one_place_works_everywhere(folder, toy, tmp_path):
    assert toy in gpupipe.available_backends() and toy in backends.cpu_decoders()
    kw = dict(batch_size=4, train=False, image_size=32, num_workers=0, device="cpu", normalize=False)
    (x, y), (rx, ry) = (
        next(iter(gpupipe.build_loader(folder, toy, **kw))),
        next(iter(gpupipe.build_loader(folder, "pillow", **kw))),
    )
    assert torch.equal(x, rx) and torch.equal(y, ry)
    path = next(folder.rglob("*.jpg"))
    assert torch.equal(gpupipe.read_image(path, toy), gpupipe.read_image(path, "pillow"))

    from gpupipe.cli import main

    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--data",
                str(folder),
                "--backends",
                toy,
                "--pipelines",
                "decode",
                "--device",
                "cpu",
                "--workers",
                "0",
                "--seconds",
                "0.3",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert '"backend": "toy"' in out.read_text()


def test_unknown_names_list_the_registry(folder):
    with pytest.raises(ValueError, match="valid names: auto, pillow, pillow-simd, turbojpeg, dali, nvjpeg, synthetic"):
        gpupipe.build_loader(folder, "pil")
    with pytest.raises(ValueError, match="lower case"):
        backends.register(cpu_decoder_spec("Toy", "", _ToyDecoder, lambda: None))


def test_a_backend_refuses_a_device_it_cannot_deliver_to(folder):
    spec = backends.get("nvjpeg")
    assert spec.devices == ("cuda",)
    if "nvjpeg" in gpupipe.available_backends():
        with pytest.raises(ValueError, match="delivers batches on cuda"):
            gpupipe.build_loader(folder, "nvjpeg", device="cpu")


def test_a_name_is_registered_once_unless_overridden(toy):
    first = backends.get(toy)
    again = cpu_decoder_spec(toy, "another toy", _ToyDecoder, lambda: None)
    with pytest.raises(ValueError, match="backend 'toy' is already registered; pass override=True"):
        backends.register(again)
    assert backends.get(toy) is first
    backends.register(again, override=True)
    assert backends.get(toy) is again and backends.names().count(toy) == 1


def test_backend_name_literal_lists_the_registry():
    import typing

    from gpupipe._options import BUILTIN_BACKENDS  # the CLI's choices, known without importing the backends
    from gpupipe.backends import BackendName

    assert typing.get_args(BackendName) == ("auto", *backends.names()) == ("auto", *BUILTIN_BACKENDS)


@pytest.mark.parametrize(
    "backend, kwargs, message",
    [
        ("synthetic", dict(pin_memory=True), "backend 'synthetic' does not use pin_memory (it runs no DataLoader)"),
        ("synthetic", dict(prefetch_factor=2, persistent_workers=False), "does not use prefetch_factor, persistent_"),
        ("pillow", dict(num_workers=0, prefetch_factor=2), "need worker processes: num_workers > 0"),
        ("pillow", dict(num_workers=0, persistent_workers=True), "need worker processes: num_workers > 0"),
    ],
)
def test_settings_a_backend_ignores_are_refused(folder, backend, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gpupipe.build_loader(folder, backend, device="cpu", **{"num_workers": 1, **kwargs})


def test_nvjpeg_refuses_pin_memory_and_dali_every_dataloader_setting():
    from gpupipe.api import _dataloader_settings

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"'nvjpeg' does not use pin_memory .*uses only prefetch_factor, persistent"):
        _dataloader_settings(backends.get("nvjpeg"), cuda, 2, True, None, None)
    assert _dataloader_settings(backends.get("nvjpeg"), cuda, 2, None, 3, False).prefetch_factor == 3
    with pytest.raises(ValueError, match="'dali' does not use persistent_workers"):
        _dataloader_settings(backends.get("dali"), cuda, 2, None, None, True)
    # defaults: pinned for CUDA, 4 batches per worker, persistent workers
    settings = _dataloader_settings(backends.get("pillow"), cuda, 2, None, None, None)
    assert settings.kwargs(2) == dict(num_workers=2, pin_memory=True, prefetch_factor=4, persistent_workers=True)
    assert settings.kwargs(0) == dict(num_workers=0, pin_memory=True)
