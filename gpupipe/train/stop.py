"""How a run stops without losing work: Ctrl-C and SIGTERM, a stalled or lost data loader worker.

- The first SIGINT (Ctrl-C) or SIGTERM (what schedulers send before a kill, and on preemption) asks the loop to stop
  at the next optimizer-step boundary: it saves a checkpoint there, prints the resume command and exits non-zero
  (:class:`Stopped`). A second Ctrl-C stops at once (``KeyboardInterrupt``), saving nothing more; one in the middle
  of a checkpoint write abandons it (``checkpoint.WriteInterrupted`` says which checkpoint is kept). The handler does
  not raise it wherever the main thread happens to be: an exception raised between two bytecodes of a lock's
  ``with`` (a queue's, a thread pool's, TensorBoard's writer's) leaves the lock held or broken, and the run hung at
  its exit. It is raised at the loop's next :func:`interrupt_point` (each micro-batch, each write of a checkpoint),
  and only where none comes within :data:`FORCE_AFTER_S` (a batch that does not come) wherever the thread waits.
- DataLoader workers (forked) inherit the handlers and ignore Ctrl-C, which a terminal sends to every process of the
  group. (torch ends a worker on a SIGTERM from anyone but its parent; the loop then saves as for a lost worker.)
- torch's SIGCHLD handler, which raises a dead worker's error at any point of the main thread, is off for the run:
  the loader's own check reports it in ``next()`` instead (:func:`worker_errors_in_next`).
- :func:`next_batch` waits for a batch at most ``timeout_s``: a stalled worker (``SIGSTOP``, a hung read on a network
  file system) becomes :class:`LoaderStalled` naming it; a worker that died (SIGKILL, out of memory) becomes
  :class:`WorkerLost`. The loop saves at the last step boundary and re-raises either as one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

from .._runlock import RunLock
from ..data.loader import WorkerResourceError, shortage
from ..errors import GpupipeError
from .distributed import Distributed

_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class Stopped(GpupipeError):
    """The run stopped on a signal after saving; ``exit_code`` is the shell's (128 + the signal's number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class LoaderStalled(GpupipeError):
    """No batch came from the data loader within the timeout; the message names the workers."""


class WorkerLost(GpupipeError):
    """A data loader worker died (killed, out of memory); the message names it."""


FORCE_AFTER_S = 2.0  # a second Ctrl-C that no interrupt point took by then is raised wherever the main thread is
_ACTIVE: list[StopSignals] = []  # the StopSignals entered in this process (its main thread's), for interrupt_point


def interrupt_point() -> None:
    """Where a second Ctrl-C stops the run (``KeyboardInterrupt``): a point with no lock held, between micro-batches
    or in a checkpoint's write. Nothing without one."""
    if _ACTIVE:
        _ACTIVE[-1].take()


class StopSignals:
    """``with StopSignals() as stop:`` SIGINT and SIGTERM set ``stop.signum`` instead of ending the process (in the
    main thread of the process that entered it; elsewhere, and in forked workers, they are ignored or left alone). A
    second SIGINT sets ``stop.now``: :func:`interrupt_point` raises it, or after ``force_after_s`` the handler does."""

    def __init__(
        self, announce=lambda text: print(text, file=sys.stderr, flush=True), force_after_s: float = FORCE_AFTER_S
    ):
        self.signum: int | None = None
        self.announce = announce
        self.force_after_s = force_after_s
        self.now = False  # a second Ctrl-C came: stop at once
        self.validating = False  # the run validates (its epoch's checkpoint saved): a stop comes when that ends
        self._taken = False  # its KeyboardInterrupt was raised
        self._closed = False
        self._closing = threading.Lock()  # a forced signal is sent before the handlers go back, or not at all
        self._pid = os.getpid()
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in _NAMES:
                self._old[sig] = signal.signal(sig, self._handle)
            _ACTIVE.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            with self._closing:  # a forced signal sent already is raised here (the acquire runs its handler)
                self._closed = True  # first: a forced signal still on its way is not raised in here
        finally:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old.clear()

    def take(self) -> None:
        """An interrupt point: the second Ctrl-C's ``KeyboardInterrupt``, raised here once."""
        if self.now and not self._taken:
            self._taken = True
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid or self._closed:  # a forked DataLoader worker: the main process decides
            return
        if self.signum is not None:
            if signum != signal.SIGINT:
                return  # a repeated SIGTERM: the save is on its way
            if self.now:  # a third Ctrl-C, or no interrupt point came in time: here, wherever this is
                self._taken = True
                raise KeyboardInterrupt
            self.now = True  # the second Ctrl-C: at the next interrupt point
            threading.Thread(target=self._force_later, name="gpupipe-stop-now", daemon=True).start()
            return
        self.signum = signum
        saved = "when this validation ends (the epoch's checkpoint is saved)"
        when = saved if self.validating else "after this step to save a checkpoint"
        again = " (Ctrl-C again to stop at once, saving nothing)" if signum == signal.SIGINT else ""
        self.announce(f"{_NAMES[signum]}: stopping {when}{again}")

    def _force_later(self) -> None:
        """No interrupt point came within ``force_after_s`` (the main thread waits for a batch that does not come):
        the second Ctrl-C raised wherever it is, as Python's own handler would."""
        time.sleep(self.force_after_s)
        with self._closing:  # not between __exit__'s close and its handlers' return: Python's would raise after it
            if not self._taken and not self._closed:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    @property
    def requested(self) -> bool:
        return self.signum is not None


def resume_command(out: str) -> str:
    """The command line that resumes this run: the one given, ``--resume`` added once; under torchrun, the
    launcher's command (which started this process), not this rank's."""
    args = [a for a in sys.argv[1:] if a not in ("--resume", "--resume-or-start")]
    if not args:
        return f"gpupipe train --out {shlex.quote(out)} --resume"
    return shlex.join([*_launcher(sys.argv[1:]), *args, "--resume"])


_LAUNCHERS = ("torchrun", "gpupipe-torchrun")  # console scripts: a python running /venv/bin/NAME


def _launcher(args: list[str]) -> list[str]:
    """What comes before this process's arguments in the command a user typed: ``gpupipe``, or under torchrun
    (``TORCHELASTIC_RUN_ID`` set) torchrun's own words (``torchrun --nproc-per-node 2 -m gpupipe``), read from its
    command line (the parent process's)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["gpupipe"]
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        parent = []
    if len(parent) <= len(args) or parent[len(parent) - len(args) :] != args:  # not a launcher we can read
        nproc = os.environ.get("LOCAL_WORLD_SIZE", "1")
        return ["torchrun", f"--nproc-per-node={nproc}", "-m", "gpupipe"]
    words = parent[: len(parent) - len(args)]
    if len(words) > 1 and os.path.basename(words[1]) in _LAUNCHERS:  # python /venv/bin/torchrun ...: as typed
        words = [os.path.basename(words[1]), *words[2:]]
    return words


def stopped(stop: StopSignals, where: str, out: str) -> Stopped:
    """The exception that ends a run stopped by a signal, after the checkpoint at ``where`` was saved."""
    assert stop.signum is not None
    return Stopped(
        f"stopped by {_NAMES[stop.signum]}; checkpoint saved at {where}; resume with: {resume_command(out)}",
        128 + stop.signum,
    )


class _Alarm(BaseException):  # not an Exception: no loader's error handling may take it for a data error
    pass


def next_batch(batches: Iterator, timeout_s: float) -> Any:
    """``next(batches)``, waiting at most ``timeout_s`` seconds (0: for ever) in the main thread; a stalled loader is
    :class:`LoaderStalled` naming its workers, a dead worker :class:`WorkerLost`."""
    timed = timeout_s > 0 and threading.current_thread() is threading.main_thread()
    if timed:
        old = signal.signal(signal.SIGALRM, _raise_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return next(batches)
    except _Alarm:
        raise LoaderStalled(
            f"no batch from the data loader for {timeout_s:g} s (--loader-timeout-s): {_workers_state()}"
        ) from None
    except WorkerResourceError as e:  # out of shared memory or open files: named, and the run saves as for a loss
        raise WorkerLost(str(e)) from None
    except RuntimeError as e:
        if "DataLoader worker" not in str(e):
            raise
        raise WorkerLost(f"{str(e).splitlines()[0].rstrip('. ')} (killed, or out of memory?)") from None
    except (ConnectionError, EOFError):  # a worker died in the middle of sending a batch: its pipe broke
        dead = ", ".join(str(pid) for pid, state in _child_states().items() if state == "Z") or "?"
        why = _out_of_files() or "killed, or out of memory?"
        raise WorkerLost(f"DataLoader worker (pid(s) {dead}) exited unexpectedly ({why})") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _out_of_files() -> str | None:
    """The shortage in words when this process or a worker holds as many files as its limit allows (a batch handed
    over in shared memory takes a file descriptor on each side): then a broken pipe or a stall is that."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    for pid in [os.getpid(), *_children(os.getpid())]:
        try:
            if len(os.listdir(f"/proc/{pid}/fd")) >= limit - 4:
                return shortage(os.strerror(errno.EMFILE))
        except OSError:
            continue
    return None


def _raise_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Alarm


def _workers_state() -> str:
    """What this process's children (the loader's workers) are doing, from ``/proc``: stopped ones named first."""
    states = _child_states()
    halted = [pid for pid, s in states.items() if s in ("T", "t")]
    for pid in halted:  # a stopped worker never ends on the loader's SIGTERM: the process could not exit
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if halted:
        return (
            f"worker pid {', '.join(map(str, halted))} is stopped (SIGSTOP, or a debugger), and was ended so that "
            "the run can exit; raise --loader-timeout-s if the data is slow to read"
        )
    out_of_files = _out_of_files()
    if out_of_files is not None:
        return out_of_files
    if states:
        return (
            f"workers pid {', '.join(map(str, states))} are alive but deliver nothing: a hung read (a network file "
            "system?); raise --loader-timeout-s if the data is slow to read"
        )
    return "the loader delivers nothing: a hung read (a network file system?)"


def _child_states() -> dict[int, str]:
    """This process's children (the loader's workers) and their state letters from ``/proc`` (T: stopped, Z: dead)."""
    states = {}
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                states[pid] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
    return states


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from ``/proc/*/stat``."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return sorted(kids)


def guard_run(out: str, dist: Distributed, teardown: contextlib.ExitStack) -> StopSignals:
    """What a run holds until it ends, however it ends: the process group (closed at the end), the lock on ``out``
    (one run per folder; rank 0 holds it), and SIGINT/SIGTERM turned into stop requests."""
    teardown.callback(dist.close)
    if dist.is_main:
        teardown.enter_context(RunLock(out))
    teardown.enter_context(worker_errors_in_next())
    if dist.is_main:
        return teardown.enter_context(StopSignals())
    return teardown.enter_context(StopSignals(announce=lambda text: None))  # every rank stops; rank 0 says so


@contextlib.contextmanager
def worker_errors_in_next() -> Iterator[None]:
    """torch's SIGCHLD handler raises a dead worker's error wherever the main thread is, in the middle of an optimizer
    step too; without it the loader notices in ``next()`` (its own liveness check, every 5 s), where the run can
    save first. torch has no switch for it: its private flag says the handler is set, and SIGCHLD is left default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from torch.utils.data._utils import signal_handling

    was_set, old = signal_handling._SIGCHLD_handler_set, signal.getsignal(signal.SIGCHLD)
    signal_handling._SIGCHLD_handler_set = True
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, old)
        signal_handling._SIGCHLD_handler_set = was_set


# Under DDP the ranks agree on a stop with an all-reduce (a collective, and a host sync under NCCL): made every
# STOP_EVERY optimizer steps, not every step, so that the host runs ahead of the GPU between checks. A signal is
# acted on at the first multiple of STOP_EVERY steps after it: at most STOP_EVERY steps more than on one process.
STOP_EVERY = 8


def stop_requested(stop: StopSignals, dist: Distributed, step: int | None = None) -> bool:
    """Whether a SIGINT or SIGTERM asked the run to stop, on any rank (so that all stop at the same step). ``step``:
    the optimizer step just made (under DDP the ranks check on multiples of :data:`STOP_EVERY` only); ``None``: a
    point where the ranks meet anyway (an epoch's end), checked always."""
    if not dist.enabled:
        return stop.requested
    if step is not None and step % STOP_EVERY:
        return False
    return dist.all_reduce_sum([float(stop.requested)])[0] > 0
