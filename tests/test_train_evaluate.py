"""gpupipe/train/evaluate.py: ``gpupipe eval`` takes a checkpoint's config as data: nothing it names (a source, a
model location, a permission) is fetched, read or trusted."""

import http.server
import threading
from typing import ClassVar

import pytest
import timm

from gpupipe.train import checkpoint

from .common_utils import gpupipe_cli, make_folder

pytestmark = pytest.mark.slow  # gpupipe eval in a process: seconds each


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def do_GET(self):
        self.requests.append(self.path)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    _Recorder.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Recorder.requests
    httpd.shutdown()


def _checkpoint(path, config: dict, classes: list[str] | None) -> None:
    """A checkpoint of plain values, as anyone can write one: the weights of a real model, ``config`` as given."""
    model = timm.create_model("test_resnet", num_classes=2)
    state = {
        "model": model.state_dict(),
        **{k: {} for k in ("optimizer", "scaler", "scheduler", "rng", "running")},
        "step": 1,
        "epoch": 1,
        "loader": {"epoch": 1, "batch": 0},
        "config": {"model": "test_resnet", "image_size": 32, "precision": "fp32", **config},
        **({"classes": classes} if classes is not None else {}),
    }
    checkpoint.save_atomic(state, path, keep=1)


@pytest.mark.parametrize(
    "config, classes, refusal",
    [
        ({"data_resolved": "{url}/data", "data": "{url}/data", "allow_outside_root": True}, None, "no class list"),
        ({"model": "hf-hub:someone/model"}, ["a", "b"], "names the model 'hf-hub:"),
        ({"model": "local-dir:/etc"}, ["a", "b"], "not a timm architecture name"),
    ],
)
def test_eval_fetches_nothing_a_checkpoint_names(tmp_path, server, config, classes, refusal):
    url, requests = server
    config = {k: v.format(url=url) if isinstance(v, str) else v for k, v in config.items()}
    ckpt = tmp_path / "last.pt"
    _checkpoint(ckpt, config, classes)
    data = make_folder(tmp_path / "val", 2, 1)
    env = {"HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0"}  # where the hub would be asked, were it asked
    r = gpupipe_cli("eval", "--checkpoint", ckpt, "--data", data, "--device", "cpu", "--workers", "0", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {ckpt}: "), r.stderr
    assert refusal in lines[0]
    assert requests == []


def test_an_older_checkpoint_takes_its_classes_from_the_data_the_user_names(tmp_path):
    ckpt = tmp_path / "last.pt"
    _checkpoint(ckpt, {"data": "/nowhere"}, None)
    data = make_folder(tmp_path / "val", 2, 1)
    r = gpupipe_cli("eval", "--checkpoint", ckpt, "--data", data, "--classes-from", data, "--workers", "0")
    assert r.returncode == 0, r.stderr
    assert "(2 images, test_resnet at 32 px, after epoch 0 of " in r.stdout
