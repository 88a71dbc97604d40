"""The project's own files as a new user meets them: ``pip install .`` (pyproject.toml), ``make demo``, the test
output."""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_setuptools_reads_pyproject_without_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []  # was: `project.license` as a TOML table, 3 times
    assert dist.metadata.license_expression == "Apache-2.0"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_writes_the_held_out_split_the_readme_trains_with(tmp_path):
    plan = subprocess.run(
        ["make", "-n", "demo", f"DATA={tmp_path}/sample"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert f"gpupipe sample-data {tmp_path}/sample\n" in plan
    assert f"gpupipe sample-data {tmp_path}/sample-val --split val\n" in plan  # the README's --val data/sample-val


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("df") is None, reason="needs make and df")
def test_a_new_venv_on_a_full_disk_is_refused_before_the_install_starts(tmp_path):
    """CI's install once ended midway in pip's "No space left on device": the set-up names the space it needs first."""
    venv, stubs = tmp_path / "venv", tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text("#!/bin/sh\nexit 3\n")  # past the check, nothing installs: the venv is not made
    (stubs / "python3").chmod(0o755)
    done = subprocess.run(
        ["make", "setup", f"VENV={venv}", "MIN_FREE_GB=100000000", "MAKE=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"},
    )
    assert done.returncode != 0
    assert f"GB free in {tmp_path}/: a new {venv} needs about 100000000 GB" in done.stderr
    assert "MIN_FREE_GB=0" in done.stderr
    assert not venv.exists()  # nothing was installed


def test_installed_dali_is_for_torchs_cuda():
    """`make demo`'s venv (`.[all]`) had DALI for CUDA 12 beside torch's CUDA 13: two CUDAs in one venv."""
    import re
    from importlib.metadata import distributions

    import torch

    names = {d.metadata["Name"] for d in distributions()}
    dalis = sorted(n for n in names if re.fullmatch(r"nvidia-dali-cuda\d+", n or ""))
    if not dalis or torch.version.cuda is None:
        pytest.skip("needs DALI and a CUDA build of torch installed (the all extra)")
    major = torch.version.cuda.split(".")[0]
    assert dalis == [f"nvidia-dali-cuda{major}0"], (
        f"{', '.join(dalis)} beside torch {torch.__version__} (CUDA {torch.version.cuda}): run `make setup` again"
    )


@pytest.mark.slow
def test_nvjpeg_tests_print_no_deprecation_warning():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_nvjpeg.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": ""},
    )
    assert out.returncode == 0, out.stdout[-2000:]
    assert "DeprecationWarning" not in out.stdout  # torchvision 0.29's notice about its image codecs


def test_the_api_pages_name_every_public_name():
    """The README's `backend=` switch and docs/loader.md's API section between them."""
    import gpupipe

    readme = (ROOT / "README.md").read_text()
    loader = (ROOT / "docs" / "loader.md").read_text()
    section = readme[readme.index("## The `backend=` switch") : readme.index("## Train")]
    section += loader[: loader.index("## Workers and the training thread")]
    assert "gpupipe.read_image(" in section  # was missing from the API section
    assert [n for n in gpupipe.__all__ if f"gpupipe.{n}" not in section] == []


def test_every_python_dash_m_in_the_docs_runs_in_a_dev_install():
    """Each ``python -m MODULE`` the pages show names a module that ``pip install -e ".[all,dev]"`` provides (the
    wheel command once needed ``build``, which no extra installs; pip builds a wheel by itself)."""
    import importlib.util
    import re

    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]
    modules = {m for page in pages for m in re.findall(r"python -m ([A-Za-z_][\w.]*)", page.read_text())}
    assert "gpupipe" in modules
    assert sorted(m for m in modules if importlib.util.find_spec(m) is None) == []
