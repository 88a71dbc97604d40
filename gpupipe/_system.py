"""Facts about the machine that several parts of gpupipe need."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def env_int(name: str) -> int | None:
    """The environment variable ``name`` as a whole number >= 0 (ASCII digits), None when unset or empty; anything
    else is a ``ValueError`` naming the variable (``LOCAL_RANK=abc`` is a launcher's mistake, not rank 0)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not re.fullmatch(r"[0-9]+", value):
        raise ValueError(f"environment variable {name}={value!r}: expected a whole number >= 0")
    return int(value)


def local_rank() -> int | None:
    """This process's rank on its node under torchrun (``LOCAL_RANK``), or None outside a launcher."""
    return env_int("LOCAL_RANK")


def local_ranks() -> int:
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside a launcher): they share its cores and its
    shard cache."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1


def cores_per_rank() -> int:
    """The usable cores shared out among the node's ranks (``LOCAL_WORLD_SIZE`` under torchrun): the default for
    decode workers and DALI threads, so 8 ranks do not start 8 times the node's cores."""
    return max(1, usable_cores() // local_ranks())


def default_workers(device: torch.device) -> int:
    """Decode workers when none are asked for: the rank's share of the cores (:func:`cores_per_rank`), less one where
    batches go to a GPU, so the training thread, which launches the GPU's work and must never wait for a core, keeps
    one to itself (a CPU device's training thread computes, and its workers' share is every core)."""
    share = cores_per_rank()
    return max(1, share - 1) if device.type == "cuda" else share


WORKER_NICENESS = 10  # decode workers for a GPU run this much nicer than the training process (os.nice)


def lower_priority(worker_id: int | None = None) -> None:
    """Lower this process's CPU priority by :data:`WORKER_NICENESS` (a DataLoader ``worker_init_fn``, or the first
    thing a loader's helper process does): a worker then takes a core only when the training thread is not using
    it, so the step never waits behind a decode (a worker's own batches are made ahead, in its idle time). Beside
    workers at its own priority a fixed task on the training thread took much longer than alone; with them niced, as
    long as alone (bench/README.md: figures behind the code)."""
    if hasattr(os, "nice"):
        os.nice(WORKER_NICENESS)


def is_main_rank() -> bool:
    """Whether this process speaks for the run: rank 0, or the only one (torchrun's ``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def lower_thread_priority(tids: set[int]) -> None:
    """:func:`lower_priority` for threads of this process (a library's decode threads, such as DALI's, started in the
    training process): on Linux a thread's niceness is its own. Where Linux has it, each thread is also put under
    ``SCHED_IDLE``: it then runs only on a core that no thread of the normal policy wants, and its wake-ups never
    take the training thread's core. Nice +10 alone was not enough for DALI: its executor's thread and its pool's
    outnumber the cores left beside the training thread, and a nicer thread that wakes still takes a core for a
    slice; a fixed task on the training thread, batches taken flat out, spent up to a quarter of its time waiting
    for its core behind them (bench/README.md, "DALI's threads under SCHED_IDLE"). A thread already gone is skipped."""
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS))
        except OSError:
            continue
        if idle is not None:
            with contextlib.suppress(OSError):  # a sandbox that forbids it: the niceness stands
                os.sched_setscheduler(tid, idle, os.sched_param(0))


def made_below(make: Callable[[], T]) -> T:
    """``make()`` run on a short-lived thread below the caller (:func:`lower_thread_priority`): on Linux a thread
    starts at the niceness and the scheduling policy of the thread that starts it, so the threads ``make`` starts (a
    library's decode threads, such as DALI's pipeline's) run below the training thread from their first instruction,
    whatever their names and whenever they are named. What ``make`` raises is raised here."""
    out: list = []

    def run() -> None:
        lower_thread_priority({threading.get_native_id()})
        try:
            out.append((True, make()))
        except BaseException as e:  # raised again on the calling thread
            out.append((False, e))

    thread = threading.Thread(target=run, name="gpupipe-below")
    thread.start()
    thread.join()
    made, value = out[0]
    if not made:
        raise value
    return value


def as_device(device: str | int | torch.device) -> torch.device:
    """``torch.device(device)``, or one line naming the argument and its valid values (torch's error lists every
    device type it was built to know)."""
    import torch  # defer: this module is read by light ones

    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {device!r}") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The one rule for where a process's batches and model go: ``None`` is CUDA when torch sees a GPU, else the CPU;
    ``cuda:N`` is GPU N of those this process sees; bare ``cuda`` is this rank's GPU under torchrun (``LOCAL_RANK``)
    when the process sees every GPU of the node, else (``CUDA_VISIBLE_DEVICES`` per rank, as SLURM sets it) the
    current one. Fixed once, so the loader, the model, DDP and collectives all use the same index."""
    import torch  # defer: this module is read by light ones

    device = as_device(("cuda" if torch.cuda.is_available() else "cpu") if device is None else device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for, but torch sees no CUDA device")
    count = torch.cuda.device_count()
    if device.index is None:
        rank = local_rank()
        return torch.device("cuda", rank if rank is not None and rank < count else torch.cuda.current_device())
    if device.index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(f"device={str(device)!r}: this process sees {count} CUDA device(s){seen}, numbered from 0")
    return device
