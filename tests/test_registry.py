"""One backend registry: every name comes from it, and a backend added there works everywhere."""

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
