"""DALI reads local files itself: for a folder or a file list, the loader hands the pipeline, per batch, only the
batch's rows of a path table (each path's bytes, then NULs) and the recipe's crop rows, and ``fn.io.file.read``
reads the files in DALI's own threads. No feed process, no receiving thread, no copy of the bytes in Python.

What the feed judges from each file's bytes (:mod:`.gpu_feed`: its upright size, whether only Pillow decodes it, why
it cannot be decoded) is judged from its header, in worker processes that run a few batches ahead of the stream the
first time a sample comes (:class:`Scanner`: nothing is read up front); the verdicts are kept in the path table
(:class:`FileTable`) with each file's stamp (size, modification time, inode). Each pass checks every verdict it uses
against its file once, a batch's files ``stat``-ed in one call without the GIL (gpupipe/_stamps.c; where it was not
built, in those processes): a file that changed since (rewritten, replaced, made unreadable, mended) is judged again
there, so a pass crops, refuses or skips each file as it is when the pass runs, as the CPU backends do. The
scan opens each file non-blocking and checks that it is a regular file before any path goes to DALI (a fifo would
block its reader for ever, ``/dev/zero`` never end). A sample the scan found bad is reported as the feed reports it;
one only Pillow decodes is decoded by Pillow on the training thread (rare: CMYK, 16-bit, formats DALI lacks). A file
that changes after its check is caught as the feed catches it: a batch DALI fails on is narrowed by Pillow reading the
file as it is then (:meth:`DaliLoader._recover`), and the next epoch's first batches, made before their pass begins,
are stamped and made again when their files changed (:meth:`FileStream.reread`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import stat
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as AnswerTimeout  # not the builtin one before Python 3.11
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .._files import file_stamp, read_regular
from .._names import escape
from .._pool import begin_worker
from ..errors import DecodeError
from ..image import HeaderCheck, ends_whole, header_entry, is_jpeg, jpeg_header_sound
from ..plumbing.zygote import Zygote
from ..recipe import Recipe
from ..sources.compact import PathList
from ._fork import pipelines_running
from .dali_feed import Gate, Request
from .gpu_feed import Work, decode_on_cpu, eval_windows
from .pillow import PillowDecoder

try:
    from .. import _stamps  # built with the package where a C compiler was (setup.py)
except ImportError:
    _stamps = None

# a sample's verdict: not judged yet; DALI reads and decodes it; Pillow decodes it; it is reported
_UNKNOWN, _DALI, _PILLOW, _BAD = -1, 0, 1, 2
_CHUNK = 8  # batches whose crops are drawn in one call
_GROUP = 4  # judged batches of one epoch whose files a pass's check asks the scan about in one message
_HEAD, _TAIL = 256 << 10, 4096  # bytes the scan reads: a header's, and the tail that holds a JPEG's end marker
_ANSWER = 60.0  # seconds a header-scan worker may take over a batch's headers before it is taken for stuck
# a stat slower than this a file (a local one takes a few microseconds), in this many calls in a row: the per-pass
# checks go back to the header scan's processes, off the thread that feeds DALI
_SLOW_STAT_S, _SLOW_CALLS = 100e-6, 3
log = logging.getLogger("gpupipe")


class Verdict(NamedTuple):
    kind: int
    height: int = 0
    width: int = 0
    problem: str | None = None
    stamp: int = 0  # the file as it was judged (:func:`stamp_key`)


_UNJUDGED = -1  # the stamp of a sample not judged yet: no file's


def stamp_key(path: str) -> int:
    """A file's stamp (:class:`.._files.Stamp`: device, inode, size, modification and change times) as one number,
    stat-ed now; 0 when it cannot be (gone), never :data:`_UNJUDGED`. A verdict holds it: a file whose stamp moved
    since is judged again. The fields are mixed as gpupipe/_stamps.c mixes them, which stamps a batch's files in one
    call (:meth:`FileTable.check_stamps`)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # (a path with a NUL in it names no file)
        return 0
    h = 0x9E3779B97F4A7C15
    for v in (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        h = _mix(h, v)
    key = h - (1 << 64) if h >> 63 else h  # as C's int64
    return 1 if key in (0, _UNJUDGED) else key


_MASK = (1 << 64) - 1


def _mix(h: int, v: int) -> int:
    """``v`` xor-ed into ``h`` and spread by splitmix64's finaliser, in 64-bit unsigned arithmetic."""
    h ^= v & _MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def _read_ends(path: str) -> tuple[bytes, bytes]:
    """(head, tail) of a regular file, opened non-blocking and checked before it is read (as ``read_regular``): the
    whole file as both when it is small."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            read_regular(path)  # raises the one-line OSError naming what it is
        if st.st_size <= _HEAD + _TAIL:
            data = os.read(fd, st.st_size + 1)
            return data, data
        return os.pread(fd, _HEAD, 0), os.pread(fd, _TAIL, st.st_size - _TAIL)
    finally:
        os.close(fd)


def judge_file(path: str, max_pixels: int) -> Verdict:
    """What the feed decides from a sample's bytes (:meth:`.gpu_feed.Feed._sample`), from its head and tail, and the
    file's stamp, taken before it is read (a change while it is read moves it: judged again next time)."""
    stamp = stamp_key(path)
    try:
        head, tail = _read_ends(path)
        entry = header_entry(head, max_pixels)
        if entry.problem is not None and head is not tail:  # maybe a header longer than the head: the whole file
            entry = header_entry(read_regular(path), max_pixels)
    except OSError as e:
        return Verdict(_BAD, problem=f"cannot read the file ({e.strerror or e})", stamp=stamp)
    return _verdict(path, entry, head, tail, max_pixels)._replace(stamp=stamp)


def dali_decodes(source: str | bytes, max_pixels: int) -> bool:
    """Whether the dali backend hands this file (or these bytes) to DALI (:func:`judge_file`): DALI's own pipeline
    and its decode, timed beside it by ``gpupipe bench``, take the same ones."""
    if isinstance(source, bytes):
        return _verdict("", header_entry(source, max_pixels), source, source, max_pixels, whole=source).kind == _DALI
    return judge_file(source, max_pixels).kind == _DALI


def _verdict(
    path: str, entry: HeaderCheck, head: bytes, tail: bytes, max_pixels: int, whole: bytes | None = None
) -> Verdict:
    if entry.problem is not None:
        return Verdict(_BAD, problem=entry.problem)
    if entry.pillow_only or not jpeg_header_sound(head):  # (a damaged header: DALI would print it before it fails)
        return Verdict(_PILLOW, entry.height, entry.width)
    if is_jpeg(head) and not ends_whole(tail):
        try:  # DALI decodes only the crop's rows, so it may never reach a truncation; Pillow decides
            PillowDecoder(max_pixels).decode(read_regular(path) if whole is None else whole, path)
        except (DecodeError, OSError) as e:
            reason = e.reason if isinstance(e, DecodeError) else f"cannot read the file ({e.strerror or e})"
            return Verdict(_BAD, problem=reason)
    return Verdict(_DALI, entry.height, entry.width)


class Verdicts(NamedTuple):
    """Several samples' verdicts as arrays: what a scan worker sends back (a few hundred bytes a batch to unpickle)."""

    kind: np.ndarray  # int8
    sizes: np.ndarray  # int64 (n, 2): upright height, width
    problems: dict[int, str]  # position -> why it is reported
    stamps: np.ndarray  # int64: each file as it was judged

    @classmethod
    def of(cls, verdicts: list[Verdict]) -> Verdicts:
        kind = np.fromiter((v.kind for v in verdicts), np.int8, len(verdicts))
        sizes = np.array([(v.height, v.width) for v in verdicts], np.int64).reshape(-1, 2)
        stamps = np.fromiter((v.stamp for v in verdicts), np.int64, len(verdicts))
        return cls(kind, sizes, {k: v.problem for k, v in enumerate(verdicts) if v.problem is not None}, stamps)


_scanned = None  # the samples a scan worker judges: the table's, inherited when the pool forks (no pickling)


def _scan_init(samples) -> None:
    global _scanned
    _scanned = samples


def _judge_many(indices: np.ndarray, stamps: np.ndarray, max_pixels: int) -> tuple[np.ndarray, Verdicts]:
    """In a scan worker: the samples of ``indices`` (judged with ``stamps``) whose stamp moved, and their verdicts."""
    assert _scanned is not None  # set by the pool's initializer
    return judge_moved([_scanned[i][0] for i in indices.tolist()], stamps, max_pixels)


def judge_moved(paths: list[str], stamps: np.ndarray, max_pixels: int) -> tuple[np.ndarray, Verdicts]:
    """The positions of ``paths`` whose file's stamp is no longer the one in ``stamps`` (one of :data:`_UNJUDGED`
    never is), and their new verdicts: a file that did not change costs a ``stat``."""
    moved = [k for k, (path, stamp) in enumerate(zip(paths, stamps.tolist(), strict=True)) if stamp_key(path) != stamp]
    return np.asarray(moved, np.int64), Verdicts.of([judge_file(paths[k], max_pixels) for k in moved])


class Scanner:
    """Judges the samples a batch needs, not yet judged or whose files changed since they were (their stamps are
    checked once a pass, :meth:`FileTable.unchecked`), in ``workers`` processes (none: on the caller's thread when the
    batch is made). The pool starts with the first batch that needs it and lives as long as the loader's stream: a
    file that did not change costs the caller's thread a ``stat`` a pass without the GIL, and no message
    (:meth:`FileTable.check_stamps`; where gpupipe/_stamps.c was not built, the worker's, a message a few batches).
    Its processes are forked by ``zygote`` (:mod:`~gpupipe.plumbing.zygote`, where no DALI thread ever ran) when
    there is one, else from this process only while no DALI pipeline runs in it (:func:`._fork.pipelines_running`: a
    fork beside DALI's threads may inherit a lock one of them holds); without a zygote, what is judged once a pipeline
    runs (another loader's, or this one's after its pool was lost) is judged on the caller's thread."""

    _live: ClassVar[weakref.WeakSet[Scanner]] = weakref.WeakSet()  # for :meth:`_close_all_at_exit`

    def __init__(self, table: FileTable, workers: int, zygote: Zygote | None = None):
        self.table, self.workers, self.zygote = table, workers, zygote
        self._pool: ProcessPoolExecutor | None = None
        Scanner._live.add(self)

    @classmethod
    def _close_all_at_exit(cls) -> None:
        """At interpreter exit, every live loader's pool ends while the modules it reads are whole: left to the
        interpreter's teardown, its executor was collected with ``multiprocessing``'s names cleared ("Exception
        ignored in ... weakref_cb ... 'NoneType' object has no attribute 'util'")."""
        for scanner in list(cls._live):
            scanner.close(wait=0)

    def ask(self, index: np.ndarray) -> Asked | None:
        """Start judging the samples of ``index`` not checked in this pass (a ``stat`` each; judged if not judged yet
        or changed)."""
        todo = self.table.check_stamps(index[self.table.unchecked(index)])
        if not len(todo) or self.workers < 1:
            return None
        if self._pool is None:
            samples = self.table.dataset.samples
            context: Any = multiprocessing.get_context("fork")
            if self.zygote is not None and self.zygote.sendable(samples):
                context = self.zygote.context
            elif pipelines_running():
                return None
            # begun as every pool's worker: it ends with its parent, and leaves Ctrl-C to it (a zygote's worker has
            # Python's handler back: each printed a KeyboardInterrupt traceback beside the training process's)
            self._pool = ProcessPoolExecutor(self.workers, context, begin_worker, (_scan_init, samples))
        gc.freeze()  # a worker forked here never collects this process's garbage (see ``start_workers``)
        try:
            stamps = self.table.stamps[todo]
            return Asked(todo, self.table.passes, self._pool.submit(_judge_many, todo, stamps, self.table.max_pixels))
        except BrokenProcessPool:  # a worker died since the last batch: this one is judged when it is made
            self.close()
            return None
        finally:
            gc.unfreeze()

    def settle(self, asked: Asked | None, index: np.ndarray) -> None:
        """Every sample of ``index`` judged and checked in this pass: the workers' verdicts kept, what no worker was
        asked checked here (also what a worker left unanswered for ``_ANSWER`` seconds: it is taken for stuck and
        killed)."""
        if asked is not None:
            self.take(asked)
        todo = index[self.table.unchecked(index)]
        if len(todo):
            self.table.recheck(todo)

    def take(self, asked: Asked) -> None:
        """The workers' verdicts on ``asked`` kept (waited for, once: batches asked about together share it); none if
        its worker died or was stuck."""
        if asked.taken:
            return
        asked.taken = True
        try:
            moved, verdicts = asked.verdicts.result(timeout=_ANSWER)
            self.table.set(asked.indices[moved], verdicts)
            self.table.checked[asked.indices] = asked.passes
        except (BrokenProcessPool, CancelledError):  # a worker died (killed, out of memory): judged here
            self.close()
        except AnswerTimeout:
            first = self.table.dataset.samples[int(asked.indices[0])][0]
            log.warning(
                "a header-scan worker did not answer in %d s (samples from %s): killed, its samples judged on "
                "the loader's thread",
                _ANSWER,
                escape(first),
            )
            self.close(wait=0)

    def close(self, wait: float | None = None) -> None:
        """End the pool, once what it was asked is done (batches asked ahead keep their verdicts); a worker still at
        work ``wait`` seconds on (``_ANSWER`` unless given) is killed (stuck: nothing waits on it for ever)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((pool._processes or {}).values())  # private: no public list of its processes
        pool.shutdown(wait=False)
        deadline = time.monotonic() + (_ANSWER if wait is None else wait)
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
        pool.shutdown(wait=True)  # its manager thread, once its workers have ended


@dataclass
class Asked:
    indices: np.ndarray
    passes: int  # the pass they were asked in
    verdicts: Future  # of (the positions whose files changed, their verdicts)
    taken: bool = False  # its verdicts are in the table


class FileTable:
    """Every sample's path in one byte buffer (a folder's or a file list's own, :class:`PathList`, where it has one:
    nothing is copied) with its start and length, and its verdict once judged: what a batch hands DALI is a few rows
    of arrays, taken with one index each."""

    def __init__(self, dataset, max_pixels: int):
        self.dataset, self.max_pixels = dataset, max_pixels
        samples = dataset.samples
        if isinstance(samples, PathList):
            self._bytes, self.starts, self.lengths = samples.path_bytes()
        else:
            names = [os.fsencode(p) for p, _ in samples]
            self.lengths = np.fromiter(map(len, names), np.int64, len(names))
            self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
            self._bytes = np.frombuffer(b"".join(names) or b"\0", np.uint8)
        self.width = int(self.lengths.max(initial=0)) + 1  # every batch's path rows: the longest path and a NUL
        self._columns = np.arange(self.width)
        self.targets = np.asarray(dataset.targets, dtype=np.int64)
        self.kind = np.full(len(samples), _UNKNOWN, np.int8)
        self.sizes = np.zeros((len(samples), 2), np.int64)
        self.problems: dict[int, str] = {}
        self.stamps = np.full(len(samples), _UNJUDGED, np.int64)  # each verdict's file as it was judged
        # passes begun so far, and the last pass in which each sample's stamp was checked: every file is taken as it
        # is when its pass runs (a verdict from an earlier pass is checked against its file once in each)
        self.passes = 0
        self.checked = np.full(len(samples), -1, np.int64)
        self.stat_here = _stamps is not None  # :meth:`check_stamps` stats files on the caller's thread
        self._slow = 0  # its calls in a row that took over _SLOW_STAT_S a file

    def paths(self, chosen: np.ndarray) -> np.ndarray:
        """The paths of samples ``chosen`` as (n, W) uint8 rows, each a path's bytes, then NULs: one gather for the
        batch, fed to DALI as one array. Its file reader takes each row as a C string (a path holds no NUL), so no
        operator in DALI's chain cuts the rows to their lengths: one that did (a slice) was one more CPU operator per
        batch, which DALI's threads waited on (bench/README.md, "dali with every core")."""
        rows = self._bytes.take(self.starts[chosen, None] + self._columns, mode="clip")  # past the buffer: masked
        rows[self._columns >= self.lengths[chosen, None]] = 0
        return rows

    def unchecked(self, index: np.ndarray) -> np.ndarray:
        """Which samples of ``index`` have no verdict yet, or one not checked against its file in this pass."""
        return self.checked[index] < self.passes

    def check_stamps(self, todo: np.ndarray) -> np.ndarray:
        """The judged samples of ``todo`` whose files did not change, checked for this pass here, in one call without
        the GIL (gpupipe/_stamps.c); the rest of ``todo``, to be judged. Where it was not built, or where ``stat`` is
        slow (a network file system: :data:`_SLOW_STAT_S` a file, :data:`_SLOW_CALLS` calls in a row, which would
        hold up the thread that feeds DALI), nothing is: the header scan's processes check them."""
        judged = self.kind[todo] != _UNKNOWN
        if not self.stat_here or not judged.any():
            return todo
        known = todo[judged]
        now = np.empty(len(known), np.int64)
        began = time.perf_counter()
        assert _stamps is not None  # (stat_here)
        _stamps.stamps(self._bytes, self.starts, self.lengths, known, now)
        took = time.perf_counter() - began
        self._slow = self._slow + 1 if took > _SLOW_STAT_S * len(known) else 0
        if self._slow == _SLOW_CALLS:
            self.stat_here = False
            log.info(
                "dali: a file's stat takes %.0f us here (a network file system?): each pass's checks go to the header "
                "scan's processes from now on",
                took / len(known) * 1e6,
            )
        same = now == self.stamps[known]
        self.checked[known[same]] = self.passes
        judged[judged] = same
        return todo[~judged]

    def set(self, indices: np.ndarray, verdicts: Verdicts) -> None:
        self.kind[indices], self.sizes[indices], self.stamps[indices] = verdicts.kind, verdicts.sizes, verdicts.stamps
        for i in indices.tolist() if self.problems else ():  # a verdict replaces the problem it had, if any
            self.problems.pop(i, None)
        self.problems.update({int(indices[k]): problem for k, problem in verdicts.problems.items()})

    def recheck(self, chosen: np.ndarray) -> None:
        """Judge these samples if not judged yet or if their files changed since (a ``stat`` each), here."""
        paths = [self.dataset.samples[i][0] for i in chosen.tolist()]
        moved, verdicts = judge_moved(paths, self.stamps[chosen], self.max_pixels)
        self.set(chosen[moved], verdicts)
        self.checked[chosen] = self.passes


class FileStream:
    """The works of one plan (:func:`.dali_stream.plan`), made on the caller's thread when asked: the same interface
    as :class:`.dali_stream.FeedStream`, with nothing to read but the tables."""

    def __init__(
        self, table: FileTable, recipe: Recipe, train: bool, seed: int, workers: int, zygote: Zygote | None = None
    ):
        self.table, self.recipe, self.train, self.seed = table, recipe, train, seed
        self.check = PillowDecoder(table.max_pixels)
        self.gate = Gate()  # the plan's; nothing here waits on it
        self.scanner = Scanner(table, workers, zygote)
        # batches taken from the plan ahead: their samples judged, their crops drawn together
        self._depth = max(_CHUNK, workers)
        self._requests: Iterator[Request] = iter(())
        self._ahead: deque[tuple[Request, np.ndarray, Asked | None]] = deque()
        self._boxes: dict[tuple[int, int], np.ndarray] = {}  # (epoch, number) -> its DALI samples' crop boxes
        self._asked_before = False  # a pass began since the batches ahead were asked about

    def restart(self, requests: Iterable[Request]) -> None:
        """A new plan, for a pass that begins: its files checked as they come (:meth:`FileTable.unchecked`)."""
        self.table.passes += 1
        self._requests, self._ahead, self._boxes = iter(requests), deque(), {}

    def stop(self) -> None:
        """The plan ends (a pass an error ended), and the header scan's processes with it; :meth:`restart` begins
        another."""
        self._requests, self._ahead, self._boxes = iter(()), deque(), {}
        self.scanner.close()

    def consuming(self, epoch: int) -> None:
        """The pass of ``epoch`` begins, on the plan already running: the samples of its batches not made yet are
        checked against their files as they come (one mended after an error is read by this pass)."""
        self.table.passes += 1
        self.gate.set(epoch)
        self._asked_before = True  # asked again by the next ``next()``: not on the way to the pass's first batch

    def _ask_again(self) -> None:
        """The batches taken from the plan ahead, asked about in the pass before: asked again, so that their files are
        checked in this pass (:meth:`Scanner.ask`), not on the loader's thread one by one as each batch is made. What an
        earlier ask answered already is kept first (a sample's first verdict); one still at work is left to run,
        unheeded where the new ask covers its samples or none of them is left to check (it would set them back to
        the pass before)."""
        self._asked_before = False
        for _, _, asked in self._ahead:
            if asked is not None and asked.verdicts.done():
                self.scanner.take(asked)
        again = self._asks([(request, index) for request, index, _ in self._ahead])
        self._ahead = deque(
            (request, index, new or (asked if self._still_asked(asked, index) else None))
            for (request, index, asked), new in zip(self._ahead, again, strict=True)
        )

    def _still_asked(self, asked: Asked | None, index: np.ndarray) -> bool:
        """Whether an ask of the pass before is still to be waited on for ``index``: at work, with samples of it left
        to check in this pass."""
        return asked is not None and not asked.taken and bool(self.table.unchecked(index).any())

    def _asks(self, taken: list[tuple[Request, np.ndarray]]) -> list[Asked | None]:
        """The scan asked about the batches ``taken``: one message for each run of up to ``_GROUP`` batches of an
        epoch whose samples were all judged before (a ``stat`` each: a message a batch cost the loader's thread more
        than the checks cost the scan); one for each batch with samples to judge, so that the scan's processes judge
        them side by side and the first batches come soon."""
        asks: list[Asked | None] = []
        run: list[np.ndarray] = []

        def ask_run() -> None:
            if run:
                asks.extend([self.scanner.ask(np.concatenate(run))] * len(run))
                run.clear()

        epoch = None
        for request, index in taken:
            if len(run) == _GROUP or request.epoch != epoch:
                ask_run()
            epoch = request.epoch
            if (self.table.kind[index] == _UNKNOWN).any():
                ask_run()
                asks.append(self.scanner.ask(index))
            else:
                run.append(index)
        ask_run()
        return asks

    def next(self) -> Work | None:
        if self._asked_before:
            self._ask_again()
        if len(self._ahead) <= self._depth - _GROUP:  # a few batches taken at a time: asked about together
            taken: list[tuple[Request, np.ndarray]] = []
            while len(self._ahead) + len(taken) < self._depth:
                request = next(self._requests, None)
                if request is None:
                    break
                taken.append((request, np.asarray(request.indices, dtype=np.int64)))
            self._ahead.extend((r, i, a) for (r, i), a in zip(taken, self._asks(taken), strict=True))
        if not self._ahead:
            return None
        request, index, asked = self._ahead.popleft()
        self.scanner.settle(asked, index)
        if self.train and (request.epoch, request.number) not in self._boxes:
            self._draw_boxes(request, index)
        return self.make(request, index)

    def _draw_boxes(self, request: Request, index: np.ndarray) -> None:
        """The crop boxes of ``request`` and of the judged batches of its epoch behind it, drawn in one call: the
        draws' fixed cost (a few dozen array ops) is paid once for several batches."""
        run, chosen = [request], [self._dali_of(index)]
        for k, (later, later_index, asked) in enumerate(self._ahead):
            if later.epoch != request.epoch or len(run) == _CHUNK:
                break
            if asked is not None:  # a few of its samples were being judged: taken in once the verdicts are in
                if not asked.verdicts.done():
                    break
                self.scanner.settle(asked, later_index)
                self._ahead[k] = (later, later_index, None)
            if self.table.unchecked(later_index).any():
                break
            run.append(later)
            chosen.append(self._dali_of(later_index))
        every = np.concatenate(chosen)
        sizes = self.table.sizes[every]
        boxes = self.recipe.plan_boxes(True, self.seed, request.epoch, every, sizes[:, 0], sizes[:, 1])
        for r, part in zip(run, np.split(boxes, np.cumsum([len(c) for c in chosen])[:-1]), strict=True):
            self._boxes[(r.epoch, r.number)] = part

    def _dali_of(self, index: np.ndarray) -> np.ndarray:
        return index[self.table.kind[index] == _DALI]

    def release(self, work: Work) -> None:
        pass

    def reread(self, work: Work) -> Work:
        """``work`` made again, those of its samples whose files changed after it was made ahead of its pass judged
        again."""
        self.table.recheck(np.asarray(work.indices, dtype=np.int64))
        self._boxes.pop((work.epoch, work.number), None)  # drawn for the samples as they were judged
        assert work.index is not None  # set when it was made
        return self.make(Request(work.epoch, work.indices, work.number), work.index)

    def make(self, request: Request, index: np.ndarray) -> Work:
        """One batch (``index``: its samples as an array): the DALI samples' path rows and crop rows, Pillow's samples
        decoded, the bad ones reported."""
        t = self.table
        work = Work(request.epoch, request.indices, request.number)
        if request.ahead and request.epoch > self.gate.epoch:  # made before its pass begins: its files as they are now
            work.stamps = [file_stamp(t.dataset.samples[i][0]) for i in request.indices]
        work.index, work.labels = index, t.targets[index]
        kind = t.kind[index]
        dali = np.flatnonzero(kind == _DALI)
        if len(dali) < len(index):
            self._others(work, np.flatnonzero(kind != _DALI).tolist())
        chosen = index[dali]
        work.gpu = dali.tolist()
        work.paths = t.paths(chosen)
        work.rows = self._rows(request, chosen)
        return work

    def _rows(self, request: Request, chosen: np.ndarray) -> np.ndarray:
        """The rows of the pipeline's ``meta`` input (see :func:`.dali_graph.build_pipeline`)."""
        heights, widths = self.table.sizes[chosen, 0], self.table.sizes[chosen, 1]
        if not self.train:
            return eval_windows(self.recipe, heights, widths)
        boxes = self._boxes.pop((request.epoch, request.number), None)
        if boxes is None or len(boxes) != len(chosen):
            boxes = self.recipe.plan_boxes(True, self.seed, request.epoch, chosen, heights, widths)
        rows = np.empty((len(chosen), 6), np.int64)
        rows[:, :5] = boxes
        rows[:, 5] = self.recipe.side(True, request.epoch)
        return rows

    def _others(self, work: Work, positions: list[int]) -> None:
        """The samples DALI is not given: the bad ones reported, Pillow's decoded."""
        t = self.table
        for pos in positions:
            i = work.indices[pos]
            path = t.dataset.samples[i][0]
            if t.kind[i] == _BAD:
                work.errors.append((path, t.problems[i]))
                continue
            try:
                data = read_regular(path)
            except OSError as e:
                work.errors.append((path, f"cannot read the file ({e.strerror or e})"))
                continue
            plan = self.recipe.plan(self.train, self.seed, work.epoch, i)
            decode_on_cpu(self.check, self.recipe.side(self.train, work.epoch), work, pos, path, data, plan)


atexit.register(Scanner._close_all_at_exit)
