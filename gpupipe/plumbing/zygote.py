"""A fork server of gpupipe's own (a "zygote"): a process forked from the training process while no DALI pipeline runs
in it, which then forks the worker processes a loader asks for. A process forked beside DALI's threads may inherit a
lock one of them holds at that moment, never released in the child (about 1 fork in 600 hung in
``PyOS_AfterFork_Child``); a fork of the zygote cannot, as no DALI thread ever ran in it.

Python's own ``forkserver`` and ``spawn`` start a fresh interpreter that imports the program's ``__main__`` again: a
script without an ``if __name__ == "__main__"`` guard would run its loop once more in every worker. The zygote is a
fork, so ``__main__`` and the classes defined there are already in it, and nothing is imported again. What a worker
receives is pickled as for ``forkserver`` (multiprocessing's queues, events, shared values), except the objects the
zygote was given to hold when it was made (a loader's dataset): those it already has, and a worker finds them by
reference, sharing their pages as a plain fork would.

The zygote ends with the training process (it watches its parent and the socket to it) and with the last
:class:`Zygote` object that refers to it; its workers end with it (each watches its parent,
:func:`.workers.leave_with_parent`). It makes nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import select
import signal
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterable
from multiprocessing import context as mp_context
from multiprocessing import popen_fork, process, reduction, util
from typing import Any, ClassVar

from ..errors import GpupipeError

_ANSWER = 60.0  # seconds the zygote may take to fork a worker and a worker to read what it was sent
_SIGNED = struct.Struct("q")

# in a worker forked by a zygote: the file descriptors it was sent, in the order its parent listed them
_inherited_fds: list[int] = []


class Zygote:
    """A fork server made now, in this process, holding ``hold`` (objects its workers take by reference). Its
    :attr:`context` is a multiprocessing context: a DataLoader's ``multiprocessing_context``, a process pool's
    ``mp_context``."""

    _live: ClassVar[weakref.WeakSet[Zygote]] = weakref.WeakSet()
    _made = 0  # zygotes made in this process: the newest is the last one still alive

    def __init__(self, hold: Iterable[object] = ()):
        self._held = {id(obj): obj for obj in hold}  # kept alive here: an id is never another object's
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 1
            try:
                ours.close()
                _serve(theirs, self._held)
                code = 0
            finally:
                os._exit(code)  # never the training process's exit handlers
        theirs.close()
        self.pid = pid
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time on the socket
        self.context = _Context(self)
        Zygote._made += 1
        self.order = Zygote._made
        Zygote._live.add(self)
        weakref.finalize(self, _end, ours, pid, os.getpid())

    @classmethod
    def newest(cls) -> Zygote | None:
        """The last zygote made in this process that is still in use, if any."""
        return max(list(cls._live), key=lambda z: z.order, default=None)

    def sendable(self, obj: object) -> bool:
        """Whether ``obj`` can be sent to this zygote's workers (pickled, but for what it holds); tried once, its
        bytes counted, not kept."""
        sink = _Counter()
        popen = _Trial()
        mp_context.set_spawning_popen(popen)  # type: ignore[arg-type]  # any popen with its two names
        try:
            _Pickler(sink, self._held).dump(obj)
        except Exception:
            return False
        finally:
            mp_context.set_spawning_popen(None)
        return True

    def connect(self, fds: list[int]) -> tuple[int, int]:
        """A new worker: (the pipe its status comes on, the pipe its process object goes down)."""
        if os.getpid() != self.context.owner:
            raise GpupipeError(f"the worker fork server (pid {self.pid}) belongs to process {self.context.owner}")
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            with self._lock:
                reduction.sendfds(self._sock, [child_r, child_w, *fds])
        except OSError as e:
            os.close(parent_r)
            os.close(parent_w)
            raise GpupipeError(f"the worker fork server (pid {self.pid}) is gone: {e}") from None
        finally:
            os.close(child_r)
            os.close(child_w)
        return parent_r, parent_w


def _end(sock: socket.socket, pid: int, owner: int) -> None:
    """The zygote's last owner is gone: its socket closes (it exits at once) and it is reaped, killed if it has not
    exited within a second."""
    sock.close()
    if os.getpid() != owner:  # a forked child's copy: the zygote is not its child
        return
    deadline = time.monotonic() + 1.0
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.005)


def _forget_inherited() -> None:
    """In any process forked from one that owns zygotes: they are not its own (:meth:`Zygote.connect` refuses), and
    its copy of their sockets is closed, so a zygote sees its owner's death even while such a child lives."""
    for zygote in list(Zygote._live):
        zygote._sock.close()
    Zygote._live = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_inherited)


def _serve(sock: socket.socket, held: dict[int, Any]) -> None:
    """The zygote's loop: a request (a worker's fds) is forked at once; a worker's exit is written to its status pipe
    (its pid first, then its exit code, as multiprocessing's forkserver does). Ends when the training process does
    or lets go of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    gc.freeze()  # nothing inherited is ever collected here, nor in a worker (see ``start_workers``)
    parent = os.getppid()
    status: dict[int, int] = {}  # worker pid -> its status pipe
    exits: dict[int, int] = {}  # a worker's pidfd -> its pid
    while os.getppid() == parent:
        ready, _, _ = select.select([sock.fileno(), *exits], [], [], 0.5)
        for fd in ready:
            if fd != sock.fileno():
                _reap(exits.pop(fd), status)
                os.close(fd)
        if sock.fileno() in ready:
            try:
                fds = reduction.recvfds(sock, 255)
            except (EOFError, OSError):
                return  # the training process let go of it
            _fork_one(sock, fds, held, status, exits)
        for pid in [p for p in status if p not in exits.values()]:
            _reap(pid, status, block=False)


def _fork_one(sock: socket.socket, fds: list[int], held: dict[int, Any], status: dict[int, int], exits: dict[int, int]):
    """One worker forked, for a request's ``fds`` (its process object's pipe, its status pipe, what it was sent)."""
    child_r, child_w, *sent = fds
    pid = os.fork()
    if pid == 0:
        sock.close()
        for fd in [*status.values(), *exits, child_w]:
            os.close(fd)
        os._exit(_worker(child_r, sent, held))
    os.close(child_r)
    for fd in sent:
        os.close(fd)
    status[pid] = child_w
    os.write(child_w, _SIGNED.pack(pid))
    try:
        exits[os.pidfd_open(pid)] = pid
    except OSError:  # no pidfd (an old kernel): reaped on the next wake-up
        pass


def _reap(pid: int, status: dict[int, int], block: bool = True) -> None:
    done, code = os.waitpid(pid, 0 if block else os.WNOHANG)
    if not done:
        return
    fd = status.pop(pid)
    with contextlib.suppress(OSError):
        os.write(fd, _SIGNED.pack(os.waitstatus_to_exitcode(code)))
    os.close(fd)


def _worker(child_r: int, fds: list[int], held: dict[int, Any]) -> int:
    """A worker's life: its process object read (the zygote's held objects by reference), then run."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a forked worker has it
    _inherited_fds[:] = fds
    with open(child_r, "rb", closefd=False) as f:
        process_obj = _Unpickler(f, held).load()
    return process_obj._bootstrap(parent_sentinel=child_r)


class _Pickler(reduction.ForkingPickler):
    def __init__(self, file, held: dict[int, Any]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._held = held

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if id(obj) in self._held and self._held[id(obj)] is obj else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, held: dict[int, Any]):
        super().__init__(file)
        self._held = held

    def persistent_load(self, key: Any) -> Any:
        return self._held[key]


class _DupFd:
    """A file descriptor sent with a worker's request, found in the worker by its position."""

    def __init__(self, index: int):
        self.index = index

    def detach(self) -> int:
        return _inherited_fds[self.index]


class _Popen(popen_fork.Popen):
    """A worker started by a zygote: multiprocessing's forkserver ``Popen``, with no ``__main__`` to prepare (the
    zygote has it) and a bound on every wait for the zygote's answer."""

    method = "forkserver"
    DupFd = _DupFd

    def __init__(self, process_obj):
        self._fds: list[int] = []
        self.zygote = _zygote_of.pop(process_obj)
        super().__init__(process_obj)

    def duplicate_for_child(self, fd: int) -> int:
        self._fds.append(fd)
        return len(self._fds) - 1

    def _launch(self, process_obj) -> None:
        zygote = self.zygote()
        if zygote is None:
            raise GpupipeError("the worker fork server was let go of")
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)  # type: ignore[arg-type]
        try:
            _Pickler(buf, zygote._held).dump(process_obj)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = zygote.connect(self._fds)
        parent_w = os.dup(w)  # the worker's sentinel of its parent (``parent_process()``), as forkserver keeps it
        close = util.close_fds  # type: ignore[attr-defined]  # not in typeshed
        self.finalizer = util.Finalize(self, close, (parent_w, self.sentinel))
        self.pid = _read_signed(self.sentinel, f"the worker fork server (pid {zygote.pid}) did not fork")
        try:
            _write_all(w, buf.getbuffer(), f"worker {self.pid} (forked by pid {zygote.pid}) did not start")
        finally:
            os.close(w)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            from multiprocessing.connection import wait

            if not wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            try:
                self.returncode = _read_signed(self.sentinel, "")
            except (OSError, EOFError, GpupipeError):  # the zygote itself is gone
                self.returncode = 255
        return self.returncode


def _read_signed(fd: int, what: str) -> int:
    data = b""
    deadline = time.monotonic() + _ANSWER
    while len(data) < _SIGNED.size:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise GpupipeError(f"{what} in {_ANSWER:.0f} s")
        chunk = os.read(fd, _SIGNED.size - len(data))
        if not chunk:
            raise EOFError("the worker fork server closed the pipe")
        data += chunk
    return _SIGNED.unpack(data)[0]


def _write_all(fd: int, data: memoryview, what: str) -> None:
    """``data`` down a pipe the worker reads, waiting at most ``_ANSWER`` seconds for room."""
    os.set_blocking(fd, False)
    deadline = time.monotonic() + _ANSWER
    while len(data):
        if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
            raise GpupipeError(f"{what} in {_ANSWER:.0f} s")
        data = data[os.write(fd, data) :]


class _Counter(io.RawIOBase):
    """A file that keeps nothing (:meth:`Zygote.sendable`)."""

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return len(memoryview(b))


class _Trial:
    """The spawning popen while a trial pickle runs: file descriptors are counted, not sent."""

    DupFd = _DupFd

    def duplicate_for_child(self, fd: int) -> int:
        return 0


class _Context(mp_context.BaseContext):
    """The zygote's multiprocessing context: its ``Process`` is started by the zygote; its locks, queues and shared
    values are forkserver's (named, so a worker that is no fork of their maker's opens them)."""

    _name = "forkserver"

    def __init__(self, zygote: Zygote):
        self.owner = os.getpid()
        self._zygote = weakref.ref(zygote)  # the zygote ends with its owner, not with this context

    def Process(self, *args, **kwargs) -> ZygoteProcess:  # multiprocessing's name
        started = ZygoteProcess(*args, **kwargs)
        _zygote_of[started] = self._zygote
        return started


class ZygoteProcess(process.BaseProcess):
    """A process a zygote forks (the class is pickled with it: a module-level one)."""

    _Popen = _Popen
    _start_method = None  # a worker's own default start method stays the one it inherited


# each process made by a zygote's context, until it is started: the zygote that starts it
_zygote_of: weakref.WeakKeyDictionary[process.BaseProcess, weakref.ref[Zygote]] = weakref.WeakKeyDictionary()
