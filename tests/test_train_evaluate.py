"""gpupipe/train/evaluate.py: ``gpupipe eval`` takes a checkpoint's config as data: nothing it names (a source, a
model location, a permission) is fetched, read or trusted."""

import http.server
import json
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


def _eval(capsys, *args) -> tuple[int, str, list[str]]:
    """``gpupipe eval`` in this process: exit status, stdout, stderr's lines."""
    from gpupipe.cli import main

    code = main(["eval", *map(str, args), "--device", "cpu", "--workers", "0"])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


def test_ema_without_ema_weights_is_one_line_and_with_them_the_output_says_so(tmp_path, capsys, monkeypatch):
    """The probe: ``--ema`` on a run without --model-ema ended in ``KeyError: 'model_ema'``."""
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    ckpt, data = tmp_path / "last.pt", make_folder(tmp_path / "val", 2, 1)
    _checkpoint(ckpt, {}, ["c00", "c01"])
    code, _, lines = _eval(capsys, "--checkpoint", ckpt, "--data", data, "--ema")
    assert code == 2 and lines == [
        f"error: {ckpt}: --ema, but the run kept no EMA weights (it ran without --model-ema): leave out --ema to "
        "evaluate its weights"
    ]
    state = checkpoint.load(ckpt)
    checkpoint.save_atomic({**state, "model_ema": state["model"]}, ckpt, keep=1)
    code, out, _ = _eval(capsys, "--checkpoint", ckpt, "--data", data, "--ema")
    assert code == 0 and "test_resnet EMA weights at 32 px" in out
    code, out, _ = _eval(capsys, "--checkpoint", ckpt, "--data", data, "--ema", "--json")
    assert code == 0 and json.loads(out)["weights"] == "ema"
    code, out, _ = _eval(capsys, "--checkpoint", ckpt, "--data", data)
    assert code == 0 and "test_resnet at 32 px" in out


def test_a_missing_checkpoint_is_named_as_missing_not_as_a_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    missing = tmp_path / "runs" / "nope" / "last.pt"
    code, _, lines = _eval(capsys, "--checkpoint", missing, "--data", tmp_path)
    assert code == 2 and lines == [
        f"error: {missing}: no such checkpoint file (`gpupipe train --out OUT` writes OUT/checkpoints/last.pt)"
    ]


def test_a_damaged_checkpoint_is_refused_in_eval_s_words_naming_the_good_one_beside_it(tmp_path, capsys, monkeypatch):
    """The probe: eval on a damaged checkpoint said "cannot resume from it ... delete it to start the run again"."""
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    data = make_folder(tmp_path / "data", 2, 1)
    ckpt = tmp_path / "checkpoints" / "last.pt"
    for step in (1, 2):  # last.pt is step-00000002.pt (a hard link): damaging one damages both
        _checkpoint(ckpt, {}, ["c00", "c01"])
        checkpoint.save_atomic({**checkpoint.load(ckpt), "step": step}, ckpt, keep=2)
    with open(ckpt, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 64)
    code, _, lines = _eval(capsys, "--checkpoint", ckpt, "--data", data)
    good = tmp_path / "checkpoints" / "step-00000001.pt"
    assert code == 2 and lines == [
        f"error: {ckpt}: cannot evaluate it (damaged: its contents do not match their sha256 digest); the newest good "
        f"checkpoint beside it is {good}: evaluate it with --checkpoint {good}"
    ]
    good.unlink()
    code, _, lines = _eval(capsys, "--checkpoint", ckpt, "--data", data)
    assert code == 2 and len(lines) == 1 and "resume" not in lines[0] and "start the run" not in lines[0]
    assert lines[0].endswith("no good checkpoint is kept beside it: evaluate another one, or restore a good copy")


def test_a_run_folder_evaluates_its_last_checkpoint_and_synthetic_data_is_refused(tmp_path, capsys, monkeypatch):
    """The probe: ``--checkpoint runs/train`` said "no such checkpoint file" of a folder that holds one, and
    ``--backend synthetic`` printed an accuracy on random images as --data's."""
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    data, run = make_folder(tmp_path / "val", 2, 1), tmp_path / "run"
    _checkpoint(run / "checkpoints" / "last.pt", {}, ["c00", "c01"])
    code, out, _ = _eval(capsys, "--checkpoint", run, "--data", data, "--json")
    assert code == 0 and json.loads(out)["checkpoint"] == str(run / "checkpoints" / "last.pt")
    code, _, lines = _eval(capsys, "--checkpoint", tmp_path / "val", "--data", data)
    assert code == 2 and lines == [
        f"error: {tmp_path / 'val'}: a folder, with no checkpoints/last.pt in it: pass a checkpoint file, or the --out "
        "folder of a `gpupipe train` run"
    ]
    code, _, lines = _eval(capsys, "--checkpoint", run, "--data", data, "--backend", "synthetic")
    assert code == 2 and lines[0].startswith("error: --backend synthetic makes random images and labels"), lines


def test_files_left_out_under_skip_are_not_counted_and_are_named(tmp_path, capsys, monkeypatch):
    """The probe: with 3 unreadable files among 19, ``--on-error skip`` printed "(19 images ...)" and JSON
    ``"images": 19`` for metrics over the 16 read, and said nothing of the others; without the flag, the error's fix
    named ``on_error="skip"`` (build_loader's spelling) instead of the flag."""
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    ckpt, data = tmp_path / "last.pt", make_folder(tmp_path / "val", 2, 3)
    _checkpoint(ckpt, {}, ["c00", "c01"])
    bad = data / "c01" / "zz-empty.jpg"
    bad.write_bytes(b"")
    code, out, _ = _eval(capsys, "--checkpoint", ckpt, "--data", data, "--on-error", "skip", "--json")
    got = json.loads(out)
    assert code == 0 and got["images"] == 6 and [s["path"] for s in got["skipped"]] == [str(bad)]
    code, out, lines = _eval(capsys, "--checkpoint", ckpt, "--data", data, "--on-error", "skip")
    assert code == 0 and "(6 images, test_resnet" in out
    assert lines == [f"1 unreadable file(s) left out (--on-error skip), e.g. {bad}: {got['skipped'][0]['reason']}"]
    code, _, lines = _eval(capsys, "--checkpoint", ckpt, "--data", data)
    assert code == 2 and len(lines) == 1 and str(bad) in lines[0]
    assert "--on-error skip leaves such files out" in lines[0] and "on_error=" not in lines[0]
