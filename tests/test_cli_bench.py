import json

import pytest

import gpupipe
from gpupipe.cli import main


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["pillow"] == "available"
    keys = {"torch", "torchvision", "pil", "pil_simd", "libjpeg_turbo", "dali", "cores_usable"}
    assert keys <= info["machine"].keys()


def test_sample_data_is_an_imagefolder_of_jpegs(tmp_path):
    assert main(["sample-data", str(tmp_path), "--classes", "3", "--per-class", "2"]) == 0
    data = gpupipe.build_loader(tmp_path, "pillow", batch_size=2, train=False, num_workers=0, device="cpu").dataset
    assert data.classes == ["class_00", "class_01", "class_02"] and len(data) == 6
    from PIL import Image

    for path, _ in data.samples:
        with Image.open(path) as im:
            assert im.format == "JPEG" and 300 <= min(im.size) and max(im.size) <= 600


def test_bench_table_json_plot_and_auto(tmp_path, folder, capsys, monkeypatch):
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path / "cache"))
    backends = [b for b in ("pillow", "turbojpeg", "dali", "synthetic") if b in gpupipe.available_backends()]
    j, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", "--data", str(folder), "--device", "cpu", "--workers", "1", "--backends", ",".join(backends),
               "--pipelines", "decode,floor,train,eval", "--seconds", "0.3", "--repeats", "2", "--batch-size", "8",
               "--image-size", "32", "--json", str(j),
               "--plot", str(png)])
    assert rc == 0
    rep = json.loads(j.read_text())
    got = {(r["backend"], r["pipeline"]) for r in rep["results"]}
    assert {("baseline", "train"), ("baseline", "eval")} <= got
    for b in backends:
        assert (b, "train") in got and (b, "eval") in got
        assert b == "synthetic" or (b, "decode") in got
        assert ((b, "floor") in got) == (b in ("pillow", "turbojpeg"))  # the CPU decoders' train floor
    if "dali" in backends:  # DALI's own pipeline, timed beside the dali backend
        assert {("dali-reference", "train"), ("dali-reference", "eval")} <= got
    for r in rep["results"]:
        assert r["images_per_s"] > 0 and r["workers"] == 1 and r["device"] == "cpu"
        if r["pipeline"] in ("train", "eval"):
            assert r["vs_baseline"] > 0
        assert ("vs_floor" in r) == (r["pipeline"] == "train" and r["backend"] in ("pillow", "turbojpeg"))
    assert {"torch", "cpu", "cores_usable"} <= rep["machine"].keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "img/s" in capsys.readouterr().out
    # backend="auto" now follows the measurement
    real = set(backends) - {"synthetic"}
    best = max((r for r in rep["results"] if r["pipeline"] == "eval" and r["backend"] in real),
               key=lambda r: r["images_per_s"])["backend"]
    loader = gpupipe.build_loader(folder, "auto", train=False, batch_size=4, num_workers=0, device="cpu")
    assert loader.backend == best


def test_bench_rejects_unavailable_backend(folder):
    if "nvjpeg" in gpupipe.available_backends():
        pytest.skip("CUDA is here")
    assert main(["bench", "--data", str(folder), "--device", "cpu", "--backends", "nvjpeg"]) == 2
