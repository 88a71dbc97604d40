"""Work made off the training thread, one batch ahead: one thread takes each item (a worker's batch), makes it (a
batched GPU decode, DALI's feed and fetch, a copy out of a worker's buffer) on a CUDA stream of its own and hands it
over with an event.

torchvision's nvJPEG decode runs its Huffman pass on the calling thread (bench/README.md: figures behind the code): on
the training thread, every batch cost the model's Python that much. Here the training thread only waits for the
event on its own stream (the GPU waits, the host does not) and takes the made batch. torch's ops release the GIL
while they run, so the decode thread and the training thread run side by side.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import torch

from .workers import put_unless_stopped

W = TypeVar("W")
R = TypeVar("R")


class _Failed(NamedTuple):
    error: BaseException


class _Done(NamedTuple):
    result: Any
    ready: torch.cuda.Event | None  # recorded on the decode thread's stream after the batch's GPU work


_END = object()


class Turn:
    """When a loader's thread may start its next item: not while the training thread is inside the loader's
    ``next()`` with a made item there to take. Both run Python in one interpreter, and a thread woken by the take
    (its queue has room again) would otherwise take the GIL in the middle of that ``next()`` and make the training
    thread wait for its whole item (bench/README.md, the CIFAR-10 run: several times the take's own CPU). Waiting for
    the training thread to leave, it makes the item during the step instead. When the training thread waits for an
    item (none made), the thread starts at once."""

    LOOK = 0.1  # seconds between a waiting thread's looks at its stop, where nothing told it

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._inside = False

    def enter(self) -> None:
        """The training thread enters the loader's ``next()``."""
        self._inside = True

    def leave(self) -> None:
        """The training thread leaves it (with a batch or an error)."""
        with self._changed:
            self._inside = False
            self._changed.notify_all()

    def wanted(self) -> None:
        """The training thread is about to wait for an item: a thread waiting for its turn starts now."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, made: queue.Queue, stop: threading.Event) -> None:
        """Wait while the training thread is inside ``next()`` and ``made`` holds an item for it (or until
        ``stop``)."""
        with self._changed:
            while self._inside and not made.empty() and not stop.is_set():
                self._changed.wait(self.LOOK)  # a stop at exit may not notify


class DecodeAhead(Generic[W, R]):
    """``decode(work)`` for each of ``works``, on a thread of its own (``name``), at most ``depth`` batches waiting:
    iterate it for the results, in order. On CUDA the thread's work goes to a stream of its own, and each result comes
    with an event that the training thread's current stream waits for (a GPU wait: the host goes on); the tensors a
    result holds (``tensors(result)``) are then recorded as used on that stream, so the caching allocator does not
    hand their memory to the decode thread while the training stream still reads it. Errors are raised to the
    iterating thread as raised in the decode thread. The thread's CPU seconds are added to ``cpu[0]`` as it goes
    (what it takes of the training process beside the training thread). :meth:`close` ends the thread (a pass left
    early); at interpreter exit every live one is ended (a daemon thread still in C++ code at finalization aborts the
    process, see :class:`~gpupipe.plumbing.reaper.Reaper`)."""

    # every thread started, with its stop and queue, until it is seen ended: one may outlive its DecodeAhead (a pass
    # dropped with its loader stops it, and it ends after its current batch), and the exit hook must still end it. A
    # thread is kept here past its loop, until it has ended: on its way out it drops what it was given, which may be
    # the last reference to a DALI pipeline, whose shutdown then runs on it (C++ code, at exit while finalizing)
    _running: ClassVar[dict[threading.Thread, tuple[threading.Event, queue.Queue]]] = {}
    _EMPTY = queue.Empty  # held by the class: :meth:`close` may run once the module's names are cleared

    def __init__(
        self,
        works: Iterator[W],
        decode: Callable[[W], R],
        device: torch.device,
        tensors: Callable[[R], list[torch.Tensor]],
        depth: int = 1,
        name: str = "gpupipe-decode",
        cpu: list[float] | None = None,
        turn: Turn | None = None,
    ):
        self.device, self._tensors = device, tensors
        self._turn = turn
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._ended = False  # :meth:`next` has seen the end of the works
        self.stream = _stream(device) if device.type == "cuda" else None
        spent = cpu if cpu is not None else [0.0]
        self._thread = threading.Thread(
            target=_run,
            args=(works, decode, self.stream, self._queue, self._stop, spent, turn),
            daemon=True,
            name=name,
        )
        cls = type(self)
        for ended in [t for t in cls._running if not t.is_alive()]:
            del cls._running[ended]
        cls._running[self._thread] = (self._stop, self._queue)
        self._thread.start()
        # registered again with each thread: hooks run last-registered first, so the threads end before the exit hooks
        # of what they use and was imported since (DALI's shuts its pipelines down)
        atexit.unregister(cls._close_all)
        atexit.register(cls._close_all)

    def __iter__(self) -> Iterator[R]:
        """The results in order; an iteration left early (a pass left early, closed or dropped) closes the thread."""
        try:
            while (result := self._result()) is not _END:
                yield result
        finally:
            self.close()  # what it made ahead is dropped

    def next(self) -> R | None:
        """The next result, or None once the works have ended. Unlike iterating, taking results one by one never
        closes the thread: it goes on making the next ones (a pass left early leaves them to the loader, see
        :class:`~gpupipe.plumbing.carry.Carry`) until :meth:`close`."""
        if self._ended:
            return None
        result = self._result()
        if result is _END:
            self._ended = True
            return None
        return result

    def _result(self) -> Any:
        """The next result, ready for the current stream (which waits for its event on the GPU), or ``_END``: the
        thread has then put its last item, and is waited for as it ends (what it drops on its way out, such as a DALI
        pipeline's last reference, is dropped there), so no thread of a finished pass outlives it."""
        item = self._next()
        if item is _END:
            self._thread.join(timeout=10)
            return _END
        if isinstance(item, _Failed):
            raise item.error
        if item.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.ready)
            for t in self._tensors(item.result):
                t.record_stream(current)
        return item.result

    def _next(self) -> Any:
        """The next item the thread put; an error if it ended without one (told to stop: iterated after close)."""
        if self._turn is not None and self._queue.empty():
            self._turn.wanted()  # nothing made: the thread must not wait for this thread to leave next()
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the decode thread was stopped before the end of its pass") from None

    def __del__(self) -> None:
        if hasattr(self, "_queue"):
            self.close()  # dropped without its pass closed (a cycle): the thread still stops

    def close(self) -> None:
        """Tell the thread to stop (it does once its current batch is done); what it holds is dropped. Reads no name
        of this module: it may run at interpreter exit, from ``__del__``, once the module's names are cleared."""
        self._stop.set()
        if self._turn is not None:
            try:
                self._turn.wanted()  # a thread waiting for its turn sees the stop now
            except Exception:  # at exit, with threading's names cleared: it sees it at its next look
                pass
        out, empty = self._queue, self._EMPTY
        while not out.empty():  # (``get_nowait`` on an empty queue raises a name of ``queue``, cleared at exit too)
            try:
                out.get_nowait()  # room for a put the thread may be waiting on
            except empty:
                return

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after :meth:`close`): its iterator is free for another pass. Whether it ended
        (it may not within ``timeout``: its current batch waits on a worker)."""
        self.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @classmethod
    def _close_all(cls, timeout: float = 5) -> None:
        """Every running thread told to stop, then each waited for, ``timeout`` seconds in all."""
        running = [(thread, ends) for thread, ends in list(cls._running.items()) if thread.is_alive()]
        for _, (stop, out) in running:
            _stop(stop, out)
        deadline = time.monotonic() + timeout
        for thread, _ in running:
            thread.join(max(0.0, deadline - time.monotonic()))


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The decode threads' one stream on ``device``, for the process's life: the caching allocator reuses a block only
    on the stream it was made on, so a stream per pass would strand each pass's batches' memory."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _stop(stop: threading.Event, out: queue.Queue) -> None:
    stop.set()
    with contextlib.suppress(queue.Empty):
        while True:
            out.get_nowait()  # room for a put the thread may be waiting on


def _run(
    works: Iterator,
    decode: Callable,
    stream: torch.cuda.Stream | None,
    out: queue.Queue,
    stop: threading.Event,
    spent: list[float],
    turn: Turn | None,
) -> None:
    clock = time.thread_time()
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # told to stop, the thread takes no further work; one it took is decoded (taking may have moved state
            # that only its decode settles, such as a batch scheduled in DALI and not yet fetched)
            while not stop.is_set():
                if turn is not None:
                    turn.wait(out, stop)
                work = next(works, _END)
                if work is _END:
                    break
                result = decode(work)
                ready = None
                if stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                now = time.thread_time()
                spent[0] += now - clock
                clock = now
                if not put_unless_stopped(out, _Done(result, ready), stop):
                    return
            else:
                return  # told to stop
        put_unless_stopped(out, _END, stop)
    except BaseException as e:  # the iterating thread's next() raises it
        put_unless_stopped(out, _Failed(e), stop)
