"""The Dockerfile and pyproject.toml must not drift apart (no Docker engine runs here to build the image)."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M).group(1)


def _dep(name: str, group: list[str]) -> Requirement:
    return next(Requirement(r) for r in group if Requirement(r).name.lower() == name)


def test_torch_versions_satisfy_pyproject():
    deps = PYPROJECT["project"]["dependencies"]
    assert Version(_arg("TORCH_VERSION")) in _dep("torch", deps).specifier
    assert Version(_arg("TORCHVISION_VERSION")) in _dep("torchvision", deps).specifier


def test_cuda_base_matches_the_dali_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert _dep("nvidia-dali-cuda120", extras["dali"])  # CUDA 12 DALI ...
    assert re.match(r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu", _arg("CUDA_IMAGE"))  # ... on a CUDA 12 base
    assert "cu12" in _arg("TORCH_INDEX")
    bundled = set(re.fullmatch(r"gpupipe\[(.*)\]", extras["all"][0]).group(1).split(","))
    assert {"turbojpeg", "dali", "train", "bench"} <= bundled  # the image's backends come with `.[all]`


def test_installs_the_all_extra_then_pillow_simd_last_and_checks_it():
    build = DOCKERFILE.split("AS runtime")[0]
    assert build.index('pip install ".[all]"') < build.index("pillow-simd==")
    assert 'CC="cc -mavx2"' in build
    assert "gpupipe info --json" in DOCKERFILE and "pil_simd" in DOCKERFILE
    assert "libturbojpeg0" in DOCKERFILE.split("AS runtime")[1]


def test_runtime_is_non_root_with_gpupipe_entrypoint():
    runtime = DOCKERFILE.split("AS runtime")[1]
    assert re.search(r"^USER (?!root|0\b)\S+", runtime, re.M)
    assert 'ENTRYPOINT ["gpupipe"]' in runtime and 'CMD ["info"]' in runtime
    assert "build-essential" not in runtime
