"""gpupipe/bench/sim_step.py: the data-wait of a simulated model step fed by a loader, and the contention probe; its
report as bench/tables.py prints it."""

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest

from gpupipe.bench import sim_step

from .common_utils import make_folder

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """2 classes x 6 JPEGs: 6 batches of 2 an epoch."""
    return make_folder(tmp_path_factory.mktemp("sim"), 2, 6)


def test_the_step_spends_cpu_time_on_this_thread():
    t0 = time.thread_time()
    sim_step.spin(0.02)
    assert time.thread_time() - t0 >= 0.02


def test_a_report_holds_each_backend_and_reads_as_a_table(data, tmp_path):
    s = sim_step.Settings(batch=2, size=16, workers=1, epochs=2, steps=4, probe_ms=1.0, probe_rounds=3)
    report = sim_step.run(str(data), ["pillow"], s)
    (row,) = report["results"]
    assert row["backend"] == "pillow" and row["workers"] == 1
    assert row["steps_per_epoch"] == 5 and len(row["epoch_start_ms"]) == 2  # each pass left one batch early
    assert 0 <= row["data_wait"] <= 1 and row["probe_ratio"] > 0 and row["probe_flat_out_ratio"] > 0
    assert row["probe_flat_out_core_wait_ms"] is None or row["probe_flat_out_core_wait_ms"] >= 0
    assert row["step_cpu_ms"] == pytest.approx(0.25 * 1.5 * row["loader_alone_ms"], rel=0.05, abs=0.02)
    path = tmp_path / "sim-step.json"
    path.write_text(json.dumps(report))
    spec = importlib.util.spec_from_file_location("bench_tables", BENCH / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    lines = tables.table(path).splitlines()
    assert report["date"] in lines[0] and "commit" in lines[0]
    assert lines[-1].startswith("| pillow | 1 |")


def test_too_few_batches_for_the_steps_asked_is_one_line(data):
    s = sim_step.Settings(batch=2, size=16, workers=0, epochs=1, steps=30, probe_ms=1.0, probe_rounds=1)
    with pytest.raises(ValueError, match=r"6 batches of 2 an epoch, fewer than --steps 30 \+ 1"):
        sim_step.run(str(data), ["pillow"], s)


@pytest.mark.slow
def test_gpupipe_bench_runs_it(tmp_path):
    """``gpupipe bench --simulate-step``: the same report, from the bench's own flags (30 steps an epoch)."""
    from gpupipe.cli import main

    data, out = make_folder(tmp_path / "data", 2, 32), tmp_path / "sim.json"
    argv = ["bench", "--simulate-step", "--data", str(data), "--backends", "pillow", "--batch-size", "2"]
    assert main([*argv, "--image-size", "16", "--workers", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["backend"], row["batch"], row["size"], row["workers"]) == ("pillow", 2, 16, 1)


def test_the_probe_times_the_training_thread_idle_and_beside_the_loaders_work_in_pairs(monkeypatch):
    """Each pair times the probe alone first, then right after a ``take()``: a take that leaves work holding the GIL
    (here, a probe that then takes twice as long) reads 2x, a take that starts nothing 1x. The probe's clock is
    replaced, so the pairing is checked and not the machine's timing (a busy 2-core machine made the real GIL's
    share miss its bound)."""
    crowded = {"now": False}
    order = []

    def timed(n):
        order.append("crowded" if crowded["now"] else "alone")
        took = 0.02 if crowded["now"] else 0.01
        crowded["now"] = False
        return took

    def crowding():
        order.append("take")
        crowded["now"] = True

    monkeypatch.setattr(sim_step, "_timed", timed)
    alone, loaded = sim_step.time_probe(1, 5, crowding, settle=0.0)
    assert (alone, loaded) == (pytest.approx(10.0), pytest.approx(20.0))
    assert order == ["alone", "take", "crowded"] * 5
    assert sim_step.time_probe(1, 5, lambda: None, settle=0.0) == (pytest.approx(10.0), pytest.approx(10.0))


def test_flat_out_is_set_beside_the_probe_alone_of_its_own_round_so_the_machines_drift_stays_out(monkeypatch):
    """The machine halves its speed for the second half of the run (on a shared machine a pure-Python task's time
    alone moves: bench/README.md). A loader that costs the training thread nothing reads 1.0x flat out, where
    the flat-out times over the probe alone of the run's start read 1.5x."""
    takes = []
    slow = {"by": 1.0}

    def take():
        takes.append(1)
        slow["by"] = 2.0 if len(takes) > 3 * 8 else 1.0  # rounds 4-6 (5 drained + 3 timed a round) at half speed

    monkeypatch.setattr(sim_step, "_timed", lambda n: 0.007 * slow["by"])
    flat = sim_step.time_flat_out(1, 6, take, settle=0.0, drain=5, per_round=3)
    assert len(takes) == 6 * (5 + 3)
    assert flat.ms / 7.0 == pytest.approx(1.5)  # the drift: half the rounds at twice the time
    assert flat.ratio == pytest.approx(1.0)


def test_flat_out_reports_the_median_time_the_probe_waited_for_a_core(monkeypatch):
    """The run queue's delay read around each flat-out probe only (not the takes, not the probes alone): a loader whose
    threads take the training thread's core shows here, 3 ms of each 10 ms probe."""
    clock = {"wait": 0.0}

    def timed(n):
        clock["wait"] += 0.003
        return 0.010

    def take():
        clock["wait"] += 1.0  # a take that waits for a core is not the probe's wait

    monkeypatch.setattr(sim_step, "_timed", timed)
    monkeypatch.setattr(sim_step, "core_wait", lambda: clock["wait"])
    flat = sim_step.time_flat_out(1, 4, take, settle=0.0, drain=2, per_round=3)
    assert flat.core_wait_ms == pytest.approx(3.0)
    monkeypatch.setattr(sim_step, "core_wait", lambda: None)  # a kernel that does not keep it
    assert sim_step.time_flat_out(1, 4, take, settle=0.0, drain=2, per_round=3).core_wait_ms is None


@pytest.mark.skipif(sim_step.core_wait() is None or not hasattr(os, "sched_setaffinity"), reason="Linux's schedstat")
def test_the_core_wait_counts_a_thread_kept_off_its_core_and_not_its_sleep():
    """A process spinning on the one core this thread may use makes it wait for that core, about half of its time;
    a sleep is not a wait for a core."""
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    r, w = os.pipe()
    parent = os.getpid()
    spinner = os.fork()
    if spinner == 0:  # the child: on the same core, spinning once it has said so, until its parent is gone
        try:
            os.sched_setaffinity(0, {cpu})
            os.write(w, b"1")
            while os.getppid() == parent:
                pass
        finally:
            os._exit(0)
    os.close(w)  # the child's end only: a child that dies before it writes is an empty read, not a hang
    try:
        assert os.read(r, 1) == b"1", "the spinning child did not start"
        os.sched_setaffinity(0, {cpu})
        before = sim_step.core_wait()
        sim_step.spin(0.3)
        crowded = sim_step.core_wait() - before
    finally:
        os.sched_setaffinity(0, mine)
        os.kill(spinner, signal.SIGKILL)
        os.waitpid(spinner, 0)
        os.close(r)
    before = sim_step.core_wait()
    time.sleep(0.2)
    slept = sim_step.core_wait() - before
    assert crowded >= 0.05 and slept < 0.05
