"""What ``gpupipe info`` reports (gpupipe/info.py): the machine's values, each backend's availability, where gpupipe
came from, and one readable line per value. The CLI around it is in test_cli.py."""

import json
import re
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch

import gpupipe
from gpupipe import backends, info
from gpupipe._system import WORKER_NICENESS, cores_per_rank, usable_cores


def test_machine_info_reports_this_machine():
    m = info.machine_info()
    assert m["cores_usable"] == usable_cores() >= 1
    assert m["decode_workers"] == {
        "cpu": cores_per_rank(),
        "cuda": max(1, cores_per_rank() - 1),
        "niceness": WORKER_NICENESS,
    }
    assert m["torch"] == torch.__version__
    assert m["cuda_devices"] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert isinstance(m["pil_simd"], bool)
    assert m["gpupipe"]["imported_from"] == str(Path(gpupipe.__file__).parent)
    json.dumps(m)  # `gpupipe info --json` and the bench report store it as is


def test_backend_status_is_the_registry_s_reasons():
    status = info.backend_status()
    assert tuple(status) == tuple(backends.names())
    assert status["pillow"] is None and status["synthetic"] is None
    for name, reason in status.items():
        assert reason == backends.unavailable_reason(name)
        assert (reason is None) == (name in gpupipe.available_backends())


def test_turbojpeg_library_names_the_loaded_file():
    found = info.turbojpeg_library()
    if "turbojpeg" not in gpupipe.available_backends():
        assert found is None
    else:
        assert re.fullmatch(r"(\d+\.\d+\.\d+|version unknown) \(.*libturbojpeg[^)]*\)", found), found


class _Dist:
    def __init__(self, summary, direct_url):
        self.version, self.metadata, self._direct = "9.9", {"Summary": summary}, direct_url

    def read_text(self, name):
        assert name == "direct_url.json"
        return self._direct


@pytest.mark.parametrize(
    "summary, direct_url, distribution, problem",
    [
        (
            "Keep the GPU busy: ...",
            '{"url": "file:///src", "dir_info": {"editable": true}}',
            "file:///src (editable)",
            None,
        ),
        ("Keep the GPU busy: ...", None, "a package index", None),
        ("Keep the GPU busy: ...", "{not json", "a package index", None),
        ("Streaming pipelines", None, "a package index", "is another project ('Streaming pipelines')"),
    ],
)
def test_install_info_says_where_gpupipe_came_from(monkeypatch, summary, direct_url, distribution, problem):
    monkeypatch.setattr(info, "distribution", lambda name: _Dist(summary, direct_url))
    got = info.install_info()
    assert got["distribution"] == f"gpupipe 9.9 from {distribution}"
    assert (
        (got["problem"] is None)
        if problem is None
        else (problem in got["problem"] and "pip uninstall" in got["problem"])
    )


def test_install_info_from_a_source_tree(monkeypatch):
    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(info, "distribution", missing)
    got = info.install_info()
    assert got["distribution"] is None and got["problem"] is None
    assert (
        info.describe("gpupipe", got) == f"not installed (run from a source tree); imported from {got['imported_from']}"
    )


@pytest.mark.parametrize(
    "key, value, line",
    [
        ("dali", {"installed": False}, "not installed"),
        (
            "dali",
            {"installed": True, "package": "nvidia-dali-cuda120 2.4", "gpu": True},
            "nvidia-dali-cuda120 2.4 (GPU and CPU)",
        ),
        ("dali", {"installed": True, "gpu": False}, "installed (CPU only: no GPU)"),
        (
            "dali",
            {"installed": True, "package": "nvidia-dali-cuda120 2.4", "gpu": False, "problem": "DALI for CUDA 12 ..."},
            "nvidia-dali-cuda120 2.4 (CPU only: no GPU); DALI for CUDA 12 ...",
        ),
        ("cuda_devices", [], "none"),
        ("cuda_devices", ["H100", "H100"], "H100, H100"),
        ("torch_cuda", None, "-"),
        ("cores_usable", 8, "8"),
    ],
)
def test_describe_reads_as_one_line(key, value, line):
    assert info.describe(key, value) == line


@pytest.mark.parametrize(
    "torch_cuda, package, fix",
    [
        ("13.0", "nvidia-dali-cuda130 2.4.0", None),
        ("12.8", "nvidia-dali-cuda120 2.4.0", None),
        (None, "nvidia-dali-cuda120 2.4.0", None),  # a CPU torch: DALI's CPU pipelines run either way
        ("13.0", "nvidia-dali-cuda120 2.4.0", '12 beside torch for CUDA 13: (.*) \\(pip install ".\\[dali\\]"\\)'),
        ("12.8", "nvidia-dali-cuda130 2.4.0", '13 beside torch for CUDA 12: (.*) \\(pip install ".\\[dali-cu12\\]"\\)'),
        ("11.8", "nvidia-dali-cuda120 2.4.0", "12 beside torch for CUDA 11: (.*) \\(install DALI for CUDA 11\\)"),
    ],
)
def test_gpupipe_info_says_when_dali_was_built_for_another_cuda_than_torch(monkeypatch, torch_cuda, package, fix):
    """The `[all]` extras once put DALI for CUDA 12 beside torch for CUDA 13: `gpupipe info` names the mismatch and the
    extra that matches torch."""
    import re

    from gpupipe.backends import dali

    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    problem = dali._cuda_mismatch(package)
    assert problem is None if fix is None else re.fullmatch(f"DALI for CUDA {fix}", problem or "")
