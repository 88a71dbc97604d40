"""The training core on the CPU: accumulation, precision, resume after a kill, DDP through torchrun."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpupipe.train import checkpoint
from gpupipe.train.config import TrainConfig
from gpupipe.train.loop import train

from .common_utils import killed_at_first_checkpoint, make_folder, train_args, train_cli, train_config
from .probe import Tiny


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("train"), 4, 8)


def _cfg(data, out, **kw) -> TrainConfig:
    return train_config(data, out, **kw)


def _weights(out):
    return checkpoint.load(f"{out}/checkpoints/last.pt")["model"]


def test_accumulation_equals_one_big_batch(data, tmp_path):
    torch.manual_seed(0)
    init = Tiny().double().state_dict()

    def run(batch, accum, out):
        model = Tiny().double()
        model.load_state_dict(init)
        # the loader delivers float32; the model computes in float64
        cfg = _cfg(data, out, batch_size=batch, accum=accum, epochs=1, optimizer="sgd", momentum=0.0, clip=None)
        model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
        train(cfg, model=model)
        return _weights(out)

    big, micro = run(16, 1, tmp_path / "big"), run(4, 4, tmp_path / "micro")
    for k in big:
        torch.testing.assert_close(big[k], micro[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_bf16_and_fp16_with_clipping_run(data, tmp_path):
    for p in ("bf16", "fp16"):
        metrics = train(_cfg(data, tmp_path / p, precision=p, clip=1.0, epochs=1))
        assert metrics["train_loss"] == metrics["train_loss"]  # not NaN


@pytest.mark.slow
def test_outputs_and_refusing_to_overwrite(data, tmp_path):
    out = tmp_path / "run"
    metrics = train(_cfg(data, out, val=str(data), epochs=1))
    assert {"epoch", "train_loss", "images_per_s", "data_wait", "val_loss", "val_acc"} <= metrics.keys()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1
    assert list((out / "tb").iterdir())
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert {"model", "optimizer", "scaler", "scheduler", "epoch", "step", "rng", "loader"} <= state.keys()
    with pytest.raises(FileExistsError, match="--resume"):
        train(_cfg(data, out, epochs=1))


@pytest.mark.parametrize("save_every", [0, 3])
@pytest.mark.slow
def test_killed_run_resumes_to_the_straight_runs_weights(data, tmp_path, save_every):
    subprocess.run(train_cli(data, tmp_path / "straight", save_every=save_every), check=True)
    out = tmp_path / "killed"
    ckpt = killed_at_first_checkpoint(train_cli(data, out, save_every=save_every), out)
    subprocess.run(train_cli(data, out, resume=True, save_every=save_every), check=True)
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert checkpoint.load(ckpt)["loader"]["epoch"] == 2  # the run's own epoch count, not more


def _run(*args):
    """``python -m gpupipe train ...`` as a user runs it, stderr to a pipe (not a terminal)."""
    return subprocess.run([*args], capture_output=True, text=True, timeout=600)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.slow
def test_resume_says_what_it_did_and_refuses_what_it_cannot(data, tmp_path):
    out = tmp_path / "run"
    err = _one_error_line(_run(*train_cli(data, out, resume=True, epochs=1)).stderr)
    assert "--resume: no checkpoint at" in err and str(out) in err
    r = _run(*train_cli(data, out, resume_or_start=True, epochs=1))
    assert r.returncode == 0 and "resumed" not in r.stderr
    r = _run(*train_cli(data, out, resume=True, epochs=1))
    assert r.returncode == 0 and "already finished its 1 epoch; nothing to do" in r.stderr.splitlines()[0]
    for flags, said in (
        (("--batch-size", "8"), "batch_size 4 -> 8"),
        (("--model", "resnet10t"), "model"),
        (("--epochs", "2", "--allow-config-change", "--image-size", "40"), "image_size 32 -> 40"),
        (("--epochs", "2", "--lr", "0.1"), "epochs 1 -> 2; lr 0.05 -> 0.1"),
    ):
        err = _one_error_line(_run(*train_cli(data, out, "--resume", *flags)).stderr)
        assert said in err and "last.pt" in err, err
        assert f"`gpupipe train --config {out / 'config.yaml'} --resume`" in err  # where the run's own settings are
    assert "--allow-config-change" in err
    first_config = (out / "config.yaml").read_text()
    r = _run(*train_cli(data, out, resume=True, epochs=2, allow_config_change=True))
    assert r.returncode == 0, r.stderr
    assert "resumed from epoch 1, batch 0 (optimizer step 8)" in r.stderr and "epochs 1 -> 2" in r.stderr
    assert "the learning rate now follows the schedule of the new settings" in r.stderr
    kept = list(out.glob("config.before-step-*.yaml"))
    assert len(kept) == 1 and kept[0].read_text() == first_config and "epochs: 2" in (out / "config.yaml").read_text()
    # the run-mode flags are the command's, not the run's: the file given back as --config starts no resume ...
    assert not {"resume", "resume_or_start", "allow_config_change", "resume_from"} & {
        line.split(":")[0] for line in (out / "config.yaml").read_text().splitlines()
    }
    # ... and with --resume typed, the command the refusals name resumes with the run's settings
    r = _run(sys.executable, "-m", "gpupipe", "train", "--config", str(out / "config.yaml"), "--resume")
    assert r.returncode == 0 and "already finished its 2 epochs; nothing to do" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_the_corrected_retry(data, tmp_path):
    """The first unreadable file stops the run with how to go on; the retry with --on-error skip starts in the same
    folder (nothing was saved to lose), keeping the failed run's config beside its own."""
    bad = make_folder(tmp_path / "data", 2, 4)
    (bad / "c00" / "000_broken.jpg").write_bytes(b"not a jpeg")  # 9 samples in batches of 3: every one is read
    out = tmp_path / "run"
    err = _run(*train_cli(bad, out, epochs=1, batch_size=3)).stderr.splitlines()[-1]  # after the start-up line
    assert "000_broken.jpg" in err and "--on-error skip" in err and f"gpupipe check {bad}" in err
    assert 'on_error="skip"' not in err  # the API's fix, not the command's
    assert not (out / "checkpoints" / "last.pt").exists()
    retry = _run(*train_cli(bad, out, epochs=1, batch_size=3, on_error="skip"))
    assert retry.returncode == 0, retry.stderr
    assert "saved no checkpoint (on_error raise -> skip)" in retry.stderr
    assert "on_error: raise" in (out / "config.unfinished.yaml").read_text()
    assert "on_error: skip" in (out / "config.yaml").read_text()


@pytest.mark.parametrize("content", [b"", b"garbage", "truncated"])
@pytest.mark.slow
def test_a_broken_checkpoint_is_one_line_naming_it(data, tmp_path, content):
    out = tmp_path / "run"
    ckpt = out / "checkpoints" / "last.pt"
    if content == "truncated":
        subprocess.run(train_cli(data, out, epochs=1), check=True, capture_output=True)
        content = ckpt.read_bytes()[:1000]
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(content)
    err = _one_error_line(_run(*train_cli(data, out, resume=True)).stderr)
    assert f"{ckpt}: cannot resume from it" in err and "delete it" in err


@pytest.mark.slow
def test_validation_uses_the_training_classes_and_logs_stay_whole(data, tmp_path):
    import shutil

    val = tmp_path / "val"
    shutil.copytree(data / "c01", val / "c01")
    shutil.copytree(data / "c03", val / "c03")
    r = _run(*train_cli(data, tmp_path / "run", val=val, epochs=1))
    assert r.returncode == 0, r.stderr
    assert "no samples of 2 training class(es): c00, c02" in r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("epoch 0  train_loss")]
    assert len(summary) == 1 and "val_loss" in summary[0] and "val_acc" in summary[0]  # one line, not wrapped at 80
    shutil.copytree(data / "c00", val / "zebra")
    err = _one_error_line(_run(*train_cli(data, tmp_path / "run2", val=val, epochs=1)).stderr)
    assert "classes not in the training set: zebra" in err


@pytest.mark.slow
def test_skipped_files_are_named(data, tmp_path):
    import shutil

    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    (bad / "c02" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    out = tmp_path / "run"
    r = _run(*train_cli(bad, out, on_error="skip", epochs=1, val=bad))  # validation on the same files: both say it
    assert r.returncode == 0, r.stderr
    broken = bad / "c02" / "broken.jpg"
    assert "2 unreadable file(s) skipped this epoch (1 in training, 1 in validation; listed in " in r.stderr
    assert f"training: skipped {broken}: " in r.stderr and f"validation: skipped {broken}: " in r.stderr
    rows = (out / "skipped.txt").read_text().splitlines()
    assert [(row.split("\t")[:2], row.split("\t")[-1]) for row in rows] == [
        (["0", str(broken)], "train"),
        (["0", str(broken)], "val"),
    ]


def _torchrun(*args, timeout=300):
    probe = os.path.join(os.path.dirname(__file__), "probe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", probe, *args]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


@pytest.mark.slow
def test_ddp_no_sync_accumulation_equals_one_big_batch(data, tmp_path):
    """2 ranks x 2 micro-batches of 4 under gloo DDP == one process with batches of 16 (float64, 1e-6); gradients
    are all-reduced once per optimizer step (no_sync on the other micro-batches), not once per micro-batch."""
    torch.manual_seed(0)
    init = Tiny().double().state_dict()
    torch.save(init, tmp_path / "init.pt")
    model = Tiny().double()
    model.load_state_dict(init)
    model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
    cfg = _cfg(data, tmp_path / "big", batch_size=16, epochs=1, optimizer="sgd", momentum=0.0, clip=None, model="tiny")
    train(cfg, model=model)
    out = tmp_path / "ddp"
    out.mkdir()
    _torchrun("tiny64", str(out), str(tmp_path / "init.pt"), str(data), "4", "2")
    big, ddp = _weights(tmp_path / "big"), _weights(out)
    for k in big:
        torch.testing.assert_close(big[k], ddp[k], rtol=0, atol=1e-6)
    ranks = [torch.load(out / f"probe-rank{r}.pt", weights_only=True) for r in (0, 1)]
    steps = 32 // 16
    assert [r["allreduces"] for r in ranks] == [steps, steps]  # one bucket, once per step
    for k in big:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k


@pytest.mark.slow
def test_torchrun_two_ranks(data, tmp_path):
    """``torchrun ... -m gpupipe train --device cpu``: disjoint shards, identical parameters, rank 0 alone logs."""
    out = tmp_path / "ddp"
    _torchrun("cli", "--", "train", *train_args(data, out, lr=None, accum=2))
    assert (out / "checkpoints" / "last.pt").exists()
    assert (out / "metrics.jsonl").read_text().count("\n") == 2  # one row per epoch: rank 0 alone wrote it
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
        "probe-rank0.pt",
        "probe-rank1.pt",
        "tb",
    ]
    ranks = [torch.load(out / f"probe-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for epoch in (0, 1):
        shards = [{i for e, i in r["seen"] if e == epoch} for r in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(32))  # 32 samples, no padding needed
    saved = _weights(out)
    for k, v in ranks[0]["params"].items():
        assert torch.equal(v, ranks[1]["params"][k]), k
        assert torch.equal(v, saved[k]), k


def _probe(*args):
    return [sys.executable, os.path.join(os.path.dirname(__file__), "probe.py"), *args]


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(data, tmp_path):
    """SIGKILL in the middle of the 3rd checkpoint write: the 2nd stays loadable, and resuming from it ends with the
    straight run's weights."""
    subprocess.run(train_cli(data, tmp_path / "straight", save_every=3), check=True)
    out = tmp_path / "killed"
    proc = subprocess.run(_probe("kill-in-save", "3", "--", "train", *train_args(data, out, save_every=3)), timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert list((out / "checkpoints").glob(".last.pt.tmp-*"))  # the torn write is there, beside the good file
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert state["step"] == 6  # the saves at steps 3 and 6 made it; the 3rd (the epoch end, step 8) was torn
    subprocess.run(train_cli(data, out, resume=True, save_every=3), check=True)
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not list((out / "checkpoints").glob(".last.pt.tmp-*"))  # the next save cleared the torn one


def _two_ranks(probe_args: list[str], train: list[str]) -> list[subprocess.Popen]:
    """Two ranks of ``gpupipe train`` started by hand under ``tests/probe.py`` (no torchrun agent to kill the
    survivor), output piped."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        cmd = _probe(*probe_args, "--", "train", *train)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_other_in_bounded_time(data, tmp_path):
    """Rank 1 exits after 2 batches; rank 0, blocked in an all-reduce, must fail with an error well within its
    --dist-timeout-s, not wait forever."""
    procs = _two_ranks(["rank-exits", "1", "2"], train_args(data, tmp_path / "run", dist_timeout_s=30))
    assert procs[1].wait(timeout=120) == 3
    t0 = time.monotonic()
    try:
        code = procs[0].wait(timeout=60)
    finally:
        procs[0].kill()
    assert code != 0
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_rank_that_loses_its_loader_worker_saves_a_checkpoint_alone(data, tmp_path):
    """Under DDP, the rank whose DataLoader worker is killed writes the checkpoint itself (the others wait for it
    in an all-reduce and cannot), says so in one line, and the run resumes from it."""
    out = tmp_path / "run"
    procs = _two_ranks(["worker-dies", "1", "2"], train_args(data, out, workers=1, dist_timeout_s=30))
    try:
        text, _ = procs[1].communicate(timeout=120)
        procs[0].wait(timeout=90)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 2, text
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert last.startswith("error: rank 1: DataLoader worker (pid(s) "), text
    assert "; checkpoint saved at epoch 0, batch " in last and last.endswith("--resume"), last
    saved = checkpoint.load(out / "checkpoints" / "last.pt")
    assert saved["loader"]["epoch"] == 0 and saved["loader"]["batch"] == saved["step"]  # accum 1: a step a batch
    r = subprocess.run(train_cli(data, out, resume=True), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr  # one process resumes what two ranks saved
    final = checkpoint.load(out / "checkpoints" / "last.pt")
    assert final["epoch"] == 2 and final["step"] > saved["step"]  # QUICK_TRAIN's 2 epochs, ended


def test_config_and_model_mistakes_are_one_line_errors(data, tmp_path, capsys):
    from gpupipe.cli import main

    f = tmp_path / "run.yaml"
    for text, said in (
        ("lr: 0.1\nepocs: 3\n", "run.yaml:2: unknown key 'epocs'; did you mean 'epochs'?"),
        ("epochs: [3\n", "run.yaml:2: not valid YAML"),
        ("lr: 0.1\nepochs: ten\n", "run.yaml:2: epochs: Value 'ten'"),
        ("precision: fp8\n", "precision must be one of fp32, bf16, fp16"),
    ):
        f.write_text(text)
        assert main(["train", "--config", str(f), "--print-config"]) == 2
        assert said in _one_error_line(capsys.readouterr().err)
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "m"), "--model", "resnt18"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "unknown --model 'resnt18'" in err and "resnet18" in err


class _Sides(Tiny):
    """Tiny, noting the side of each batch it sees, in training and in evaluation."""

    def __init__(self):
        super().__init__()
        self.sides: dict[bool, list[int]] = {True: [], False: []}

    def forward(self, x):
        self.sides[self.training].append(x.shape[-1])
        return super().forward(x)


def test_a_resolution_schedule_trains_each_epoch_at_its_size_and_resumes_mid_epoch(data, tmp_path):
    """--res-start/--res-end: epoch 0 at 16 px, epoch 1 at 32, validation at --eval-size, the size in metrics.jsonl;
    resumed from a checkpoint in the middle of epoch 1, the run ends with the straight run's weights."""
    kw = dict(res_start=16, res_end=32, res_end_epoch=1, res_step=8, eval_size=40, val=str(data), save_every=3)
    straight = _Sides()
    train(_cfg(data, tmp_path / "a", keep_checkpoints=3, **kw), model=straight)
    assert straight.sides[True] == [16] * 4 + [32] * 4 and set(straight.sides[False]) == {40}
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["image_size"] for line in lines] == [16, 32]
    mid = tmp_path / "a" / "checkpoints" / "step-00000006.pt"  # epoch 1, batch 2
    resumed = _Sides()
    train(_cfg(data, tmp_path / "b", resume_from=str(mid), **kw), model=resumed)
    assert resumed.sides[True] == [32] * 2
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("fp16", marks=pytest.mark.slow)]
)
@pytest.mark.slow
def test_a_ddp_training_step_makes_the_host_wait_for_nothing(data, tmp_path, precision):
    """Two gloo ranks, the sync counter of tests/test_sync.py on every micro-batch (the CPU is the device): no host
    sync and no collective beyond DDP's gradient all-reduce, in every precision (fp16's fused optimizer takes the
    scaler's inf check on the device: it was one sync an optimizer step). Progress lines, checkpoints, the stop check
    (every STOP_EVERY steps) and the epoch's end are not per step."""
    out = tmp_path / "run"
    _torchrun("count", "--", "train", *train_args(data, out, precision=precision, log_every=1000, accum=2))
    per_epoch = 32 // 2 // 4  # micro-batches per rank; an optimizer step on every 2nd
    for rank in (0, 1):
        steps = torch.load(out / f"count-rank{rank}.pt", weights_only=True)["steps"]
        assert len(steps) == 2 * per_epoch
        inside = {i: s for i, s in enumerate(steps) if (i + 1) % per_epoch}  # the epoch's end falls to its last
        print(f"rank {rank} {precision}, (syncs, collectives) per micro-batch:", [tuple(map(len, s)) for s in steps])
        assert all(collectives == [] for _, collectives in inside.values()), inside
        assert all(syncs == [] for syncs, _ in inside.values()), inside


def test_the_loaders_start_up_is_reported_apart_and_a_cold_later_epoch_still_counts(data, tmp_path, monkeypatch):
    """The first batch in the process (the loader's workers, pipeline, first decode) is ``startup_s`` of that epoch,
    not data-wait: a short first epoch on a GPU read 27 % data-wait and the "loader is the bottleneck" hint from its
    start-up alone. The first batch of a later epoch is a wait like any other."""
    from gpupipe.train import loop

    calls, real = [], loop.next_or_save
    pause = 2.0

    def slow_at(run, batches, epoch, boundary, meter):  # epoch 0's first batch: start-up; epoch 2's: a cold epoch
        first = not calls or calls[-1] != epoch
        calls.append(epoch)
        if first and epoch in (0, 2):
            time.sleep(pause)
        return real(run, batches, epoch, boundary, meter)

    seconds, metrics = {}, loop.epoch_metrics

    def counted(epoch, meter, dist):  # seconds: a share of the epoch's time depends on the machine's load
        seconds[epoch] = (meter.wait, meter.startup)
        return metrics(epoch, meter, dist)

    monkeypatch.setattr(loop, "next_or_save", slow_at)
    monkeypatch.setattr(loop, "epoch_metrics", counted)
    out = tmp_path / "run"
    train(_cfg(data, out, epochs=3, workers=0))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["startup_s"] >= pause and seconds[0][1] >= pause
    assert seconds[0][0] < pause  # the pause is start-up, not a wait (the other 3 batches' reads are waits)
    assert "startup_s" not in lines[1] and "startup_s" not in lines[2] and seconds[2][1] == 0
    assert seconds[2][0] >= pause  # the cold later epoch's first batch is a wait like any other
