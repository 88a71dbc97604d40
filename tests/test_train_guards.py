"""``gpupipe train`` as a new user meets it: the start-up line, a loss that becomes NaN, weights from a local file,
a resume from another folder, a CSV list outside its folder, and the same result from the same command."""

import os
import subprocess

import pytest
import torch

from gpupipe.train import checkpoint

from .common_utils import REPO_ROOT, make_folder, train_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("guards"), 4, 8)


def _run(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([*args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(data, tmp_path):
    out = tmp_path / "run"
    r = _run(*train_cli(data, out, epochs=2, lr=1e9, warmup_epochs=0, save_every=1, log_every=1))
    lines = r.stderr.splitlines()
    assert lines[0].startswith("training test_resnet") and "Traceback" not in r.stderr
    err = lines[-1]  # the start-up line, progress, then one error line
    assert r.returncode == 2 and err.startswith("error: the loss is not finite (NaN or inf) at optimizer step "), err
    step = int(err.split("optimizer step ")[1].split()[0])
    assert f"the last good checkpoint is {out}/checkpoints/last.pt" in err
    saved = checkpoint.load(out / "checkpoints" / "last.pt")
    assert saved["step"] < step  # nothing was saved from the step whose loss was not finite, or after it
    assert not (out / "metrics.jsonl").exists() or "NaN" not in (out / "metrics.jsonl").read_text()


def test_start_up_line_then_pretrained_weights_from_a_local_file(data, tmp_path):
    import timm

    weights = tmp_path / "weights.pth"
    source = timm.create_model("test_resnet", num_classes=1000)  # another head: made anew for the 4 classes
    torch.save(source.state_dict(), weights)
    out = tmp_path / "run"
    r = _run(*train_cli(data, out, epochs=1, lr=0.0, pretrained=weights))
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"training test_resnet (weights from {weights}) on 32 samples, 4 classes: backend pillow")
    assert "device cpu (" in first and "torch threads), 8 batches per epoch x 1 epoch, batch 4 x accum 1" in first
    ckpt = out / "checkpoints" / "last.pt"  # where it writes, at the start and at the end: what `gpupipe eval` takes
    assert first.endswith(f"; run folder {out} (checkpoint {ckpt})"), first
    assert r.stderr.splitlines()[-1] == (
        f"finished 1 epoch: run folder {out}; evaluate its checkpoint with: gpupipe eval --checkpoint {ckpt} "
        "--data HELD_OUT_DATA"
    )
    trained = checkpoint.load(out / "checkpoints" / "last.pt")["model"]
    body = [
        k for k, v in source.state_dict().items() if v.is_floating_point() and "fc." not in k and "running" not in k
    ]
    assert body and all(torch.equal(trained[k], source.state_dict()[k]) for k in body)  # lr 0: the file's weights
    err = _one_error_line(_run(*train_cli(data, tmp_path / "r2", pretrained=tmp_path / "nope.pth")).stderr)
    assert "--pretrained" in err and "nope.pth: no such file" in err


def test_the_start_up_line_counts_as_the_progress_line_and_says_a_run_resumes(data, tmp_path):
    """The probe: with --accum the start-up line counted optimizer steps and the progress line micro-batches; a
    resumed run said `(random init)`; a finished one printed the whole start-up line before `nothing to do`."""
    out = tmp_path / "run"
    r = _run(*train_cli(data, out, epochs=1, accum=2, log_every=1))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "8 batches per epoch (4 optimizer steps) x 1 epoch, batch 4 x accum 2, images 32 px;" in lines[0]
    assert any(line.startswith("epoch 0  8/8 ") for line in lines)  # the progress line's count: 8, as above
    more = train_cli(data, out, "--resume", "--allow-config-change", epochs=2, accum=2, res_start=16)
    r = _run(*more)
    assert r.returncode == 0, r.stderr
    first = next(line for line in r.stderr.splitlines() if line.startswith("training "))  # after "settings changed"
    assert first.startswith(f"training test_resnet (resumed from {out}/checkpoints/last.pt) on 32 samples"), first
    assert "x 2 epochs" in first and "images 16 px (epoch 0), 32 px (epoch 1);" in first
    r = _run(*more)
    assert r.returncode == 0 and r.stderr.splitlines()[0].startswith(
        f"{out}/checkpoints/last.pt: the run already finished its 2 epochs; nothing to do"
    ), r.stderr


def test_resume_from_another_folder_with_the_data_as_an_absolute_path(data, tmp_path):
    start, requeued = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), requeued.mkdir()
    os.symlink(data, start / "data")
    assert _run(*train_cli("data", "run", epochs=1), cwd=start).returncode == 0
    r = _run(
        *train_cli(os.path.realpath(data), start / "run", epochs=2, resume=True, allow_config_change=True), cwd=requeued
    )
    assert r.returncode == 0, r.stderr  # was: cannot resume with data 'data' -> '/abs/.../data'
    assert "resumed from epoch 1, batch 0" in r.stderr
    other = make_folder(tmp_path / "other", 4, 8)
    err = _one_error_line(_run(*train_cli(other, start / "run", epochs=2, resume=True), cwd=requeued).stderr)
    assert f"data '{os.path.realpath(data)}' -> '{os.path.realpath(other)}'" in err  # what differs, resolved


def test_a_csv_list_leaving_its_folder_trains_with_allow_outside_root(data, tmp_path):
    lst = tmp_path / "lists" / "train.csv"
    lst.parent.mkdir()
    lst.write_text("".join(f"{os.path.relpath(p, lst.parent)},{p.parent.name}\n" for p in sorted(data.rglob("*.jpg"))))
    err = _one_error_line(_run(*train_cli(lst, tmp_path / "a", epochs=1)).stderr)
    assert "allow_outside_root=True" in err and "--allow-outside-root" in err
    r = _run(*train_cli(lst, tmp_path / "b", epochs=1, allow_outside_root=True))
    assert r.returncode == 0, r.stderr


def test_the_same_command_gives_the_same_weights_whatever_the_worker_count(data, tmp_path):
    """Deterministic on the CPU at a given torch thread count: data order, crops, init and maths are seeded."""
    for out, workers in (("a", 0), ("b", 2)):
        assert _run(*train_cli(data, tmp_path / out, epochs=1, workers=workers)).returncode == 0
    a, b = (checkpoint.load(tmp_path / out / "checkpoints" / "last.pt")["model"] for out in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = [(tmp_path / out / "metrics.jsonl").read_text().split('"images_per_s"')[0] for out in "ab"]
    assert metrics[0] == metrics[1]  # the same train_loss


def test_eval_gives_the_accuracy_training_reported(data, tmp_path):
    import json
    import sys

    val = make_folder(tmp_path / "val", 3, 3, seed=4)  # held out, one training class missing: labelled as trained
    out = tmp_path / "run"
    assert _run(*train_cli(data, out, epochs=1, val=val)).returncode == 0
    reported = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    ckpt = out / "checkpoints" / "last.pt"
    r = _run(sys.executable, "-m", "gpupipe", "eval", "--checkpoint", ckpt, "--data", val, "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["images"] == 9 and got["val_acc"] == reported["val_acc"]
    assert abs(got["val_loss"] - reported["val_loss"]) < 1e-4
    r = _run(sys.executable, "-m", "gpupipe", "eval", "--checkpoint", ckpt, "--data", val, "--device", "cpu")
    assert r.stdout.startswith(f"{val}: val_acc {reported['val_acc']:.4f}")
    assert f"after epoch {reported['epoch']} of" in r.stdout  # the training log's numbering (epoch 0 here)
    err = _one_error_line(_run(sys.executable, "-m", "gpupipe", "eval", "--checkpoint", val, "--data", val).stderr)
    assert str(val) in err


def test_a_validation_with_nothing_decodable_keeps_the_epoch_and_is_one_line(data, tmp_path):
    """A --val set whose every file is skipped (--on-error skip): the epoch trained before it is saved, and the empty
    validation is one line, in training and in ``gpupipe eval`` (it was a ZeroDivisionError and no checkpoint)."""
    import sys

    val = tmp_path / "val"
    (val / "c00").mkdir(parents=True)
    for i in range(3):
        (val / "c00" / f"{i}.jpg").write_bytes(b"not an image" * 10)
    out = tmp_path / "run"
    r = _run(*train_cli(data, out, epochs=2, val=val, on_error="skip"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = r.stderr.splitlines()[-1]
    assert err.startswith(f"error: {val}: no image to evaluate on: all 3 were skipped as undecodable, e.g. "), err
    saved = checkpoint.load(out / "checkpoints" / "last.pt")
    assert saved["loader"]["epoch"] == 1 and saved["step"] == 8  # the trained epoch is kept
    ckpt = out / "checkpoints" / "last.pt"
    cmd = [sys.executable, "-m", "gpupipe", "eval", "--checkpoint", ckpt, "--data", val, "--device", "cpu"]
    r = _run(*cmd, "--on-error", "skip")  # a warning first: the held-out set lacks 3 of the classes
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"error: {val}: no image to evaluate on: all 3 were skipped"), r.stderr


@pytest.mark.parametrize("saved", [True, False])
def test_a_nan_stop_offers_a_resume_only_when_a_checkpoint_was_saved(tmp_path, saved):
    """The probe: with no checkpoint yet the line said "no checkpoint was saved yet ... then --resume"."""
    from gpupipe.train.nonfinite import LossWatch, NonFiniteLossError

    last = tmp_path / "checkpoints" / "last.pt"
    if saved:
        last.parent.mkdir()
        last.write_bytes(b"")
    watch = LossWatch()
    watch.add(0, 1, torch.tensor(1.0))
    watch.add(1, 1, torch.tensor(float("nan")))
    with pytest.raises(NonFiniteLossError) as e:
        watch.check(0, last)
    message = str(e.value)
    assert message.startswith("the loss is not finite (NaN or inf) at optimizer step 1 (epoch 0, batch 1)")
    if saved:
        assert message.endswith(
            f"the last good checkpoint is {last}. Lower --lr, set --clip, or use fp32/bf16, then "
            "--resume (with --allow-config-change) or start again"
        )
    else:
        assert "--resume" not in message
        assert message.endswith(
            "no checkpoint was saved yet, so there is nothing to resume. Lower --lr, set --clip, "
            "or use fp32/bf16, and start the run again"
        )
