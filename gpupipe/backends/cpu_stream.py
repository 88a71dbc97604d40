"""The CPU backends' batches as one stream across epochs: one DataLoader iteration for the loader's life.

A new ``iter()`` of the DataLoader at each pass opens every epoch cold (each worker builds a whole batch before the
first one arrives: a full batch time) and ends it with the workers idle once the sampler runs dry. So the DataLoader
iterates a :class:`Plan` instead: a batch sampler that runs on from one epoch into the next, in the order the loader
will ask (the next epoch's batches are dispatched, and made, while this one ends). A pass that starts where the stream
is heading takes its batches as they come; one that starts elsewhere (a pass left early, ``load_state_dict``,
``set_epoch``) drops what was dispatched before its first batch: the workers skip those not begun (:class:`Gate`),
and the plan goes on from the pass's start. Batches already dispatched are kept only when they are exactly what the
pass would ask for now (the same indices, the same adaptive policy's snapshot): a resumed re-split or a reloaded state
redo them.

Files may change between two passes, and every backend reads a file as it is when its pass runs. So only an epoch's
first batches (two per worker: what keeps every worker busy while the last pass ends) are read before their pass
begins; their files are stamped before the read and checked when the batch is delivered (a changed one is made
again); the later ones wait in the worker until the loader delivers their epoch (:class:`Gate`).

The items streamed are a worker's batches as it hands them over: the CPU decoders' :class:`Batch`, nvjpeg's bytes
batches (:class:`Made`). A backend's loader is a :class:`StreamedLoader`.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .._files import Stamp, file_stamp, unchanged
from ..data.loader import Loader
from ..plumbing.decode_ahead import DecodeAhead
from ..plumbing.workers import end_workers, start_workers, worker_init
from .handover import let_go

if TYPE_CHECKING:
    from ..augment.adaptive import Snapshots
    from ..data.sampler import ShardSampler
    from ..sources.scan import ImageList

_NEVER = 1 << 62

# The DataLoader iteration of each stream, from its start until the stream ends it: held here too, outside any
# reference cycle the stream may be in (a caught error's traceback holding its loader), so the garbage collector never
# frees an iteration itself. It would close the iteration's queues before the iteration can tell its workers to stop
# (each worker then killed after 5 s, its buffers left in /dev/shm); it finalizes the stream instead, which ends it.
_iterations: set[Iterator] = set()


class Made(Protocol):
    """A worker's batch as the stream hands it on: its files' stamps when read ahead of its pass (else None), and
    itself in this process's own memory (``own``)."""

    @property
    def stamps(self) -> list[Stamp] | None: ...

    def own(self, pinned: bool = False) -> Made: ...


class Task(list):
    """One batch's keys as the DataLoader hands them to a worker, and where the batch stands in the stream."""

    def __init__(self, keys: list[tuple], seq: int, epoch: int, batch: int, ahead: bool, wait: bool):
        super().__init__(keys)
        self.seq, self.epoch, self.batch = seq, epoch, batch  # its place in the stream, its place in its epoch
        self.ahead = ahead  # dispatched before its epoch's pass began: its files are stamped before the read
        self.wait = wait  # made only once the loader delivers its epoch
        self.indices: list[int] = []  # the sample indices (main process only: what the pass is compared with)
        self.snapshot: Any = None  # the adaptive policy's state its draws use, when the workers draw

    def __reduce__(self):  # to a worker: the keys and what the worker reads, not the main process's bookkeeping
        return Task, (list(self), self.seq, self.epoch, self.batch, self.ahead, self.wait)


class Gate:
    """Two numbers in shared memory, read by the workers: the epoch the loader delivers (a :class:`Task` that waits is
    made once it is reached) and the first place in the stream still wanted (a task before it is skipped)."""

    def __init__(self) -> None:
        self._values = multiprocessing.RawArray("q", 2)  # [epoch delivered, first place wanted]

    def deliver(self, epoch: int) -> None:
        self._values[0] = epoch

    def want_from(self, seq: int) -> None:
        self._values[1] = seq

    def wanted(self) -> int:
        """The first place in the stream still wanted."""
        return self._values[1]

    def close(self) -> None:
        """Every task is skipped, a waiting one at once (the stream is ending)."""
        self._values[1] = _NEVER

    def admit(self, task: Task) -> bool:
        """In a worker: whether to make ``task`` (False: skip it), once it may be made. A poll that backs off to 5 ms:
        a waiting worker costs no CPU, and starts within 5 ms of its pass."""
        pause = 0.0005
        while task.seq >= self._values[1]:
            if not task.wait or self._values[0] >= task.epoch:
                return True
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        return False

    def let_in(self, keys: list[tuple], dataset: ImageList) -> tuple[bool, list[Stamp] | None]:
        """In a worker, for a batch's keys (a :class:`Task`, or plain keys, made at once): whether to make it (False:
        skipped, see :meth:`admit`), and its files' stamps, taken before the read, when it is read ahead of its pass."""
        if not isinstance(keys, Task):
            return True, None
        if not self.admit(keys):
            return False, None
        if keys.ahead and dataset.reads_files:
            return True, [file_stamp(dataset.samples[key[1]][0]) for key in keys]
        return True, None


class Plan:
    """The DataLoader's batch sampler: the loader's batches from a place on, epoch after epoch, as :class:`Task`\\ s.

    Iterated by the DataLoader on the training thread, one task each time it dispatches a batch. It holds the sampler
    and the adaptive policy's snapshots, never the loader (the loader holds the DataLoader that holds this: a cycle
    would leave the workers to the garbage collector, which closes their queues before the DataLoader can stop them:
    5 s a worker)."""

    def __init__(self, sampler: ShardSampler, clock: Snapshots | None, ahead: int):
        self.sampler, self.clock, self.ahead = sampler, clock, ahead
        self.sent: deque[Task] = deque()  # dispatched, not yet taken, in order
        self.seq = 0  # the next task's place in the stream
        self.delivering = -1  # the epoch whose pass has begun last
        self._at = (0, 0)  # (epoch, batch) of the next task
        self._moved = True  # ``_at`` was set from outside: the epoch's batches are read again from the sampler
        self._early = 0  # tasks of ``_at``'s epoch dispatched before its pass began
        self._course: object = None  # the sampler's re-split of ``_at``'s epoch when its batches were read (or None)
        self._dealt: dict[int, tuple[object, list[list[int]]]] = {}  # epoch -> (its re-split, its batches)

    def __len__(self) -> int:
        return len(self.sampler)

    def batches(self, epoch: int, start: int) -> list[list[int]]:
        """``sampler.batches(epoch, start)``, each epoch's dealt once while its re-split stays (a shuffle of the data
        set: tens of milliseconds at ImageNet's size, which the plan, the pass and its sizes would each pay)."""
        resplit = self.sampler.resplit(epoch)
        kept = self._dealt.get(epoch)
        if kept is None or kept[0] is not resplit:
            kept = self._dealt[epoch] = (resplit, self.sampler.batches(epoch))
            for old in [e for e in self._dealt if e < epoch - 1 or e > epoch + 1]:
                del self._dealt[old]
        whole = kept[1]
        return whole[max(start - (len(self.sampler) - len(whole)), 0) :]  # a re-split epoch's numbers start later

    def go_to(self, epoch: int, batch: int) -> None:
        """The next task is batch ``batch`` of ``epoch``, its batches as the sampler says now."""
        self._at, self._moved = (epoch, batch), True

    def follows(self, epoch: int) -> bool:
        """Whether the tasks not yet dispatched of ``epoch`` follow its batches as the sampler deals them now."""
        if self._at[0] != epoch:
            return self._at[0] > epoch  # all dispatched already (compared one by one)
        return not self._moved and self._course is self.sampler.resplit(epoch)

    def __iter__(self) -> Iterator[Task]:
        todo: Iterator[list[int]] = iter(())
        while len(self.sampler):
            if self._moved:
                self._moved, self._early = False, 0
                self._course = self.sampler.resplit(self._at[0])
                todo = iter(self.batches(*self._at))
            indices = next(todo, None)
            if indices is None:  # the epoch's end: on into the next
                self.go_to(self._at[0] + 1, 0)
                continue
            yield self._task(indices)

    def _task(self, indices: list[int]) -> Task:
        epoch, batch = self._at
        self._at = (epoch, batch + 1)
        snapshot = None if self.clock is None else self.clock.for_batch(epoch * len(self.sampler) + batch)
        keys = [(epoch, i) for i in indices] if snapshot is None else [(epoch, i, snapshot) for i in indices]
        ahead = epoch > self.delivering
        self._early += ahead
        task = Task(keys, self.seq, epoch, batch, ahead, wait=ahead and self._early > self.ahead)
        task.indices, task.snapshot = indices, snapshot
        self.seq += 1
        self.sent.append(task)
        return task


class Stream:
    """The DataLoader's one iteration over a :class:`Plan`, and the passes taken from it (see the module's docstring).

    ``remake(task)`` makes a task's batch on this thread (a read-ahead batch whose files changed); ``pinned``: the
    DataLoader's pin thread copies batches to page-locked memory, so a remade one is pinned here too."""

    def __init__(
        self,
        dataloader: torch.utils.data.DataLoader,
        plan: Plan,
        gate: Gate,
        remake: Callable[[Task], Made],
        pinned: bool,
    ):
        self._dataloader, self.plan, self.gate, self._remake, self._pinned = dataloader, plan, gate, remake, pinned
        self._pid = os.getpid()  # its workers' parent: only this process ends them or moves their gate
        self._it: Iterator | None = None  # the DataLoader's one iteration (again only after a failure)
        self._peeked: tuple[Task, Made] | None = None  # the next epoch's first batch, taken before its pass (peek)

    # read through the class: ``__del__`` may run at exit once the module's names are cleared
    _getpid = staticmethod(os.getpid)

    def __del__(self) -> None:
        if self._getpid() != self._pid or self._it is None:  # a forked child's copy (the parent's goes on), or ended
            return
        self.gate.close()  # before the iterator ends the workers: one waiting on the gate lets go at once
        self._end()

    def begin(self, epoch: int, start: int, batches: list[list[int]]) -> None:
        """A pass of ``epoch`` from batch ``start`` (``batches``: its batches as the sampler says now) begins: the
        tasks dispatched for it are kept when they are what it asks for now, and the rest is skipped."""
        plan = self.plan
        plan.delivering = epoch
        self.gate.deliver(epoch)
        if self._it is not None and self._dataloader.num_workers and not self._dataloader.persistent_workers:
            self._broken()  # workers a pass, as asked (persistent_workers=False): this pass starts new ones
        live = [t for t in self._queued() if t.seq >= self.gate.wanted()]
        first = next((k for k, t in enumerate(live) if (t.epoch, t.batch) == (epoch, start)), None)
        if self._it is not None and first is not None and self._on_course(live[first:], epoch, start, batches):
            self.gate.want_from(live[first].seq)
        else:
            self.gate.want_from(plan.seq)  # everything dispatched so far is skipped
            self._peeked = None
            plan.go_to(epoch, start)
        if self._it is None:
            plan.sent.clear()
            self._it = start_workers(self._dataloader)
            _iterations.add(self._it)

    def _on_course(self, sent: list[Task], epoch: int, start: int, batches: list[list[int]]) -> bool:
        """Whether the tasks dispatched from the pass's first batch on, and the plan's course for the rest of the
        epoch, are the pass's batches as it would ask for them now: the same samples (a resumed re-split changes
        them), and, where the workers draw an adaptive policy's ops, the same snapshot (a loaded state changes it)."""
        clock = self.plan.clock
        for task in sent:
            if task.epoch != epoch:
                break
            k = task.batch - start
            if k >= len(batches) or task.indices != batches[k]:
                return False
            if clock is not None and task.snapshot != clock.for_batch(epoch * len(self.plan) + task.batch):
                return False
        return self.plan.follows(epoch)

    def _queued(self) -> list[Task]:
        """The tasks dispatched and not yet taken by a pass, in order (a peeked one first)."""
        return ([self._peeked[0]] if self._peeked is not None else []) + list(self.plan.sent)

    def peek(self, epoch: int) -> Made | None:
        """Batch 0 of ``epoch`` (the next one), taken now, before its pass begins, when the workers were sent it: the
        same object is then the first that pass takes, if it starts there (else it is dropped). Its files are checked
        when the pass takes it, as any read-ahead batch's. None when it was not sent yet (nothing waits here for the
        gate) or the stream heads elsewhere."""
        live = [t for t in self.plan.sent if t.seq >= self.gate.wanted()]
        if self._it is None or self._peeked is not None or not live or (live[0].epoch, live[0].batch) != (epoch, 0):
            return None
        self._peeked = self._next()
        return self._peeked[1]

    def drop_peeked(self) -> None:
        """The batch :meth:`peek` took is not handed to a pass (its taker used it up, or dropped it): a pass that
        starts there has it made again."""
        self._peeked = None

    def take(self, count: int) -> Iterator[Made]:
        """The pass's ``count`` batches, in order, each in this process's own memory."""
        for _ in range(count):
            task, batch = self._next()
            if task.ahead and batch.stamps is not None and not unchanged(batch.stamps):
                del batch  # a file changed since it was read ahead: read as it is now (its buffer goes back)
                batch = self._remake(task)
                yield batch.own(pinned=self._pinned)
                continue
            yield batch.own()  # copied out of a worker's buffer here, unless the pin thread did (into pinned memory)

    def _next(self) -> tuple[Task, Made]:
        """The next wanted task and its batch; those before it are dropped as they arrive."""
        if self._peeked is not None:
            peeked, self._peeked = self._peeked, None
            if peeked[0].seq >= self.gate.wanted():
                return peeked
        assert self._it is not None  # begin() first
        while True:
            try:
                batch = next(self._it)
            except BaseException:
                self._broken()
                raise
            task = self.plan.sent.popleft()
            if task.seq >= self.gate.wanted():
                return task, batch
            del batch  # not wanted: the worker's buffer goes back uncopied (handover._Lease)

    def _broken(self) -> None:
        """The DataLoader's iterator failed (a worker died; an interrupt), or is not to outlive its pass: the next pass
        iterates the DataLoader again (what it had dispatched is skipped)."""
        self.gate.want_from(self.plan.seq)
        self._peeked = None
        self._end()

    def _end(self) -> None:
        """The DataLoader's iteration ends, its workers stopped now (:func:`end_workers`); their buffers' files go
        with this process's mappings of them (handover.py)."""
        it, self._it = self._it, None
        _iterations.discard(it)
        end_workers(self._dataloader, it)
        let_go()


class StreamedLoader(Loader):
    """A loader whose DataLoader is iterated once for its life, as one :class:`Stream` (made at its first pass, or
    when its batches are first asked for): a backend provides :meth:`_open_stream` (see :meth:`_streaming`) and
    takes each pass's items with :meth:`_taken`."""

    _the_stream: Stream | None = None
    _ahead: DecodeAhead | None = None  # the last pass's thread taking (or decoding) the stream's items, if any

    def _batches(self, epoch: int, start: int) -> list[list[int]]:
        self._hand_over()
        return self._stream().plan.batches(epoch, start)

    def _taken(self, epoch: int, start: int) -> Iterator[Made]:
        """The worker batches of a pass of ``epoch`` from batch ``start``, in order (what was made for it ahead, and
        is still what it asks for, kept)."""
        self._hand_over()
        stream = self._stream()
        batches = stream.plan.batches(epoch, start)
        stream.begin(epoch, start, batches)
        return stream.take(len(batches))

    def _stream(self) -> Stream:
        if self._the_stream is None:
            self._the_stream = self._open_stream()
        return self._the_stream

    def _open_stream(self) -> Stream:
        raise NotImplementedError

    def _abandon(self) -> None:
        if self._ahead is not None and not self._ahead.join(timeout=5):
            return  # its batch waits on a stuck worker (a second Ctrl-C): raised now, the stream ends later
        if self._the_stream is not None:
            self._the_stream._broken()  # the workers stopped now: the garbage collector would take 5 s a worker

    def _shut(self) -> None:
        """close(): the thread taking the last pass's items ends, then the DataLoader's workers and its pin thread, and
        the stream is dropped (no read-ahead for a next epoch)."""
        self._abandon()
        self._ahead = None
        stream, self._the_stream = self._the_stream, None
        if stream is not None:
            stream.gate.close()  # a worker waiting on the gate lets go at once
            stream._end()

    def _hand_over(self) -> None:
        """Before a pass uses the stream: what took the last pass's items on a thread of its own (``_ahead``) is done
        with it (the plan, which that thread's ``next()`` runs on, is then this thread's alone)."""
        if self._ahead is not None:
            self._ahead.join()  # one left early: stopped after its batch

    def _streaming(
        self, data, collate: Callable, remake: Callable[[Task], Made], nicer: bool, clock=None, **settings
    ) -> Stream:
        """The stream of a DataLoader over ``data`` (a dataset whose ``__getitems__`` makes a :class:`Task` once its
        ``gate`` lets it, see :meth:`Gate.let_in`), its keys from a :class:`Plan` (with ``clock``: the adaptive
        policy's snapshot each batch's draws use, for workers that draw), the loader's DataLoader settings (``settings``
        override them), its workers begun by :func:`worker_init` (batches sent by name; with ``nicer``, below the
        training thread: where batches go to a GPU, which that thread only launches work on)."""
        plan = Plan(self.sampler, clock, ahead=self._read_ahead())
        dataloader = torch.utils.data.DataLoader(
            data,
            batch_sampler=plan,
            collate_fn=collate,
            **{**self.parts.dataloader.kwargs(self.parts.workers), **settings},
            worker_init_fn=functools.partial(worker_init, nicer=nicer),
        )
        return Stream(dataloader, plan, data.gate, remake, dataloader.pin_memory)

    def _read_ahead(self) -> int:
        """An epoch's first batches made before its pass begins: two per worker (each has the next one queued when
        the pass begins and the rest of the epoch is let through), at most what the DataLoader keeps in flight."""
        workers = max(1, self.parts.workers)
        return min(2 * workers, workers * self.parts.dataloader.prefetch_factor)
