"""``gpupipe train`` stopped as schedulers, users and failures stop it, with real signals to real processes: SIGTERM
and Ctrl-C save at the step boundary and print the resume command; a second Ctrl-C stops at once; a SIGKILLed or
SIGSTOPped loader worker is one line and a checkpoint; a second run on the same --out is refused naming the first;
a damaged checkpoint is refused naming the previous good one, which --resume-from resumes."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from gpupipe.train import checkpoint

from .common_utils import REPO_ROOT, make_folder
from .test_pool import _children

pytestmark = pytest.mark.slow  # each test runs gpupipe train in processes: seconds each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("stop"), 4, 8)  # 32 images: 8 steps of 4 per epoch


def _cmd(data, out, *extra) -> list[str]:
    args = ["--data", data, "--out", out, "--model", "test_resnet", "--batch-size", "4", "--image-size", "32"]
    args += ["--device", "cpu", "--lr", "0.05", "--log-every", "1", "--workers", "0", *extra]
    return [sys.executable, "-m", "gpupipe", "train", *map(str, args)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _start(cmd, step_s: float | None = None) -> subprocess.Popen:
    """``cmd`` started, stderr piped; ``step_s``: each training step that much longer (tests/probe.py), so that a
    signal sent on a progress line comes seconds before the epoch's end, not the milliseconds of 8 quick steps."""
    env = _env()
    if step_s is not None:
        env["GPUPIPE_PROBE_STEP_S"] = str(step_s)
        if cmd[1:3] == ["-m", "gpupipe"]:
            cmd = [*_probe("plain"), *cmd[3:]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(proc: subprocess.Popen, prefix: str) -> list[str]:
    """stderr lines up to the first that starts with ``prefix`` (the run got that far)."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"the run ended before {prefix!r}: {''.join(seen)}")


def _finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _run(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)


def _weights(out) -> dict:
    return checkpoint.load(f"{out}/checkpoints/last.pt")["model"]


def test_sigterm_saves_at_the_step_boundary_and_the_resumed_run_ends_as_a_straight_one(data, tmp_path):
    assert _run(_cmd(data, tmp_path / "straight", "--epochs", "2")).returncode == 0
    out = tmp_path / "stopped"
    proc = _start(_cmd(data, out, "--epochs", "2"), step_s=0.3)
    _wait_for(proc, "epoch 0  2/8")
    proc.send_signal(signal.SIGTERM)
    code, lines = _finish(proc)
    assert code == 128 + signal.SIGTERM, lines
    assert "SIGTERM: stopping after this step to save a checkpoint" in lines
    last = lines[-1]
    assert last.startswith("stopped by SIGTERM; checkpoint saved at epoch 0, batch ")
    assert last.endswith(f"resume with: gpupipe train {' '.join(_cmd(data, out, '--epochs', '2')[4:])} --resume")
    saved = checkpoint.load(out / "checkpoints" / "last.pt")["loader"]
    assert saved["epoch"] == 0 and 2 <= saved["batch"] < 8
    r = _run(_cmd(data, out, "--epochs", "2", "--resume"))
    assert r.returncode == 0, r.stderr
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_under_torchrun_rank_0_alone_says_it_stopped_and_the_resume_command_is_torchruns(data, tmp_path):
    """The probe: each rank printed both lines, and the command to resume dropped torchrun. (torchrun itself, sent
    the SIGTERM, ends with its own traceback and status 1 whatever its workers do: the ranks exit 143.)"""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, *_cmd(data, tmp_path / "out", "--epochs", "50")[1:]]  # ... -m gpupipe train ...
    proc = _start(cmd)
    _wait_for(proc, "epoch 0  2/")
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
    _, lines = _finish(proc)
    # each once, from rank 0 alone, in this order; found within a line, as torchrun's own log lines share the pipe
    announced = [k for k, line in enumerate(lines) if "SIGTERM: stopping after this step to save a checkpoint" in line]
    stops = [k for k, line in enumerate(lines) if "stopped by SIGTERM; checkpoint saved at epoch " in line]
    assert len(announced) == 1 and len(stops) == 1 and announced[0] < stops[0], lines
    assert lines[stops[0]].endswith(f"resume with: {shlex.join(cmd)} --resume")


def test_gpupipe_torchrun_sent_sigterm_ends_as_its_ranks_do_in_one_line(data, tmp_path):
    """torchrun itself, sent the SIGTERM, ends with its own traceback and status 1 while its ranks save and exit 143;
    gpupipe-torchrun (torchrun, the same arguments) ends with 143 and one line of its own, no traceback, and the ranks'
    resume command is its command."""
    launcher = [sys.executable, "-m", "gpupipe.train.launch", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, *_cmd(data, tmp_path / "out", "--epochs", "50")[1:]]
    proc = _start(cmd)
    _wait_for(proc, "epoch 0  2/")
    proc.send_signal(signal.SIGTERM)
    code, lines = _finish(proc)
    assert code == 128 + signal.SIGTERM, lines
    assert not any("Traceback" in line or "SignalException" in line for line in lines), lines
    assert lines[-1] == "gpupipe-torchrun: stopped by SIGTERM, which torchrun passed on to its ranks", lines
    (stopped,) = [line for line in lines if line.startswith("stopped by SIGTERM")]
    assert stopped.endswith(f"resume with: {shlex.join(cmd)} --resume")
    assert (tmp_path / "out" / "checkpoints" / "last.pt").exists()


def test_ctrl_c_saves_and_a_second_one_stops_at_once(data, tmp_path):
    """The first SIGINT asks for a save at the next optimizer step; with --accum 16 that is up to 15 micro-batches
    away, and the second SIGINT comes before it: the run stops at once, saving nothing more."""
    proc = _start(_cmd(data, tmp_path / "once", "--epochs", "3"), step_s=0.3)
    _wait_for(proc, "epoch 0  2/8")
    proc.send_signal(signal.SIGINT)
    code, lines = _finish(proc)
    assert code == 130 and lines[-1].startswith("stopped by SIGINT (Ctrl-C); checkpoint saved at epoch 0"), lines
    assert not any("Traceback" in line for line in lines)

    out = tmp_path / "twice"
    proc = _start(_cmd(data, out, "--epochs", "3", "--accum", "16", "--batch-size", "2"), step_s=0.2)
    _wait_for(proc, "epoch 0  1/")
    proc.send_signal(signal.SIGINT)
    _wait_for(proc, "SIGINT (Ctrl-C): stopping after this step")
    proc.send_signal(signal.SIGINT)
    code, lines = _finish(proc)
    assert code == 130 and lines[-1].startswith("interrupted: stopped at once"), lines
    assert not (out / "checkpoints" / "last.pt").exists()


def test_a_ctrl_c_once_the_stop_is_saved_ends_the_run_without_a_traceback(data, tmp_path):
    """A second Ctrl-C right after the line that says the checkpoint is saved, while the process lets go of its loader
    (its workers) and runs its exit hooks: it ends at once, quietly. Python's handler raised it inside a finalizer or
    an exit hook ("Exception ignored in: <function Stream.__del__ ...> ... KeyboardInterrupt", or in logging's
    shutdown), or the run printed a second ending ("interrupted: stopped at once ..."), 2 runs of 2."""
    for k in range(2):
        proc = _start(_cmd(data, tmp_path / str(k), "--epochs", "3", "--workers", "2"))
        _wait_for(proc, "epoch 0  2/8")
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, "stopped by SIGINT (Ctrl-C); checkpoint saved")
        proc.send_signal(signal.SIGINT)
        code, lines = _finish(proc)
        assert code in (130, -signal.SIGINT) and lines == [], lines  # (-2: in the interpreter's last steps)


def test_a_killed_loader_worker_saves_and_is_one_line(data, tmp_path):
    out = tmp_path / "run"
    cmd = _cmd(data, out, "--epochs", "3", "--workers", "1")
    proc = _start(cmd)
    _wait_for(proc, "epoch 0  2/8")
    (worker,) = _children(proc.pid)
    os.kill(worker, signal.SIGKILL)
    code, lines = _finish(proc)
    assert code == 2 and len(lines[-1:]) == 1, lines
    assert lines[-1].startswith(f"error: DataLoader worker (pid(s) {worker}) exited unexpectedly"), lines
    assert "; checkpoint saved at epoch " in lines[-1] and lines[-1].endswith("--resume")
    assert not any("Traceback" in line for line in lines)
    assert checkpoint.load(out / "checkpoints" / "last.pt")["loader"]["epoch"] in (0, 1)
    r = _run([*cmd, "--resume"])
    assert r.returncode == 0, r.stderr


def test_a_stopped_loader_worker_is_an_error_naming_it_after_the_timeout(data, tmp_path):
    out = tmp_path / "run"
    proc = _start(_cmd(data, out, "--epochs", "3", "--workers", "1", "--loader-timeout-s", "2"))
    _wait_for(proc, "epoch 0  2/8")
    (worker,) = _children(proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        code, lines = _finish(proc)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # nothing left behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, sig)
    assert code == 2, lines
    assert lines[-1].startswith("error: no batch from the data loader for 2 s (--loader-timeout-s): ")
    assert f"worker pid {worker} is stopped" in lines[-1] and "; checkpoint saved at epoch " in lines[-1]


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(data, tmp_path):
    out = tmp_path / "run"
    first = _start(_cmd(data, out, "--epochs", "50"))
    _wait_for(first, "epoch 0  1/8")
    try:
        r = _run(_cmd(data, out, "--epochs", "50", "--resume-or-start"))
        (line,) = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2
        assert line.startswith(f"error: {out}: in use by another run (pid {first.pid} on ")
        assert "gpupipe train --data" in line and line.endswith("choose another --out")
    finally:
        first.kill()
        first.wait()
    r = _run(_cmd(data, out, "--epochs", "1", "--resume-or-start", "--allow-config-change"))
    assert r.returncode == 0, r.stderr  # the dead run's lock is in nobody's way


def test_a_sigkilled_run_resumes_at_once_while_its_workers_linger(data, tmp_path):
    """SIGKILL (an OOM kill, a preemption) leaves the DataLoader workers alive a few seconds, holding every descriptor
    the run had open: the folder is free all the same, and ``--resume`` goes on at once."""
    out = tmp_path / "run"
    cmd = _cmd(data, out, "--epochs", "1", "--workers", "1", "--save-every", "1")
    proc = _start(cmd, step_s=0.3)
    _wait_for(proc, "epoch 0  3/8")
    workers = _children(proc.pid)
    assert workers
    for w in workers:  # stopped: orphans that linger for as long as the test needs, not for up to 5 s
        os.kill(w, signal.SIGSTOP)
    try:
        proc.kill()
        proc.wait()
        r = _run([*cmd, "--resume"])
        assert r.returncode == 0, r.stderr
        assert all(os.path.exists(f"/proc/{w}") for w in workers)  # the orphans were there throughout
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def test_a_damaged_checkpoint_is_refused_and_the_previous_good_one_resumes(data, tmp_path):
    """The probe: 64 bytes flipped in the middle of last.pt resumed with exit 0 and changed weights."""
    out = tmp_path / "run"
    assert _run(_cmd(data, out, "--epochs", "1", "--save-every", "3")).returncode == 0
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in checkpoint.kept(ckpts)) == ["step-00000006.pt", "step-00000008.pt"]
    raw = bytearray((ckpts / "last.pt").read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])
    with open(ckpts / "last.pt", "r+b") as f:
        f.write(raw)
    r = _run(_cmd(data, out, "--epochs", "2", "--resume", "--allow-config-change"))
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and line.startswith(f"error: {ckpts / 'last.pt'}: cannot resume from it (damaged")
    previous = ckpts / "step-00000006.pt"
    assert f"the previous good checkpoint is {previous} (epoch 0, batch 6, step 6)" in line
    assert line.endswith(f"resume from it with --resume-from {previous}")
    r = _run(_cmd(data, out, "--epochs", "2", "--allow-config-change", "--resume-from", previous))
    assert r.returncode == 0, r.stderr
    assert "resumed from epoch 0, batch 6 (optimizer step 6)" in r.stderr
    assert checkpoint.load_for_resume(ckpts / "last.pt")["step"] == 16


def _probe(mode: str, *args: str) -> list[str]:
    """tests/probe.py in ``mode`` around ``gpupipe train``: the command (python, the probe, its arguments, --)."""
    return [sys.executable, str(REPO_ROOT / "tests" / "probe.py"), mode, *args, "--"]


def test_ctrl_c_during_the_start_up_imports_is_one_line_and_status_130(data, tmp_path):
    """The probe: a Ctrl-C before the first batch (torch and the training loop still being imported) printed a
    66-line KeyboardInterrupt traceback and the process died of SIGINT (status -2)."""
    out = tmp_path / "run"
    proc = _start([*_probe("int-at-import", "gpupipe.train.loop"), *_cmd(data, out, "--epochs", "1")[3:]])
    code, lines = _finish(proc)
    assert code == 130 and lines == [
        f"interrupted: stopped at once; no checkpoint was saved ({out}/checkpoints/last.pt does not exist): nothing "
        "to resume"
    ], lines


def test_a_second_ctrl_c_during_a_checkpoint_write_names_the_checkpoint_kept(data, tmp_path):
    """Ctrl-C in epoch 1, then a second one in the middle of the checkpoint write it asked for: the probe got
    ``cannot write the checkpoint ([enforce fail at inline_container.cc:672] . unexpected pos ...`` and status 2. The
    write is abandoned; last.pt is still the checkpoint of epoch 0's end, whole."""
    out = tmp_path / "run"
    proc = _start([*_probe("int-in-save", "2"), *_cmd(data, out, "--epochs", "3")[3:]], step_s=0.3)
    _wait_for(proc, "epoch 1  2/8")
    proc.send_signal(signal.SIGINT)
    code, lines = _finish(proc)
    last = out / "checkpoints" / "last.pt"
    assert code == 130 and not any("Traceback" in line for line in lines), lines
    assert lines[-1] == (
        f"interrupted: stopped at once; the write of {last} was interrupted: it still holds the previous checkpoint, "
        "and it verifies; --resume goes on from it"
    ), lines
    saved = checkpoint.load(last)["loader"]
    assert checkpoint.verify(last) is None and (saved["epoch"], saved["batch"]) == (1, 0)
    assert not list(last.parent.glob(".*.tmp-*"))  # the abandoned write left nothing behind
