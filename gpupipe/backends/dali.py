"""NVIDIA DALI: the recipe compiled into one DALI pipeline per loader. ``device="cuda"`` decodes on the GPU ("mixed",
with the A100/H100 hardware JPEG decoders) and batches never touch the host; ``device="cpu"`` builds a CPU-only
pipeline.

DALI is fed each batch in the shared :class:`ShardSampler`'s order with each sample's crop from
:meth:`Recipe.plan`, through ``fn.external_source``, and ``fn.decoders.image_slice`` decodes exactly that window:
from local files, their paths (DALI reads them in its own threads; :mod:`.dali_files`); from shards and object
storage, their bytes, read a whole batch at a time in DataLoader workers by the feed nvJPEG shares (:mod:`.gpu_feed`,
:mod:`.dali_feed`: nothing is read up front). A thread of the loader's own feeds DALI, fetches and assembles its
batches, so the training thread only takes finished ones. So DALI's geometry, order, labels, sharding and resume are
every other backend's; only interpolation differs. Because the loader knows each batch's files, a batch DALI fails on
is narrowed to its file(s) by Pillow; what only DALI cannot decode goes to the feed's fallback (Pillow, on the CPU),
counted in ``loader.fallbacks``. A source that holds pixels (a dataset of arrays, CIFAR's) is fed to a pipeline
without a decoder: its (H, W, 3) samples go to DALI as they are, and DALI's ops crop, resize, flip and normalise them
as they do decoded images.
"""

from __future__ import annotations

import atexit
import logging
import re
import weakref
from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import torch

from .._deps import INSTALL_HINTS, has_module, require
from .._files import read_regular
from .._system import made_below
from ..data.device import normalize
from ..data.loader import Batch, Loader, LoaderParts, empty_batch
from ..errors import DecodeError
from ..image import default_max_pixels
from ..plumbing.carry import Carry
from ..plumbing.decode_ahead import DecodeAhead
from ..plumbing.zygote import Zygote
from ._fork import pipelines_running
from .dali_feed import DaliFeed
from .dali_files import FileStream, FileTable
from .dali_graph import Driver, build_pipeline, consumer_stream, crop_inputs, read_dali, to_torch
from .dali_stream import FeedStream, plan
from .gpu_feed import Feed, Work
from .registry import BackendSpec

_log = logging.getLogger(__name__)

# Batches scheduled ahead (``schedule_run`` per batch, one prefetch slot each: with DALI's own prefetch the first run
# would ask for a second batch the feed may not have): DALI decodes the next ones while a batch is delivered, and a
# batch that takes DALI longer is absorbed by the ones already made.
_PREFETCH = 4
# Batches of the last epoch that a pass may leave undelivered while the stream still goes on into the next epoch
# (``gpupipe train --accum 2`` takes 74 of 75): they are decoded and dropped; a pass left earlier restarts the feed.
_LEFT_OVER = 4


def dali_info() -> dict:
    """Which DALI is installed and whether it can use a GPU; never imports DALI itself when it is absent."""
    if not has_module("nvidia.dali"):
        return {"installed": False}
    from importlib.metadata import PackageNotFoundError, version

    dist = None
    for name in ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110"):
        try:
            dist = f"{name} {version(name)}"
            break
        except PackageNotFoundError:
            continue
    return {"installed": True, "package": dist, "gpu": torch.cuda.is_available(), "problem": _cuda_mismatch(dist)}


def _cuda_mismatch(package: str | None) -> str | None:
    """Where DALI was built for another CUDA major than torch's: what to install instead (None when they agree, or
    torch has no CUDA: DALI's CPU pipelines run either way)."""
    built = re.search(r"cuda(\d+)0\b", package or "")
    ours = (torch.version.cuda or "").split(".")[0]
    if built is None or not ours or built.group(1) == ours:
        return None
    extra = {"13": "dali", "12": "dali-cu12"}.get(ours)
    fix = f'pip install ".[{extra}]"' if extra else f"install DALI for CUDA {ours}"
    return f"DALI for CUDA {built.group(1)} beside torch for CUDA {ours}: its GPU pipelines may not load ({fix})"


def _unavailable() -> str | None:
    return None if has_module("nvidia.dali") else f"DALI is not installed; {INSTALL_HINTS['dali']}"


class DaliLoader(Loader):
    backend = "dali"
    upstream = "decoder"  # its graph can normalise (data/placement.py)
    _live: ClassVar[weakref.WeakSet[DaliLoader]] = weakref.WeakSet()  # for :meth:`_drop_pipelines_at_exit`

    def __init__(self, parts: LoaderParts, hw_decoder_load: float = 0.65):
        require("nvidia.dali", "dali")
        super().__init__(parts)
        self.num_threads, self.hw_decoder_load = max(1, parts.workers), hw_decoder_load
        self.max_pixels = parts.max_pixels or default_max_pixels()
        self._normalized = self.placement.normalize == "decoder"  # crop_mirror_normalize; the stage leaves them
        # the feed's fallback: decides about files DALI fails on, and decodes what it cannot
        self._fallback = Feed(self.dataset, self.recipe, self.train, self.seed, self.max_pixels)
        self._pipe: Driver | None = None  # the DALI pipeline, built on first use
        self.pipelines_built = 0  # one per loader unless a decode failure invalidated one
        self._scheduled = 0  # batches scheduled and not yet fetched, whichever iteration scheduled them
        # local files: DALI reads them (a path table, judged once); else a feed reads, judges and plans whole batches
        # in DataLoader workers
        self._files = parts.dataset.reads_files
        # a source of pixels (a dataset of arrays): fed to DALI raw, cropped and resized by its ops, never decoded
        self._pixels = parts.dataset.holds_pixels()
        self._feed: FeedStream | FileStream | None = None
        # the stream's works in flight (scheduled in DALI), in order, across epochs
        self._carry: Carry[Work] = Carry(lambda work: work.tag, _LEFT_OVER, Work.read_as_now)
        self._ahead: DecodeAhead | None = None  # the pass's thread: it alone drives the pipeline while the pass runs
        self._zygote = _zygote(self.dataset) if _helpers(parts.workers) else None
        DaliLoader._live.add(self)

    # -- the pipeline -----------------------------------------------------------------------------------------------

    def _pipeline(self) -> Driver:
        if self._pipe is None:
            build = partial(
                build_pipeline,
                self.recipe,
                train=self.train,
                batch_size=self.batch_size,
                device=self.stage.device,
                num_threads=self.num_threads,
                hw_decoder_load=self.hw_decoder_load,
                normalize=self._normalized,
                files=self._files,
                pixels=self._pixels,
                queue_depth=2 if Driver.drives_directly() else 1,
            )
            # DALI's threads decode: below the training thread where batches go to a GPU, as workers are
            self._pipe = Driver(made_below(build) if self.device.type != "cpu" else build())
            self.pipelines_built += 1
            self._scheduled = 0
        return self._pipe

    @classmethod
    def _drop_pipelines_at_exit(cls) -> None:
        """At interpreter exit, once the pass threads have ended (their exit hook runs first: it is registered again
        with each thread), and before DALI's own hook (registered again with each pass, after DALI's import), every
        live loader shuts its pipeline down, a fifo among its paths in flight watched, and lets go of it while the
        modules DALI's ``Pipeline.__del__`` reads are whole. Left to the interpreter's teardown, it ran with their
        names cleared ("Exception ignored in Pipeline.__del__ ... 'NoneType' object is not callable"). A pipeline a
        stuck thread still drives is left alone."""
        for loader in list(cls._live):
            if loader._ahead is None or loader._ahead.join(timeout=0):
                loader._ahead = None
                loader._discard_pipeline()

    def _discard_pipeline(self) -> None:
        """After a critical error DALI's pipeline is no longer valid: shut it down (now, while the paths it was given
        are watched: left to the garbage collector, its threads could wait on a fifo for ever); the next batch builds
        a new one."""
        pipe, self._pipe, self._scheduled = self._pipe, None, 0
        if pipe is not None:
            try:
                pipe.shutdown()
            except RuntimeError as e:  # (as DALI's ``__del__``, which made this call before, it is not the pass's end)
                _log.debug("DALI's pipeline, dropped, failed to shut down: %s", e)

    def _submit(self, work: Work) -> None:
        pipe = self._pipeline()
        if work.paths is not None:
            pipe.feed("paths", work.paths)
        else:
            pipe.feed("pix" if self._pixels else "enc", work.batch())
        assert work.rows is not None  # every work with DALI samples has their crops
        for name, data in crop_inputs(self.recipe, self.train, work.rows).items():  # each one array, copied by DALI
            pipe.feed(name, data)
        # bytes or pixels are read where the feed's worker put them: the work holds its buffer, which goes back to the
        # worker (to be written again) when the work is dropped. The pipeline holds it until DALI is done with it
        pipe.run(hold=work if work.paths is None else None)
        self._scheduled += 1
        work.scheduled = True

    def _fetch(self) -> torch.Tensor:
        """The oldest scheduled batch; its buffers go back to DALI at once, so the next scheduled batch can finish
        while this one is delivered (``outputs()`` would hold them until the next call). On CUDA the outputs are bound
        to torch's current stream: without a stream DALI makes the host wait for its own stream every batch
        (``share_outputs``: "None means that the outputs are synchronized with the host"); with one, the consumer's
        stream waits for DALI's on the GPU, and the dynamic executor keeps the buffers until that stream is done with
        them (the torch tensor holds a reference)."""
        assert self._pipe is not None  # a batch was scheduled on it
        self._scheduled -= 1
        (out,) = self._pipe.share(consumer_stream(self.stage.device))
        try:
            return to_torch(out, self.stage.device)
        finally:
            self._pipe.release()

    def _drain(self, keep: int = 0) -> None:
        """Fetch and drop what an earlier, unfinished pass left in the pipeline (the oldest first), until ``keep``
        batches are left in flight, so this pass starts clean."""
        while self._pipe is not None and self._scheduled > keep:
            try:
                self._fetch()
            except RuntimeError:
                self._discard_pipeline()

    def _resubmit(self) -> None:
        """After DALI lost its pipeline: the works still waiting are scheduled again, in order, on a new one."""
        for work in self._carry:
            if work.gpu:
                self._submit(work)

    def _continue(self, epoch: int, start_batch: int) -> None:
        """The stream of works for this pass. The one in flight goes on when this pass is the start of the epoch it
        leads to (the next one, as the loader moves on by itself), also when the last pass was left a few batches
        short of its end (those are fetched and dropped): its first batches are then scheduled already
        (:class:`Carry`). Else what is in flight is dropped and the feed starts again at this pass's first batch."""
        replanned = self.sampler.resplit(epoch) is not None  # a resumed re-split: not the batches made ahead
        count = self.sampler.count(epoch, start_batch)
        begun = self._carry.begin((epoch, start_batch), count, self._decoded_or_lost, self._take, replanned)
        if begun.goes_on:
            assert self._feed is not None  # what went on came from it
            self._feed.consuming(epoch)  # the rest of this epoch is read from now on
            if begun.changed:
                self._reread(begun.changed)
            return
        self._drain()
        feed = self._feed_stream()
        feed.restart(plan(self.sampler, feed.gate, epoch, start_batch, _PREFETCH))

    def _reread(self, changed: list[Work]) -> None:
        """Works of this pass read before it began whose files changed since: read again, and everything in flight
        scheduled again behind them."""
        assert self._feed is not None  # works with stamps came from the feed
        self._drain()
        for work in changed:
            self._carry.replace(work, self._feed.reread(work))
        self._resubmit()

    # -- the samples ------------------------------------------------------------------------------------------------

    def _feed_stream(self) -> FeedStream | FileStream:
        """Local files: the works made on this thread from the path table, each sample's header judged the first
        time it comes, in processes. Else the feed: works prepared ahead in its workers."""
        if self._feed is None and self._files:
            table = FileTable(self.dataset, self.max_pixels)
            workers = _helpers(self.parts.workers)
            self._feed = FileStream(table, self.recipe, self.train, self.seed, workers, self._zygote)
        if self._feed is None:
            feed = DaliFeed(self.dataset, self.recipe, self.train, self.seed, self.max_pixels, self._pixels)
            nicer = self.device.type != "cpu"
            workers = _helpers(self.parts.workers)
            self._feed = FeedStream(feed, workers, nicer=nicer, cpu=self.thread_cpu, zygote=self._zygote)
        return self._feed

    def _recover(self, work: Work) -> torch.Tensor | None:
        """DALI failed on ``work`` (and its pipeline is gone). Pillow decides about each of its samples: what Pillow
        rejects is an error, named; the rest goes through a fresh pipeline once more, and if DALI fails again, is
        decoded on the CPU. Returns DALI's images for the positions left in ``work.gpu``, if any. Pixels, which DALI
        does not decode, have no culprit to find: they are cropped on the CPU."""
        if self._pixels:
            self._fallback.fallback(work, list(work.gpu), work.samples())
            return None
        keep, datas = [], []
        for pos, data in zip(work.gpu, _sample_bytes(work, self.dataset), strict=True):
            path = self.dataset.samples[work.indices[pos]][0]
            try:
                if isinstance(data, OSError):
                    raise DecodeError(path, self.backend, f"cannot read the file ({data.strerror or data})")
                self._fallback.check.decode(data, path)
                keep.append(pos)
                datas.append(data)
            except DecodeError as e:
                work.errors.append((path, e.reason))
        if len(keep) < len(work.gpu):  # the culprit is known: DALI may well decode the rest
            work.narrow([work.gpu.index(pos) for pos in keep])
            if not work.gpu:
                return None
            try:
                self._submit(work)
                return self._fetch()
            except RuntimeError:
                self._discard_pipeline()
        self._fallback.fallback(work, list(work.gpu), datas)  # only DALI refuses these: Pillow decodes them
        return None

    def _assemble(self, work: Work, decoded: torch.Tensor | None) -> Batch:
        """The batch in the sampler's order: DALI's images and Pillow's, less the failures."""
        device = self.stage.device if self.stage.device.type == "cuda" else torch.device("cpu")  # where DALI outputs
        if not work.cpu:
            positions = work.gpu
            images = decoded if decoded is not None else self._empty(work.epoch, device)
        else:
            parts = {pos: decoded[k] for k, pos in enumerate(work.gpu)} if decoded is not None else {}
            parts.update({pos: self._as_dali_would(torch.from_numpy(img).to(device)) for pos, img in work.cpu.items()})
            positions = sorted(parts)
            images = torch.stack([parts[pos] for pos in positions])
        assert work.index is not None and work.labels is not None  # made with the work, in the feed's worker
        index, labels = torch.from_numpy(work.index), torch.from_numpy(work.labels)
        if len(positions) != len(index):
            index, labels = index[positions], labels[positions]
        keys = torch.stack([torch.full_like(index, work.epoch), index], 1) if self.placement.keys else None
        return Batch(images, labels, "NCHW", work.errors, work.fallbacks, keys, normalized=self._normalized)

    def _empty(self, epoch: int, device: torch.device) -> torch.Tensor:
        """No image of a batch left (every sample bad): none, in the dtype DALI outputs (the batch says it is
        normalised)."""
        empty = empty_batch(self.recipe.side(self.train, epoch), device).images
        return empty.float() if self._normalized else empty

    def _as_dali_would(self, image: torch.Tensor) -> torch.Tensor:
        """An image Pillow decoded, in the dtype of the pipeline's output (normalized when DALI normalizes)."""
        return normalize(image[None], self.stage.mean, self.stage.inv_std)[0] if self._normalized else image

    def _source(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        """This pass's batches, made on a thread of the loader's own (:class:`DecodeAhead`, one batch ahead): it feeds
        DALI (each batch's rows and file paths, ``_PREFETCH`` batches scheduled ahead), fetches its outputs and
        assembles them, so the training thread only takes finished batches. The stream of works runs across epochs:
        when this epoch's last ones are in flight, the next epoch's first ones are scheduled too, so DALI never runs
        dry at the edge, and the next pass goes on with them (:meth:`_continue`)."""
        if self._ahead is not None:
            self._ahead.join()  # the last pass's thread (one left early: stopped after its batch), before this one
        import nvidia.dali.pipeline  # noqa: F401  # before the thread: its exit hook then runs before DALI's

        # and so does the loaders' own, which shuts their pipelines down where a fifo among the paths in flight is
        # watched (DALI's hook, first, waited on a reader held in ``open`` for ever)
        atexit.unregister(DaliLoader._drop_pipelines_at_exit)
        atexit.register(DaliLoader._drop_pipelines_at_exit)

        # the thread may outlive the pass: it holds the loader weakly, so a loader dropped in a reference cycle (a
        # caught error's traceback, a user's object) is collected, and its DecodeAhead with it, which ends the thread
        loader = weakref.ref(self)

        def deliver(work: Work) -> Batch:
            me = loader()
            if me is None:  # dropped: its DecodeAhead closed, so this ends the thread
                raise RuntimeError("the loader was dropped")
            return me._deliver(work)

        works = _works(loader, epoch, start_batch)
        ahead = DecodeAhead(
            works, deliver, self.stage.device, Batch.on_gpu, name="gpupipe-dali", cpu=self.thread_cpu, turn=self.turn
        )
        self._ahead = ahead
        yield from ahead  # a pass left early closes it: its batches made ahead are dropped (their works are done)

    def _abandon(self) -> None:
        """An error ended the pass: its thread ends, the works in flight are dropped and the feed's workers stop (the
        next pass starts them again on a new plan, once it has fetched what DALI still has scheduled)."""
        if self._ahead is not None and not self._ahead.join(timeout=5):
            return  # its batch waits on a stuck feed worker (a second Ctrl-C): raised now, the rest ends with it
        self._carry.clear()
        if self._feed is not None:
            self._feed.stop()

    def _shut(self) -> None:
        """close(): what ends a pass an error ended (the pass's thread, the feed's workers), and DALI's pipeline shut
        down now, its threads with it (DALI's own exit hook makes the same call; dropping it would wait for the
        garbage collector)."""
        ahead = self._ahead
        self._abandon()
        # the fork server goes with its last user (another loader may have borrowed it): it and its workers end then
        self._ahead, self._feed, self._zygote = None, None, None
        pipe, self._pipe = self._pipe, None
        if pipe is not None and (ahead is None or ahead.join(timeout=0)):  # never under a thread still in DALI
            pipe.shutdown()

    def _deliver(self, work: Work) -> Batch:
        """One work's batch (on the loader's thread): fetched, assembled, released (the next works are scheduled once
        it is handed over, :meth:`_works`). On CUDA
        DALI's output is copied into memory of torch's allocator on the thread's stream: the training stream then
        reads it after an event, and the allocator keeps it from reuse until that stream is done (DALI's own buffer,
        released here, is ordered on the thread's stream only); DALI's PyTorch iterator copies its outputs too."""
        decoded = self._decoded(work)
        if decoded is not None and decoded.is_cuda and not work.cpu:  # (with Pillow's images: stacked anew)
            decoded = decoded.clone()
        batch = self._on_device(self._assemble(work, decoded))
        self._release(work)
        return batch

    def _on_device(self, batch: Batch) -> Batch:
        """A batch for a device other than the CPU, put there on this thread: its labels copied (on CUDA from
        page-locked memory, non-blocking, on the thread's stream), so the training thread copies no batch there. DALI's
        images are on CUDA already; on the meta device, which stands in for CUDA, its CPU outputs are moved too."""
        if self.device.type == "cpu":
            return batch
        labels = batch.labels.pin_memory() if self.device.type == "cuda" else batch.labels
        batch.labels = labels.to(self.device, non_blocking=True)
        batch.images = batch.images.to(self.device, non_blocking=True)
        return batch

    def _take(self) -> Work | None:
        """The stream's next work, scheduled; None when the plan has ended."""
        work = self._feed_stream().next()
        if work is not None and work.gpu:
            self._submit(work)
        return work

    def _fill(self) -> None:
        """Schedule works until ``_PREFETCH`` are in flight: this epoch's, then the next epoch's first ones."""
        while len(self._carry) < _PREFETCH and (work := self._take()) is not None:
            self._carry.add(work)

    def _release(self, work: Work) -> None:
        if self._feed is not None:
            self._feed.release(work)

    def _decoded_or_lost(self, work: Work) -> None:
        """Fetch and drop a work no pass delivers (a batch of a pass left early)."""
        if work.gpu and self._scheduled:
            try:
                self._fetch()
            except RuntimeError:
                self._discard_pipeline()
                self._resubmit()
        self._release(work)

    def _decoded(self, work: Work) -> torch.Tensor | None:
        """DALI's images of ``work``; after a failure, what :meth:`_recover` saves (the batches behind it, lost with
        the pipeline, are scheduled again, in order, on a new one)."""
        if not work.gpu:
            return None
        try:
            return self._fetch()
        except RuntimeError:
            self._discard_pipeline()
            decoded = self._recover(work)
            self._resubmit()
            return decoded


def _works(loader: weakref.ref[DaliLoader], epoch: int, start_batch: int) -> Iterator[Work]:
    """The pass's works in order, on the loader's thread, each scheduled in DALI before it comes; between works the
    loader is held only weakly (see :meth:`DaliLoader._source`)."""
    me = loader()
    assert me is not None  # the pass being made holds it
    me._continue(epoch, start_batch)
    carry = me._carry
    if not carry:  # a new stream: its first works (else those in flight go on, and the first is not held back)
        me._fill()
    del me
    while (work := carry.take()) is not None:
        yield work
        me = loader()
        if me is None:
            return
        me._fill()  # once the work before was delivered: never held back by the feed's next read or DALI's
        del me


def _zygote(dataset) -> Zygote | None:
    """The fork server of a loader's helper processes (:mod:`~gpupipe.plumbing.zygote`): made now, as the loader is
    built, while no DALI pipeline runs in the process (it then holds the loader's dataset: its workers share it as
    forked ones do); else the newest one made earlier in the process, which is sent the dataset; else none (the
    helpers are forked from this process, each start bounded)."""
    if not pipelines_running():
        return Zygote(hold=(dataset, dataset.samples))
    return Zygote.newest()


def _helpers(workers: int) -> int:
    """Processes beside DALI (the header scan, the feed): a quarter of the loader's workers, at least one (reading
    and header parsing are light next to DALI's decode threads); none with no workers."""
    return 0 if workers == 0 else max(1, workers // 4)


def _sample_bytes(work: Work, dataset) -> list[bytes | OSError]:
    """Each DALI sample's bytes as they are now: the feed's, or the file read again where DALI read it."""
    if work.paths is None:
        return [data.tobytes() for data in work.samples()]
    out: list[bytes | OSError] = []
    for pos in work.gpu:
        try:
            out.append(read_regular(dataset.samples[work.indices[pos]][0]))
        except OSError as e:
            out.append(e)
    return out


SPEC = BackendSpec(
    "dali",
    "NVIDIA DALI: decode (GPU 'mixed' with the hardware JPEG decoders, or CPU) + crop + resize in one pipeline",
    ("cpu", "cuda"),
    _unavailable,
    DaliLoader,
    read=read_dali,
)
