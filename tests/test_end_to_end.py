"""The end-to-end bench (gpupipe/bench/end_to_end.py): a timm model trained fed by each backend, against synthetic."""

import pytest
import torch

from gpupipe.bench.end_to_end import run_end_to_end
from gpupipe.bench.records import Config

from .common_utils import make_folder

pytest.importorskip("timm")


@pytest.mark.slow
def test_each_backend_trains_the_model_and_is_compared_with_synthetic(tmp_path):
    data = make_folder(tmp_path / "data", 2, 8)
    cfg = Config(
        str(data),
        ["pillow", "synthetic"],  # synthetic runs first, once, whatever the order asked for
        ["train"],
        0,  # decode in the training process
        torch.device("cpu"),
        batch_size=4,
        seconds=0.5,
        image_size=32,
        model="test_resnet",
    )
    said = []
    rows = run_end_to_end(cfg, lambda text, fraction=None: said.append(text), megapixels=0.25)
    assert said == ["end-to-end test_resnet with synthetic", "end-to-end test_resnet with pillow"]
    assert [(r.backend, r.pipeline, r.device) for r in rows] == [
        ("synthetic", "train:test_resnet", "cpu"),
        ("pillow", "train:test_resnet", "cpu"),
    ]
    synthetic, pillow = rows
    for r in rows:
        assert r.images_per_s > 0 and r.megapixels_per_s == pytest.approx(r.images_per_s * 0.25)
        assert r.workers == 0 and r.images_per_s_per_worker == r.images_per_s  # per worker: at least one
        assert 0 <= r.extra["data_wait"] < 1, r  # a share of the timed window
        assert r.extra["vs_synthetic"] == pytest.approx(r.images_per_s / synthetic.images_per_s)
    assert synthetic.extra["vs_synthetic"] == 1.0 and pillow.extra["vs_synthetic"] > 0
