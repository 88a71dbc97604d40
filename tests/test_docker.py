"""docker/Dockerfile: its pins agree with pyproject.toml (always), and the image builds and runs (GPUPIPE_DOCKER=1)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def _arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert m, f"docker/Dockerfile has no ARG {name}=..."
    return m.group(1)


def _stage(name: str) -> str:
    m = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert m, f"docker/Dockerfile has no stage {name}"
    return m.group(1)


def _dep(name: str, group: list[str]) -> Requirement:
    return next(Requirement(r) for r in group if Requirement(r).name.lower() == name)


def _all_extras() -> set[str]:
    return set(re.fullmatch(r"gpupipe\[(.*)\]", EXTRAS["all"][0]).group(1).split(","))


def test_pins_satisfy_pyproject():
    deps = PYPROJECT["project"]["dependencies"]
    assert Version(_arg("TORCH_VERSION")) in _dep("torch", deps).specifier
    assert Version(_arg("TORCHVISION_VERSION")) in _dep("torchvision", deps).specifier
    assert Version(_arg("TORCHCODEC_VERSION")) in _dep("torchcodec", EXTRAS["nvjpeg"]).specifier
    # pillow-simd stands in for Pillow: its version must meet the "pillow" requirement (checked again in the image)
    assert Version(_arg("PILLOW_SIMD_VERSION")) in _dep("pillow", deps).specifier


def test_one_cuda_major_torch_and_dali_from_the_dali_extra():
    """torch's wheels on the package index carry CUDA 13: the dali extra (in `.[all]`, what `make demo` installs) is
    DALI for CUDA 13, the image pins it, and the image installs `.[all]` itself; dali-cu12 is for a CUDA 12 torch."""
    (dali,) = (Requirement(r) for r in EXTRAS["dali"])
    assert dali.name == "nvidia-dali-cuda130"
    assert Version(_arg("DALI_VERSION")) in dali.specifier
    assert f'"{dali.name}==${{DALI_VERSION}}"' in _stage("venv")
    assert "dali" in _all_extras() and "dali-cu12" not in _all_extras()
    assert [Requirement(r).name for r in EXTRAS["dali-cu12"]] == ["nvidia-dali-cuda120"]


def test_the_image_installs_all():
    assert _arg("EXTRAS") == "all"
    assert 'pip install -c /opt/pins.txt ".[${EXTRAS}]"' in _stage("venv")


def test_pillow_simd_built_with_avx2_and_installed_last():
    simd, venv = _stage("pillow-simd"), _stage("venv")
    assert 'CC="cc -mavx2"' in simd and "grep -q ymm" in simd  # the build fails without AVX2 code
    assert venv.index('".[${EXTRAS}]"') < venv.index("pip uninstall -y pillow") < venv.index("--no-deps /wheels/")
    assert "RUN pip install" not in venv.split("--no-deps /wheels/")[1]


def test_runtime_is_checked_non_root_with_no_compilers():
    runtime = _stage("runtime")
    assert "RUN python /opt/check_image.py" in runtime  # every backend, or the build fails
    assert re.search(r"^USER (?!root|0\b)\S+", runtime, re.M)
    assert 'ENTRYPOINT ["gpupipe"]' in runtime and 'CMD ["info"]' in runtime
    assert not re.search(r"\b(gcc|build-essential|-dev)\b", runtime)
    assert "COPY --from=pillow-simd" not in runtime and "rm -rf /var/lib/apt/lists/*" in runtime
    assert "NVIDIA_VISIBLE_DEVICES=all" in runtime and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in runtime


def _engine() -> str | None:
    """Why no container engine is usable here, or None."""
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    return None if shutil.which("podman") else "neither docker (with a running daemon) nor podman is installed"


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_image_builds_and_runs_info_bench_train_resume(tmp_path):
    """`make docker-test`: the build (3.4 GB of wheels) and a run inside it as its user, on the CPU."""
    if os.environ.get("GPUPIPE_DOCKER") != "1":
        pytest.skip("set GPUPIPE_DOCKER=1 to build the image and run it (3.4 GB of wheels; 40 min the first time)")
    if (why := _engine()) is not None:
        pytest.skip(why)
    env = {**os.environ, "OUT": str(tmp_path)}
    out = subprocess.run(["make", "-s", "docker-test"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "docker-test passed" in out.stdout
    assert (tmp_path / "run" / "train" / "checkpoints" / "last.pt").stat().st_size > 0
