"""The dali feed's stream: :class:`~.dali_feed.DaliFeed`'s works, in the order of a plan that runs across epochs,
prepared in DataLoader workers and taken from them on a thread of their own (:class:`FeedStream`). The worker's side,
what one batch's work holds and how it is made, is :mod:`.dali_feed`."""

from __future__ import annotations

import atexit
import functools
import itertools
import multiprocessing
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch

from ..errors import GpupipeError
from ..plumbing.reaper import Reaper
from ..plumbing.workers import end_workers, put_unless_stopped, start_workers, worker_init
from ..plumbing.zygote import Zygote
from .dali_feed import DaliFeed, Gate, Request
from .gpu_feed import Work
from .handover import let_go

_START = 60.0  # seconds a feed worker may take to begin (forked, its first step run)


class _Requests:
    """The DataLoader's sampler: the requests of the plan set by :meth:`FeedStream.restart`."""

    def __init__(self) -> None:
        self.plan: Iterable[Request] = ()

    def __iter__(self) -> Iterator[Request]:
        return iter(self.plan)


def plan(sampler, gate: Gate, epoch: int, start_batch: int, ahead: int) -> Iterator[Request]:
    """``epoch``'s batches from ``start_batch``, then every later epoch's, each made when the feed first asks for it:
    a loader that goes on from one epoch to the next finds the next one's first ``ahead`` batches already read, and
    the rest read once their pass begins (``wait``). Ends at an epoch with no batches. Its first request sets the
    gate to ``epoch`` (made after the DataLoader's reset, when no worker waits on an earlier plan's request).

    Takes the sampler, not the loader: the feed's DataLoader holds this generator, and one that held the loader (which
    holds that DataLoader) would make a cycle, which leaves the feed's workers to the garbage collector (it closes
    their queues before the DataLoader can stop them: 5 s a worker)."""
    gate.set(epoch)
    yield from (Request(epoch, b, k) for k, b in enumerate(sampler.batches(epoch, start_batch), start_batch))
    for e in itertools.count(epoch + 1):
        batches = sampler.batches(e)
        if not batches:
            return
        yield from (Request(e, b, k, ahead=k < ahead, wait=k >= ahead) for k, b in enumerate(batches))


class FeedStream:
    """:class:`DaliFeed` in ``workers`` DataLoader processes (persistent): one plan's works, in order, across epochs.

    The DataLoader's iterator lives as long as the plan does, so an epoch edge costs nothing (a new ``iter()`` would
    drop and read again what the workers had started on, and make the training thread wait for each worker's answer).
    Works are taken from the DataLoader by a thread of this stream (:class:`_Receiver`), as DataLoader's own
    pin-memory thread does: receiving one (a pipe read, unpickling, mapping its shared memory) is no work for the
    training thread. With no workers, works are made when asked, on the caller's thread.

    The workers are forked by ``zygote`` (:mod:`~gpupipe.plumbing.zygote`: a process in which no DALI thread ever
    ran) when it is given and can be sent the feed; else from this process, where a DALI pipeline may run (a fork
    beside its threads may hang as it begins). Either way each worker must report that it began within ``_START``
    seconds: one that does not is killed, and the pass ends with an error naming it, where it would have waited for
    ever."""

    def __init__(
        self,
        feed: DaliFeed,
        workers: int,
        nicer: bool = True,
        cpu: list[float] | None = None,
        zygote: Zygote | None = None,
    ):
        self.feed = feed
        self._cpu = cpu if cpu is not None else [0.0]  # the receiving thread's CPU seconds (it shares the interpreter)
        self._requests = _Requests()
        extra: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 2} if workers > 0 else {}
        # each worker's pid, once it has begun (a pid: persistent workers go on across restarts, and report once)
        self._began = multiprocessing.RawArray("q", max(1, workers))
        if workers > 0:
            # by name, below the trainer
            extra["worker_init_fn"] = functools.partial(_feed_worker_init, nicer=nicer, began=self._began)
            if zygote is not None and zygote.sendable(feed):
                extra["multiprocessing_context"] = zygote.context
        self._loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
            feed,
            batch_size=None,
            sampler=self._requests,  # requests, not indices: DaliFeed takes them
            collate_fn=_as_is,  # type: ignore[arg-type]  # no batching: one Work per request
            num_workers=workers,
            **extra,
        )
        self._reaper = Reaper()
        self._source: _Receiver | Iterator[Work] | None = None

    def restart(self, requests: Iterable[Request]) -> None:
        """From now on, the works of ``requests``, in order; what was asked before is dropped (the DataLoader's reset
        discards what its workers still return)."""
        if isinstance(self._source, _Receiver):
            self._source.stop()  # opens the gate: a worker waiting on it lets the DataLoader's reset through
        self._source = None
        self._requests.plan = requests
        it = start_workers(self._loader)
        self._source = _Receiver(it, self.feed.gate, self._cpu, self._began) if self._loader.num_workers > 0 else it

    def stop(self) -> None:
        """The plan ends and the workers stop now (a pass an error ended: the error's traceback may hold this stream
        for the garbage collector, which would close the DataLoader's queues before it could stop them, 5 s a
        worker); :meth:`restart` starts new ones."""
        if isinstance(self._source, _Receiver):
            self._source.stop(timeout=5)
        self._source = None
        end_workers(self._loader, getattr(self._loader, "_iterator", None))
        let_go()

    @property
    def gate(self) -> Gate:
        return self.feed.gate

    def consuming(self, epoch: int) -> None:
        """The loader now delivers ``epoch``: the workers may read its batches."""
        self.feed.gate.set(epoch)

    def reread(self, work: Work) -> Work:
        """``work`` read again, now, on this thread (its files changed after it was read ahead of its pass)."""
        return self.feed[Request(work.epoch, work.indices, work.number)]

    def next(self) -> Work | None:
        """The plan's next work; None once the plan has ended."""
        if self._source is None:
            return None
        if isinstance(self._source, _Receiver):
            return self._source.get()
        return next(self._source, None)

    def release(self, work: Work) -> None:
        """Drop a fetched work on another thread (its shared-memory buffer, see :class:`Reaper`)."""
        self._reaper.drop(work)


_END = object()


class _Failed(NamedTuple):
    error: BaseException


class _Receiver:
    """Takes works from a DataLoader iterator on a thread of its own and hands them over one at a time (``depth``
    waiting at most: each holds a batch's bytes in shared memory). Errors reach the caller as raised there. The
    thread ends when :meth:`stop` is called, when its stream is garbage, or at interpreter exit (``atexit``: a daemon
    thread still in C++ code at finalization aborts the process, see :class:`~gpupipe.plumbing.reaper.Reaper`). The
    thread of a receiver that became garbage is told to stop, and waited for at exit: it still lets go of the workers'
    buffers and of the DataLoader iteration (its workers joined), and a process that ended meanwhile aborted
    ("terminate called without an active exception") or left the iteration's semaphores behind."""

    _live: ClassVar[weakref.WeakSet[_Receiver]] = weakref.WeakSet()
    _orphans: ClassVar[list[threading.Thread]] = []  # the threads of receivers that became garbage, still running
    _exit_hook = False
    _exiting = False  # :meth:`_stop_all` has run

    def __init__(self, it: Iterator[Work], gate: Gate, cpu: list[float], began: Any, depth: int = 1):
        self._gate, self._pid = gate, os.getpid()
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(
            target=_receive, args=(it, self._queue, self._stop, cpu, began), daemon=True, name="gpupipe-dali-feed"
        )
        self._thread.start()
        weakref.finalize(self, _abandon, self._stop, gate, os.getpid(), self._thread)
        cls = type(self)
        cls._live.add(self)
        if not cls._exit_hook:
            cls._exit_hook = True
            atexit.register(cls._stop_all)

    def get(self) -> Work | None:
        if self._ended:
            return None
        item = self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, _Failed):
            self._ended = True
            raise item.error
        return item

    def stop(self, timeout: float | None = None) -> None:
        """End the thread: what it holds and what is waiting is dropped. Waits for a read in progress (a worker's
        answer), for at most ``timeout`` seconds."""
        _abandon(self._stop, self._gate, self._pid)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self._queue.get(timeout=0.05)  # room for a put it may be waiting on
            except queue.Empty:
                pass
        self._ended = True

    @classmethod
    def _stop_all(cls, timeout: float = 5.0) -> None:
        """At exit: every thread told to stop at once, then waited for, all of them within ``timeout`` seconds. A
        receiver that becomes garbage after this (a cycle collected as the interpreter ends) has its thread waited for
        by its finalizer."""
        cls._exiting = True
        live = list(cls._live)
        for receiver in live:
            _abandon(receiver._stop, receiver._gate, receiver._pid)
        deadline = time.monotonic() + timeout
        for receiver in live:
            receiver.stop(timeout=max(0.0, deadline - time.monotonic()))
        for thread in list(cls._orphans):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _abandon(stop: threading.Event, gate: Gate, pid: int, thread: threading.Thread | None = None) -> None:
    if os.getpid() != pid:  # a forked child's copy (at its exit): the gate is the parent's workers'
        return
    stop.set()
    gate.open()  # a worker waiting on it finishes its request, so the thread's next() returns
    if thread is None:
        return
    if not _Receiver._exiting:  # its receiver is garbage: the thread is waited for at exit
        _Receiver._orphans[:] = [t for t in _Receiver._orphans if t.is_alive()] + [thread]
    elif thread is not threading.current_thread():  # the exit hook has run: now, or not at all
        thread.join(timeout=5)


def _feed_worker_init(worker_id: int, nicer: bool, began: Any) -> None:
    """A feed worker's first step: :func:`worker_init`, then its pid in ``began`` (it has begun)."""
    worker_init(worker_id, nicer)
    began[worker_id] = os.getpid()


def _await_workers(it: Any, began: Any, stop: threading.Event) -> None:
    """Until every worker of the DataLoader iteration ``it`` has begun (or ended: the DataLoader reports why), for at
    most ``_START`` seconds: a worker stuck as it was forked (a lock another thread held at the fork, never released
    in the child) is killed, and the error names it. Only the start is bounded: a worker that has begun may wait at
    the gate for as long as its epoch takes to come."""
    deadline = time.monotonic() + _START
    while not stop.is_set():
        workers = list(getattr(it, "_workers", ()))  # private: torch lists no public handle of its workers
        stuck = [w for k, w in enumerate(workers) if began[k] != w.pid and w.is_alive()]
        if not stuck:
            return
        if time.monotonic() > deadline:
            if getattr(it, "_worker_pids_set", False):  # torch's SIGCHLD check would raise its own error for them
                torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
            for w in stuck:
                w.kill()
            pids = ", ".join(str(w.pid) for w in stuck)
            raise GpupipeError(
                f"dali's feed worker (pid {pids}) did not begin within {_START:.0f} s of its start: killed"
            )
        time.sleep(0.01)


def _receive(it: Iterator[Work], out: queue.Queue, stop: threading.Event, cpu: list[float], begun: Any) -> None:
    """The thread's loop, once the workers have begun; its CPU seconds (receiving and preparing each work, not
    waiting) are added to ``cpu[0]``."""
    try:
        _await_workers(it, begun, stop)
        began = time.thread_time()
        for work in it:
            work.prepare()
            cpu[0] += time.thread_time() - began
            if not put_unless_stopped(out, work, stop):
                return
            began = time.thread_time()
        put_unless_stopped(out, _END, stop)
    except BaseException as e:  # the caller's next get() raises it
        put_unless_stopped(out, _Failed(e), stop)
    finally:
        if stop.is_set():  # stopped (a new plan, or the stream dropped): the workers' buffers this process keeps
            let_go()  # mapped (handover.py) let go of, after the last one it received; mapped again if they come back


def _as_is(work: Work) -> Work:
    return work
