"""gpupipe/sources/named.py: a dataset object named on the command line (``module:callable``, ``module.Class:ROOT``),
and ``gpupipe train --data`` reading one, and Parquet files, as it reads a folder."""

import json

import numpy as np
import pytest
import torchvision

from gpupipe.cli import main
from gpupipe.sources.named import is_named_dataset, open_named, resolved
from gpupipe.sources.open import open_source

from .common_utils import make_folder, train_args


def sixteen():
    """A dataset a user's module makes: sixteen (HWC array, label) items of four classes."""
    rng = np.random.default_rng(2)
    return [(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8), i % 4) for i in range(16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("named"), 4, 4)


def test_a_callable_and_a_class_with_a_root_are_opened(folder):
    assert len(open_named("tests.test_named:sixteen")) == 16
    made = open_named(f"torchvision.datasets.ImageFolder:{folder}")
    assert isinstance(made, torchvision.datasets.ImageFolder) and made.root == str(folder)


def test_paths_and_urls_are_not_names(folder, tmp_path):
    (tmp_path / "a:b").mkdir()
    assert is_named_dataset("tests.test_named:sixteen")
    for data in (str(folder), "s3://bucket/train", str(tmp_path / "a:b"), "data/sample"):
        assert not is_named_dataset(data), data


@pytest.mark.parametrize(
    "data, why",
    [
        ("tests.test_named:nothing", r"AttributeError: module 'tests.test_named' has no attribute 'nothing'"),
        ("nosuchmodule.Data:root", r"ValueError: no module nosuchmodule to import"),
        ("torchvision.datasets.ImageFolder:/no/such/folder", r"FileNotFoundError: .*/no/such/folder"),
    ],
)
def test_a_name_that_cannot_be_made_is_one_line(data, why):
    with pytest.raises(ValueError, match=rf"^{data}: cannot make the dataset \({why}.*\); expected module:"):
        open_named(data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["callable", "class", "parquet"])
def test_train_reads_a_named_dataset_or_parquet_files(folder, tmp_path, kind, capsys):
    if kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        rows = [(open(p, "rb").read(), label) for p, label in torchvision.datasets.ImageFolder(str(folder)).samples]
        table = pa.table({"image": [r[0] for r in rows], "label": [r[1] for r in rows]})
        pq.write_table(table, tmp_path / "train.parquet")
    data = {
        "callable": "tests.test_named:sixteen",
        "class": f"torchvision.datasets.ImageFolder:{folder}",
        "parquet": str(tmp_path / "train.parquet"),
    }[kind]
    out = tmp_path / "run"
    assert main(["train", *train_args(data, out, epochs=1)]) == 0
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs if "train_loss" in e] == [0]  # the run trained a whole epoch on it


def test_a_resumed_run_compares_a_named_dataset_as_written_from_any_folder(folder, tmp_path, monkeypatch):
    from dataclasses import asdict

    from gpupipe.train.config import TrainConfig
    from gpupipe.train.resume import check_resumable

    cfg = TrainConfig(data=f"torchvision.datasets.ImageFolder:{folder}", out=str(tmp_path / "run"))
    saved = {**asdict(cfg), "data_resolved": resolved(cfg.data)}  # as the checkpoint records it
    monkeypatch.chdir(tmp_path)  # a requeued job starts in another folder
    assert check_resumable(saved, cfg, tmp_path / "last.pt") == []
    other = TrainConfig(data=f"torchvision.datasets.ImageFolder:{tmp_path}", out=cfg.out)
    with pytest.raises(ValueError, match="data"):
        check_resumable(saved, other, tmp_path / "last.pt")


def test_check_and_prepare_take_a_named_dataset(tmp_path, capsys):
    assert main(["check", "tests.test_named:sixteen"]) == 0
    assert "16 files: 0 unreadable" in capsys.readouterr().out
    assert main(["prepare", "tests.test_named:sixteen", str(tmp_path / "shards")]) == 0
    shards = open_source(tmp_path / "shards")
    assert shards.targets == [label for _, label in sixteen()]
