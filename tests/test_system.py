"""gpupipe/_system.py: the cores a rank may take, and its rank on the node."""

import os
import threading

import pytest
import torch

import gpupipe
from gpupipe._system import (
    WORKER_NICENESS,
    cores_per_rank,
    default_workers,
    local_rank,
    lower_priority,
    made_below,
    usable_cores,
)


def test_the_node_cores_are_shared_among_its_ranks(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_per_rank() == usable_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_rank() == max(1, usable_cores() // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(usable_cores() * 4))
    assert cores_per_rank() == 1


def test_local_rank_comes_from_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3


def test_a_rank_that_is_no_number_is_an_error_naming_its_variable(monkeypatch):
    for bad in ("abc", "\u0663", "-1", "1_0"):  # \u0663: an Arabic-Indic three, which int() would take
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(ValueError, match=f"environment variable LOCAL_RANK={bad!r}: expected a whole number"):
            local_rank()
    monkeypatch.setenv("LOCAL_RANK", "")
    assert local_rank() is None


def _gpus(monkeypatch, count: int, current: int = 0, visible: str | None = None) -> list:
    """torch.cuda as a process that sees ``count`` GPUs (no GPU can run here: its counts are stood in for); what
    set_device was given."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    set_to: list = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return set_to


def test_one_device_rule_for_loaders_and_training(monkeypatch):
    """``cuda:N`` is honoured; bare ``cuda`` is LOCAL_RANK's GPU when the rank sees the node's GPUs, the current one
    when it sees only its own (CUDA_VISIBLE_DEVICES per rank, as SLURM sets it); an index it does not see is one
    line naming the device. gpupipe train's Distributed follows the same rule as build_loader."""
    import pytest
    import torch

    from gpupipe._system import resolve_device
    from gpupipe.backends.dali_graph import dali_device_id
    from gpupipe.train.distributed import Distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: None)  # NCCL: the device is the point
    _gpus(monkeypatch, 4)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:3") == torch.device("cuda", 3) and dali_device_id(torch.device("cuda")) == 1
    set_to = _gpus(monkeypatch, 1, visible="5")  # each rank sees only its own GPU
    assert resolve_device("cuda") == torch.device("cuda", 0)
    dist = Distributed("cuda")
    assert dist.device == torch.device("cuda", 0) and set_to == [torch.device("cuda", 0)]  # was cuda:1: no such GPU
    with pytest.raises(ValueError, match=r"device='cuda:1': this process sees 1 CUDA device\(s\) \(CUDA_VISIBLE_"):
        Distributed("cuda:1")
    set_to = _gpus(monkeypatch, 4)
    assert Distributed("cuda:2").device == torch.device("cuda", 2) and set_to == [torch.device("cuda", 2)]
    assert resolve_device("cpu") == torch.device("cpu")
    _gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda")


def test_devices_compare_by_type_and_index(monkeypatch):
    """tests' same_device: ``cuda`` is the current GPU (accelerate's ``cuda`` and a batch's ``cuda:0`` are the same)."""
    import torch

    from .common_utils import same_device

    _gpus(monkeypatch, 2, current=1)
    assert same_device("cuda", "cuda:1") and not same_device("cuda", "cuda:0") and same_device("cuda:0", "cuda:0")
    assert not same_device("cuda:0", "cpu") and same_device(torch.device("cpu"), "cpu")


@pytest.mark.parametrize("ranks", [None, "2"])
def test_a_gpu_rank_leaves_its_training_thread_a_core(monkeypatch, ranks):
    """By default the workers take the rank's share of the cores, less one where batches go to a GPU: the training
    thread launches the GPU's work and must not wait for a core (a CPU device's training thread is the model's
    compute, and shares every core). At least one worker."""
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    share = cores_per_rank()
    assert default_workers(torch.device("cuda")) == default_workers(torch.device("cuda", 1)) == max(1, share - 1)
    assert default_workers(torch.device("cpu")) == share
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_workers(torch.device("cuda")) == 16 // int(ranks or 1) - 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_workers(torch.device("cuda")) == 1


def test_build_loader_takes_the_default_rule(folder, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    loader = gpupipe.build_loader(folder, "pillow", batch_size=4, image_size=32, device="cpu")
    assert loader.parts.workers == default_workers(torch.device("cpu")) == 6


def test_lower_priority_makes_a_process_nicer_by_the_set_amount():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as a worker's first step
        lower_priority(0)
        os.write(w, str(os.getpriority(os.PRIO_PROCESS, 0)).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert int(os.read(r, 16)) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS)


def _started_inside() -> tuple[int, int]:
    """The niceness and scheduling policy of a thread started by the calling one (as a library starts its own)."""
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)))
    )
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's scheduling policies")
def test_threads_made_below_run_nicer_and_only_on_cores_nothing_else_wants():
    base, policy = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)
    assert made_below(_started_inside) == (min(19, base + WORKER_NICENESS), os.SCHED_IDLE)
    assert (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)) == (base, policy)  # the caller as it was


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's scheduling policies")
def test_where_the_idle_policy_is_refused_the_threads_made_below_are_still_nicer(monkeypatch):
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    base, policy = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)
    assert made_below(_started_inside) == (min(19, base + WORKER_NICENESS), policy)


def test_what_the_made_below_call_raises_is_raised_to_its_caller():
    def fails():
        raise ValueError("no pipeline")

    with pytest.raises(ValueError, match="no pipeline"):
        made_below(fails)
