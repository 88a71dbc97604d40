"""The loader every backend returns: sampler order in, full (images, labels) batches on the device out,
with one policy for bad files (raise in the main process, or skip, refill and report)."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import resource
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._options import OnError
from ..augment.adaptive import LOADER_NAMES, LoaderHook, Snapshots, lag_for
from ..errors import DecodeError, GpupipeError, LoaderClosedError, StorageError
from ..plumbing.decode_ahead import Turn
from ..recipe import Recipe
from ..sources.scan import ImageList
from .device import DeviceStage, Layout
from .placement import Placement, Upstream, place
from .position import LoaderState, Pass, ResumeNotice
from .sampler import ShardSampler

DATALOADER_SETTINGS = ("pin_memory", "prefetch_factor", "persistent_workers")

_log = logging.getLogger(__name__)  # the "gpupipe" logger's: passes begun and ended, at DEBUG


@dataclass
class Batch:
    """What a backend's source yields: the good samples' images and labels, and the failures; and what the images
    are (their layout, whether they are normalised, which samples are still to augment), as the stage that made them
    says, so the device stage reads it rather than guessing."""

    images: torch.Tensor  # uint8, (n,H,W,3) "NHWC" or (n,3,H,W) "NCHW"; float32 "NCHW" when ``normalized``
    labels: torch.Tensor  # int64 (n,)
    layout: Layout = "NHWC"
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    fallbacks: int = 0  # samples a slower decoder had to take
    # int64 (n, 2) on the CPU: each sample's (epoch, index), when its per-sample augmentation (the recipe's policy,
    # per-image transforms) is still to do; the device stage does it from these keys. None: done (or none to do).
    keys: torch.Tensor | None = None
    failure: GpupipeError | None = None  # raised in the main process whatever on_error says (a transform's bug)
    snapshot: Any = None  # an adaptive policy's state the device stage draws this batch from (augment/adaptive.py)
    # the images are still in a buffer a decode worker lent (backends/handover.py): ``own`` copies them out and hands
    # it back; None once the batch is in this process's own memory
    lease: Any = None
    stamps: list | None = None  # its files as they were before a read ahead of its pass (see backends/cpu_stream.py)
    normalized: bool = False  # the images are float32, normalised with the recipe's mean and std already

    def on_gpu(self) -> list[torch.Tensor]:
        """Its tensors on the GPU: those a training stream that takes it from another stream must be recorded on
        (:class:`~gpupipe.plumbing.decode_ahead.DecodeAhead`'s ``tensors``)."""
        return [t for t in (self.images, self.labels) if t.is_cuda]

    def own(self, pinned: bool = False) -> Batch:
        """The images in this process's own memory (page-locked with ``pinned``): out of a lent buffer in one copy,
        straight into the memory they end in; a batch already in its own memory is only pinned."""
        if self.lease is not None:
            self.images, self.lease = self.lease.copy_out(self.images, pinned), None
        elif pinned:
            self.images = self.images.pin_memory()
        if pinned:
            self.labels = self.labels.pin_memory()
        return self

    def pin_memory(self) -> Batch:  # DataLoader's pin thread calls this: one copy, worker's buffer to pinned memory
        return self.own(pinned=True)


@dataclass
class LoaderStats:
    """What a loader delivered since it was built (or :meth:`reset`), for any loop to print: ``print(loader.stats)``.

    ``seconds`` runs from each pass's first ``next()`` to its last batch (the time between passes, a validation say,
    is left out); ``waited_s`` is the part of it the caller spent inside ``next()``, waiting for a batch: near
    ``seconds``, the loop is waiting for data; near 0, the loader keeps ahead of it."""

    batches: int = 0
    images: int = 0
    skipped: int = 0  # unreadable samples left out (``on_error="skip"``; ``loader.skipped`` names the last pass's)
    waited_s: float = 0.0
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def reset(self) -> None:
        """Count from now on (say, from the second epoch, after the workers' start-up)."""
        self.batches = self.images = self.skipped = 0
        self.waited_s = self.seconds = 0.0

    def __str__(self) -> str:
        waited = f"{self.waited_s:.2f} s waiting in next()"
        if self.seconds > 0:
            waited += f" ({self.waited_s / self.seconds:.0%} of {self.seconds:.2f} s)"
        return (
            f"{self.batches} batches, {self.images} images, {self.images_per_s:.1f} images/s, {waited}, "
            f"{self.skipped} skipped"
        )


@dataclass(frozen=True)
class DataLoaderSettings:
    """The ``torch.utils.data.DataLoader`` settings of a backend that decodes in DataLoader workers (the CPU decoders,
    nvjpeg's reads); ``build_loader`` refuses them, set explicitly, for a backend that does not use them."""

    pin_memory: bool = False
    prefetch_factor: int = 4  # batches per worker in flight (DataLoader's own default is 2)
    persistent_workers: bool = True  # workers outlive epochs

    def kwargs(self, num_workers: int) -> dict[str, Any]:
        """The DataLoader's keyword arguments for ``num_workers`` (0: the main process, which takes no prefetch)."""
        if num_workers == 0:
            return {"num_workers": 0, "pin_memory": self.pin_memory}
        return {
            "num_workers": num_workers,
            "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers,
        }


@dataclass(frozen=True)
class LoaderParts:
    """What ``build_loader`` prepares for every backend: the data, the order, the device stage, the recipe and the
    policies. A backend's ``make_loader`` takes this one record."""

    dataset: ImageList
    sampler: ShardSampler
    stage: DeviceStage
    recipe: Recipe
    on_error: OnError
    seed: int
    workers: int  # decode workers (DataLoader processes or DALI threads); 0 decodes in the main process
    max_pixels: int | None
    dataloader: DataLoaderSettings = field(default_factory=DataLoaderSettings)


def empty_batch(size: int, device: torch.device | str = "cpu", errors: list[tuple[str, str]] | None = None) -> Batch:
    """A batch with no sample (only failures); its images on ``device``, so it concatenates with that device's
    batches (labels stay on the CPU in every batch: the device stage moves them)."""
    return Batch(
        torch.empty(0, 3, size, size, dtype=torch.uint8, device=device),
        torch.empty(0, dtype=torch.int64),
        "NCHW",
        errors or [],
    )


class Loader:
    """Iterable of ``(images, labels)``; ``len()``, ``set_epoch()``, ``state_dict()``/``load_state_dict()``,
    ``skipped``.

    Where it stands is ``self.position`` (:class:`~gpupipe.data.position.Position`, shared with ``self.sampler``),
    moved only by the :class:`~gpupipe.data.position.Pass` that ``iter()`` returns. Subclasses provide
    ``_source(epoch, start_batch)``: an iterator of :class:`Batch` following ``self.sampler.batches(epoch,
    start_batch)``.
    """

    backend: str = ""
    # What the backend can do before the device stage (see data/placement.py); ``self.placement`` says what it does.
    upstream: ClassVar[Upstream] = None
    # A DataLoader's attribute, read by Lightning next to ``sampler``: batches are made from ``sampler`` alone.
    batch_sampler = None
    _closed = False  # close() was called: its processes and threads are gone, and it is read no more

    def __init__(self, parts: LoaderParts):
        self.parts = parts
        self.dataset, self.sampler, self.stage, self.recipe = parts.dataset, parts.sampler, parts.stage, parts.recipe
        self.position = parts.sampler.position
        self.on_error, self.seed = parts.on_error, parts.seed
        self.train = parts.sampler.shuffle
        self.skipped: list[tuple[str, str]] = []
        self.fallbacks = 0
        self.stats = LoaderStats()  # what it delivered: batches, images, images/s, the caller's wait, skipped
        self.thread_cpu = [0.0]  # CPU seconds of the loader's own Python threads in this process (a decode thread)
        self.turn = Turn()  # the caller inside next(): the loader's threads start their next batch after it leaves
        self.made_in = os.getpid()  # its workers and threads are this process's: only here is it iterated
        _made.add(self)
        augment = parts.stage.augment
        adaptive = augment.policy.adaptive if augment is not None and augment.policy is not None else None
        # an adaptive policy's hook (augment/adaptive.py): it tags each batch, hears it handed out, keeps its state
        self.adaptive: LoaderHook | None = None
        self._names: dict[str, Any] = {}  # what that policy adds to this loader's API (see __getattr__)
        key = ""
        if adaptive is not None:
            self.adaptive = adaptive.loader_hook(parts.seed, lag_for(self._drawn_ahead(parts)))
            self._names, key = adaptive.loader_names(self.adaptive), adaptive.state_key
        # the one owner of what state_dict holds, the adaptive policy's part included
        self._state = LoaderState(parts.sampler, parts.dataset.targets, self.adaptive, key)
        keyed = self.adaptive is not None and self.adaptive.needs_keys
        # where each batch is augmented and normalised: decided here, once; every stage reads it
        self.placement: Placement = place(parts.stage, self.upstream, parts.workers, keyed)
        # what the policy recorded of the batch last handed out, one per image (a probe loader's), else empty
        self.records: list = []

    def __getattr__(self, name: str) -> Any:
        """A name an adaptive policy adds to loaders (``augment.adaptive.LOADER_NAMES``): its value, or its value for
        a loader without that policy."""
        names = self.__dict__.get("_names", {})
        if name in names:
            return names[name]
        if name in LOADER_NAMES:
            return LOADER_NAMES[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def _drawn_ahead(parts: LoaderParts) -> int:
        """How many batches' augmentation may be drawn before the batch before them is handed out, beyond the device
        stage's one (an adaptive policy's lag): none where the device stage draws; loaders whose workers draw say."""
        return 0

    @property
    def snapshots(self) -> Snapshots | None:
        """Which state of an adaptive policy each batch draws from (None without one, or for a probe loader)."""
        return None if self.adaptive is None else self.adaptive.snapshots

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def device(self) -> torch.device:
        return self.stage.device

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle (the same as ``loader.sampler.set_epoch``). Iteration moves on by itself (after
        a full pass, or when a pass was left unfinished); the epoch the loader is already in, as just loaded by
        ``load_state_dict``, keeps its position."""
        self.position.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The position after the batches delivered so far (never those prefetched); after a full pass, the start of
        the next epoch (:meth:`position_at`). ``load_state_dict`` resumes there, on a loader built alike or under
        another number of ranks or batch size. With an adaptive policy, also its state (say, its weights and the
        snapshots the next batches draw from), under the policy's ``state_key``."""
        return self._state.state_dict()

    def position_at(self, epoch: int, batch: int) -> dict:
        """The state of the position after ``batch`` batches of ``epoch``: ``epoch`` and ``batch`` (this loader's
        count), ``samples`` (of the epoch's stream, :mod:`.sampler`), the ``layout`` that stream is dealt by, and
        what the ``order`` depends on (seed, the data's sample count and label digest, shuffle window)."""
        return self._state.at(epoch, batch)

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict`). Under another number of ranks or batch size, at the same
        sample of the epoch: the same global batch takes exactly the saving run's next steps, another re-splits the
        epoch's rest (a :class:`~gpupipe.data.position.ResumeNotice` says so). Another data set, seed or window is
        a ``ValueError`` naming it. A state of only ``{"epoch", "batch"}`` (earlier versions) counts this loader's
        batches: load it with the ranks and batch size it was saved with."""
        notice = self._state.load_state_dict(state)
        if notice is not None:
            warnings.warn(notice, ResumeNotice, stacklevel=2)

    def __iter__(self) -> Pass[tuple[torch.Tensor, torch.Tensor]]:
        self._check_open()
        if os.getpid() != self.made_in:
            raise GpupipeError(
                f"this loader was built in process {self.made_in}, and its workers and threads are that process's: "
                f"a process forked from it ({os.getpid()}) cannot iterate it; build a loader in this process"
            )
        return Pass(self.position, self._pass, self._abandon, self.turn)

    def close(self) -> None:
        """Stop the loader's worker processes, threads and read-ahead now, not when the garbage collector frees it;
        iterating it afterwards raises :class:`LoaderClosedError`. A second call does nothing. ``with
        build_loader(...) as loader:`` closes it at the block's end."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self.made_in:  # in a forked child, the workers and threads are the parent's: left alone
            self._shut()
            self.stage.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.backend} {self.dataset.root!r}: {len(self.dataset)} images, "
            f"{len(self)} batch{'es' * (len(self) != 1)} of {self.batch_size}, {'train' if self.train else 'eval'}, "
            f"{self._made_by()}, device {self.device}{', closed' if self._closed else ''}>"
        )

    def _made_by(self) -> str:
        """What makes the batches, for ``repr``: the decode workers."""
        workers = self.parts.workers
        return f"{workers} worker{'s' * (workers != 1)}"

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError(
                f"this {self.backend} loader of {self.dataset.root} was closed: build a new one to read"
            )

    def _shut(self) -> None:
        """The backend's processes and threads stopped for good (:meth:`close`): by default, what ends a pass that an
        error ended."""
        self._abandon()

    def _abandon(self) -> None:
        """An error ends a pass (raised from a batch, or by the error policy here): the backend's processes and threads
        stop now, not when the garbage collector frees the error's traceback, which holds this loader and may be kept
        (a caught error, a notebook's last one). The next pass starts them again."""

    def _pass(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass's batches from ``start``: the backend's, under the error policy, through the device stage."""
        self._check_open()
        began = time.perf_counter()
        self.skipped, self.fallbacks = [], 0
        sizes = [len(b) for b in self._batches(epoch, start)]
        _log.debug(
            "%s loader: a pass of epoch %d begins at batch %d (%d batches)", self.backend, epoch, start, len(sizes)
        )
        batches = self._with_policy(self._source(epoch, start), sizes)
        if self.adaptive is None:
            return self._counted(self.stage.iterate(batches), began, epoch)
        first = epoch * len(self) + start  # the batches' numbers over epochs
        return self._counted(
            self._delivering(self.stage.iterate(self.adaptive.tag(batches, first)), first), began, epoch
        )

    def _counted(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], began: float, epoch: int):
        """The batches while the loader is open (a pass begun before :meth:`close` raises at its next batch: its
        workers and threads are gone), each counted in ``stats``; ``began``: when the caller asked for the first."""
        stats, mark, taken = self.stats, began, 0
        try:
            while True:
                self._check_open()
                asked = began if taken == 0 else time.perf_counter()
                batch = next(batches, None)
                now = time.perf_counter()
                if batch is None:
                    break
                stats.seconds += now - mark
                stats.waited_s += now - asked
                stats.batches += 1
                stats.images += len(batch[1])
                mark, taken = now, taken + 1
                yield batch
        except GeneratorExit:
            _log.debug("%s loader: the pass of epoch %d was left after %d batches", self.backend, epoch, taken)
            raise
        _log.debug("%s loader: the pass of epoch %d ended: %d batches; so far %s", self.backend, epoch, taken, stats)

    def _delivering(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], first: int):
        """The batches, the adaptive policy told as each is handed out (``records``: what it returns)."""
        assert self.adaptive is not None  # only with one
        for g, batch in enumerate(batches, first):
            self.records = self.adaptive.delivered(g) or []
            yield batch

    def _batches(self, epoch: int, start: int) -> list[list[int]]:
        """``self.sampler.batches(epoch, start)`` (a backend that keeps them says so)."""
        return self.sampler.batches(epoch, start)

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        raise NotImplementedError

    def _with_policy(self, source: Iterator[Batch], sizes: list[int]) -> Iterator[Batch]:
        """The error policy on the backend's batches: raise the first failure in the main process, or record it
        and fill each batch from the next samples. Train pads the epoch's end from its first samples, so every rank
        still takes exactly ``len(self)`` steps; eval delivers each good sample once (its last batch may be short,
        and it may have fewer batches)."""
        return _rebatch(self._checked(source), sizes, pad=self.train)

    def _checked(self, source: Iterator[Batch]) -> Iterator[Batch]:
        for b in _resources_named(source):
            self.fallbacks += b.fallbacks
            if b.failure is not None:
                raise b.failure
            if b.errors:
                _raise_storage_errors(b.errors)  # the store failing is no bad sample: never skipped
                _raise_shortages(b.errors)  # nor is a process out of open files
                if self.on_error == "raise":
                    path, reason = b.errors[0]
                    raise DecodeError(path, self.backend, reason, SKIP_FIX)
                self.skipped.extend(b.errors)
                self.stats.skipped += len(b.errors)
            yield b


# every loader made in this process, closed by the exit hook while the modules are whole: one still open at exit (in
# a generator of the main module that a ``with`` block holds open, a global) was closed by the interpreter's teardown,
# its modules' names cleared ("Exception ignored in: <generator ...> ... 'NoneType' object is not callable")
_made: weakref.WeakSet[Loader] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for loader in list(_made):
        if loader.made_in == os.getpid():
            try:
                loader.close()
            except Exception as e:  # at exit, one loader's failure must not keep the others open
                _log.debug("closing a %s loader at exit: %s", loader.backend, e)


def _raise_storage_errors(errors: list[tuple[str, str]]) -> None:
    """A worker reports a :class:`StorageError` as ``"StorageError: <message>"`` (see ``_SampleDataset``): raise
    it here, in the main process, whatever ``on_error`` says."""
    prefix = f"{StorageError.__name__}: "
    for _, reason in errors:
        if reason.startswith(prefix):
            raise StorageError(reason[len(prefix) :])


SKIP_FIX = (
    'to go on: on_error="skip" leaves such files out (listed in loader.skipped), and `gpupipe check` on the same '
    "source lists every unreadable file"
)


class WorkerResourceError(GpupipeError):
    """A data loader worker, or the process it hands batches to, ran out of a system resource (shared memory, open
    files); the message names it and the fix."""


def shortage(text: str) -> str | None:
    """What ran out, in words with the fix, when a failure's text (a DataLoader worker's traceback included) says
    that the process lacked shared memory or file descriptors; None for any other failure."""
    if os.strerror(errno.EMFILE) in text or os.strerror(errno.ENFILE) in text:
        return (
            f"too many open files (ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} in this process): "
            "raise the limit (ulimit -n 65536; docker run --ulimit nofile=65536), or use fewer workers "
            "(num_workers, --workers)"
        )
    if "unable to allocate shared memory" in text or ("No space left on device" in text and "/torch_" in text):
        return (
            "no shared memory left for the batches: /dev/shm is full or too small (a container's default is 64 MB); "
            "give it more (docker run --shm-size=8g, or --ipc=host), or use fewer workers (num_workers, --workers) "
            "or a smaller prefetch_factor"
        )
    return None


def _resources_named(source: Iterator[Batch]) -> Iterator[Batch]:
    """The batches; a worker's failure for want of shared memory or open files is raised as one line naming the cause
    and the fix (torch's names the worker, its traceback, and the cause only on the last line of that)."""
    try:
        yield from source
    except RuntimeError as e:
        why = shortage(str(e))
        if why is None:
            raise
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise WorkerResourceError(f"{lines[0].rstrip('. ')}: {lines[-1]}: {why}") from None


def _raise_shortages(errors: list[tuple[str, str]]) -> None:
    """A sample that could not be read because the process is out of open files is no bad sample: raised whatever
    ``on_error`` says."""
    for path, reason in errors:
        why = shortage(reason)
        if why is not None:
            raise WorkerResourceError(f"{path}: {reason}: {why}")


def _rebatch(batches: Iterator[Batch], sizes: list[int], pad: bool) -> Iterator[Batch]:
    """Batches of exactly ``sizes`` from batches that may have lost samples; full batches pass untouched (no copy).
    With ``pad``, the end is filled from the first good samples; without, the remainder is the last batch."""
    carry: Batch | None = None
    pool: Batch | None = None  # the first good samples, to pad the end with
    out = 0
    for b in batches:
        if pool is None and len(b.labels):
            pool = b
        if carry is None and out < len(sizes) and len(b.labels) == sizes[out]:
            out += 1
            yield b  # the common case
            continue
        carry = b if carry is None else _cat(carry, b)
        while out < len(sizes) and len(carry.labels) >= sizes[out]:
            head, carry = _split(carry, sizes[out])
            out += 1
            yield head
    if not pad:
        if carry is not None and len(carry.labels):
            yield carry
        return
    for size in sizes[out:]:
        if pool is None:
            raise GpupipeError("no sample of this epoch could be decoded: every file was skipped")
        while carry is None or len(carry.labels) < size:
            carry = pool if carry is None else _cat(carry, pool)
        head, carry = _split(carry, size)
        yield head


def _cat(a: Batch, b: Batch) -> Batch:
    if len(a.labels) == 0 or len(b.labels) == 0:  # a batch of failures only: nothing to join (nor its layout)
        a = b if len(a.labels) == 0 else a
        return Batch(a.images, a.labels, a.layout, keys=a.keys, snapshot=a.snapshot, normalized=a.normalized)
    keys = None if a.keys is None or b.keys is None else torch.cat([a.keys, b.keys])
    images, labels = torch.cat([a.images, b.images]), torch.cat([a.labels, b.labels])
    return Batch(images, labels, a.layout, keys=keys, snapshot=a.snapshot, normalized=a.normalized)


def _split(b: Batch, n: int) -> tuple[Batch, Batch]:
    k = (None, None) if b.keys is None else (b.keys[:n], b.keys[n:])
    return (
        Batch(b.images[:n], b.labels[:n], b.layout, keys=k[0], snapshot=b.snapshot, normalized=b.normalized),
        Batch(b.images[n:], b.labels[n:], b.layout, keys=k[1], snapshot=b.snapshot, normalized=b.normalized),
    )
