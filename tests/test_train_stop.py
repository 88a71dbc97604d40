"""train/stop.py with real signals and real DataLoader workers: a stop request, a stalled worker, a lost one."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpupipe.train.stop import (
    STOP_EVERY,
    LoaderStalled,
    StopSignals,
    WorkerLost,
    interrupt_point,
    next_batch,
    resume_command,
    stop_requested,
    worker_errors_in_next,
)


def test_the_first_signal_asks_to_stop_and_a_second_ctrl_c_stops_at_the_next_interrupt_point():
    """The second Ctrl-C is not raised in the handler, wherever the main thread is (inside a lock's ``with``, a queue's
    or a thread pool's, it left the lock held and the run hung at its exit): at the next interrupt point, once; a
    third is raised at once."""
    before = signal.getsignal(signal.SIGINT)
    said = []
    with StopSignals(announce=said.append, force_after_s=60) as stop:
        interrupt_point()  # nothing asked: nothing raised
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # again: the save is on its way
        interrupt_point()
        os.kill(os.getpid(), signal.SIGINT)  # the second signal, a Ctrl-C: not raised here
        assert stop.now
        with pytest.raises(KeyboardInterrupt):
            interrupt_point()
        interrupt_point()  # once: the run is on its way out
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a third: at once
    assert said == ["SIGTERM: stopping after this step to save a checkpoint"]
    assert signal.getsignal(signal.SIGINT) is before  # put back
    interrupt_point()  # outside a run: nothing


def test_a_second_ctrl_c_no_interrupt_point_takes_is_raised_where_the_main_thread_waits():
    """A run waiting for a batch that does not come reaches no interrupt point: the second Ctrl-C is raised in its
    wait after ``force_after_s``, as Python's own handler would have at once."""
    with StopSignals(announce=lambda text: None, force_after_s=0.2) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            threading.Event().wait(30)
        assert stop.now and time.monotonic() - t0 < 25


def test_a_forced_second_ctrl_c_is_not_raised_once_the_run_took_it_or_ended():
    with StopSignals(announce=lambda text: None, force_after_s=1.0) as stop:  # seconds to reach the point, busy
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            interrupt_point()
        assert not threading.Event().wait(1.5)  # the forced signal is not sent: nothing raised in the wait
    with StopSignals(announce=lambda text: None, force_after_s=1.0) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.now
    assert not threading.Event().wait(1.5)  # the run ended before: not raised after it


def test_a_forced_ctrl_c_on_its_way_as_the_run_ends_is_never_raised_after_it(monkeypatch):
    """The forcing thread checked that the run had not ended, then signalled: a run ending in between had its own
    handlers back, and Python's raised the KeyboardInterrupt after the run, wherever the program was by then."""
    real = signal.pthread_kill

    def preempted(*args):  # the forcing thread, held up between its check and its signal
        time.sleep(0.5)
        real(*args)

    monkeypatch.setattr(signal, "pthread_kill", preempted)
    with contextlib.suppress(KeyboardInterrupt):  # taken as the run ends, or let go: both are the run's
        with StopSignals(announce=lambda text: None, force_after_s=0.1):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # no interrupt point: the run ends while the forced signal is on its way
    try:
        threading.Event().wait(1.0)
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt came after the run had ended")


class _Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([i])


def _worker_pids(it) -> list[int]:
    return [w.pid for w in it._workers]  # the test reaches into torch to pick a real worker to signal


def _end(it) -> None:
    """Shut the iterator's workers down and reap them now: an iterator left alive (a traceback holds it) keeps its
    dead worker registered with torch's SIGCHLD handler, which then raises in whatever test runs next."""
    it._shutdown_workers()


def test_a_stopped_worker_is_an_error_naming_it_within_the_timeout():
    with worker_errors_in_next():  # as a run does: the worker ended below must not raise in torch's SIGCHLD handler
        it = iter(DataLoader(_Slow(), batch_size=4, num_workers=1, prefetch_factor=1))
        next_batch(it, 10)
        pid = _worker_pids(it)[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.perf_counter()
            with pytest.raises(LoaderStalled) as e:
                for _ in range(20):
                    next_batch(it, 1.0)
            assert time.perf_counter() - start < 5
        finally:
            os.kill(pid, signal.SIGCONT)
            _end(it)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("no batch from the data loader for 1 s (--loader-timeout-s)")
    assert f"worker pid {pid} is stopped (SIGSTOP, or a debugger), and was ended" in msg


@pytest.mark.slow
def test_a_killed_worker_is_one_line_naming_it_in_next_never_in_the_middle_of_a_step():
    """torch's SIGCHLD handler would raise in whatever the main thread is doing (here: a busy loop standing for an
    optimizer step); with it off, the loss shows in next_batch."""
    with worker_errors_in_next():
        it = iter(DataLoader(_Slow(), batch_size=4, num_workers=2, prefetch_factor=1))
        next_batch(it, 30)
        pid = _worker_pids(it)[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:  # the "step": no exception may land here
            sum(range(1000))
        with pytest.raises(WorkerLost) as e:
            for _ in range(20):
                next_batch(it, 30)  # torch's poll notices the lost worker within 5 s: well before 30
        _end(it)
    msg = str(e.value)
    assert "\n" not in msg and f"DataLoader worker (pid(s) {pid}) exited unexpectedly" in msg


def test_forked_workers_ignore_ctrl_c():
    """A Ctrl-C in a terminal reaches the whole process group. (SIGTERM from anyone but its parent ends a worker:
    torch's own handler; the loop then saves, as for any lost worker.)"""
    with StopSignals(announce=lambda text: None):
        it = iter(DataLoader(_Slow(), batch_size=4, num_workers=1, prefetch_factor=1))
        next_batch(it, 10)
        os.kill(_worker_pids(it)[0], signal.SIGINT)
        assert sum(len(b) for b in it) == 60  # the worker went on
        del it


def test_resume_command_repeats_the_command_with_resume(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/gpupipe", "train", "--out", "my run", "--resume", "--epochs", "3"])
    assert resume_command("my run") == "gpupipe train --out 'my run' --epochs 3 --resume"


@pytest.mark.parametrize("script", ["torchrun", "gpupipe-torchrun"])
def test_under_a_launcher_script_the_resume_command_names_it_as_typed(monkeypatch, tmp_path, script):
    """A console script's process is ``python /venv/bin/NAME ...``: the resume command starts with NAME, as typed."""
    args = ["train", "--out", "o"]
    parent = tmp_path / "cmdline"
    parent.write_bytes(
        b"\0".join(
            a.encode()
            for a in ["/venv/bin/python3", f"/venv/bin/{script}", "--nproc-per-node", "2", "-m", "gpupipe", *args]
        )
        + b"\0"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda f, *a, **k: real_open(parent if str(f).startswith("/proc/") else f, *a, **k)
    )
    monkeypatch.setattr("sys.argv", ["/x/gpupipe", *args])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    assert resume_command("o") == f"{script} --nproc-per-node 2 -m gpupipe train --out o --resume"


def test_a_stall_at_the_open_file_limit_is_named_as_such():
    """Under a low ``ulimit -n`` a loader stalled (a worker could not hand over its batch's file descriptor) and the
    run blamed "a hung read (a network file system?)"; a process at its limit is now named."""
    import resource

    def stalled():
        time.sleep(30)
        yield None

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
        with pytest.raises(LoaderStalled, match=r"no batch .* for 0.5 s .*: too many open files \(ulimit -n is \d+"):
            next_batch(stalled(), 0.5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _rank_checks_stop(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: rank 1 is signalled after optimizer step 3; which steps end with a stop, and how many
    all-reduces that took."""
    import torch.distributed as dist

    from gpupipe.train.distributed import Distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    ranks, stop, reduces, stopped_at = Distributed("cpu", timeout_s=60), StopSignals(announce=lambda text: None), [], []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: reduces.append(1) or real(*a, **k)
    for step in range(1, 3 * STOP_EVERY):
        if rank == 1 and step == 4:
            stop.signum = signal.SIGTERM
        if stop_requested(stop, ranks, step):
            stopped_at.append(step)
            break
    ranks.close()
    torch.save({"stopped_at": stopped_at, "all_reduces": len(reduces)}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_ddp_ranks_agree_on_a_stop_without_a_collective_every_step(tmp_path):
    """A SIGTERM to one rank stops both at the same step, the first multiple of STOP_EVERY after it; until then the
    ranks made one all-reduce every STOP_EVERY steps, not one a step."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_checks_stop, args=(port, str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [g["stopped_at"] for g in got] == [[STOP_EVERY], [STOP_EVERY]]
    assert [g["all_reduces"] for g in got] == [1, 1]


def test_a_second_ctrl_c_during_validation_stops_it_at_the_next_batch():
    """Validation had no interrupt point: a second Ctrl-C there waited for the force after 2 s, then was raised
    wherever the main thread was (3.3-3.8 s from the Ctrl-C to the exit). It is taken at the next batch now."""
    from gpupipe.train.distributed import Distributed
    from gpupipe.train.loop import evaluated
    from gpupipe.train.precision import Precision

    taken = []

    class Batches:  # a loader's part evaluated() uses: batches, counted as they are taken
        device = torch.device("cpu")

        def __iter__(self):
            for k in range(4):
                taken.append(k)
                yield torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.int64)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    with StopSignals(announce=lambda text: None, force_after_s=60):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the second: at the next interrupt point
        with pytest.raises(KeyboardInterrupt):
            evaluated(model, Batches(), Precision("fp32", torch.device("cpu")), Distributed("cpu"))
    assert taken == [0]


def test_a_stop_asked_during_validation_says_it_comes_when_validation_ends():
    """The epoch's checkpoint is saved before its validation: a stop asked then saves nothing more and comes when the
    validation ends, which the first line now says ("stopping after this step to save a checkpoint" before)."""
    said: list[str] = []
    with StopSignals(announce=said.append, force_after_s=60) as stop:
        stop.validating = True
        os.kill(os.getpid(), signal.SIGINT)
    assert said == [
        "SIGINT (Ctrl-C): stopping when this validation ends (the epoch's checkpoint is saved) (Ctrl-C again to stop "
        "at once, saving nothing)"
    ]
