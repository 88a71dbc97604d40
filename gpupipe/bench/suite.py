"""The decode / train / eval benchmark suites, the torchvision baseline, and the end-to-end training mode.

Every figure is a median over timed windows after a warm-up, with the spread, and train/eval figures are
also given as a ratio to the baseline measured in the same run, so they hold on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from functools import partial
from typing import NamedTuple

import torch
from PIL import Image

from .._system import usable_cores
from ..api import build_loader
from ..backends import get
from ..errors import DecodeError
from ..image import default_max_pixels
from ..recipe import Recipe
from ..sources.open import Source, open_source
from .baseline import baseline_counts
from .end_to_end import run_end_to_end, trained_backends
from .eta import Eta, RunShape, plan
from .gpu_util import GpuSampler
from .jobs import DECODE_JOBS, dali_reference_counts
from .records import Config, Result

PIPELINES = ("decode", "floor", "train", "eval", "augment")
# decode: the whole image at full size. floor (CPU decoders): the whole image at the DCT scale each train crop allows,
# nothing else; the train figure's ``vs_floor`` says how close the rest of the pipeline comes (or how far past it, for
# a decoder that decodes only the crop's part: turbojpeg's window decode).
# augment: the train pipeline with each of the config's recipe policies (--aa, repeatable; --color-jitter, --reprob),
# beside plain train: one row per policy, with its cost in ms per image over plain train.


def _forever(make: Callable[[], Iterable]) -> Iterator:
    while True:
        yield from make()


def _warm(batches: Iterator, seconds: float) -> None:
    until = time.perf_counter() + seconds
    for _ in batches:
        if time.perf_counter() > until:
            break


def _window(batches: Iterator, seconds: float, drain: int, sync: Callable[[], None]) -> float:
    """images/s over one window. The first ``drain`` batches are taken untimed: they were made while another
    job was being timed (prefetch queues), and counting them would inflate the figure."""
    for _, _ in zip(range(drain), batches, strict=False):
        pass
    sync()
    t0, count = time.perf_counter(), 0
    for n in batches:
        count += n
        if time.perf_counter() - t0 >= seconds:
            break
    sync()
    return count / (time.perf_counter() - t0)


def _cpu_busy() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine since boot (Linux ``/proc/stat``); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def _wait_quiet(limit: float, interval: float = 0.2, cores: float = 0.3) -> None:
    """Wait, at most ``limit`` seconds, until the machine uses fewer than ``cores`` CPUs. A job's prefetching workers
    refill their queues after its own window: without this, that work runs in the next job's window and costs it."""
    before = _cpu_busy()
    if before is None:
        return
    hz = os.sysconf("SC_CLK_TCK")
    until = time.monotonic() + limit
    while time.monotonic() < until:
        time.sleep(interval)
        now = _cpu_busy()
        if now is None or (now[0] - before[0]) / hz / interval < cores:
            return
        before = now


def _sync_for(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _loader_counts(cfg: Config, backend: str, train: bool, recipe: Recipe | None = None) -> Iterator[int]:
    """A loader's batch sizes, forever. Unreadable files are skipped (a bench measures speed) and named in
    ``cfg.skipped``. Closing the generator closes the loader: its workers and threads end at once."""
    with build_loader(
        cfg.data,
        backend,
        batch_size=cfg.batch_size,
        train=train,
        image_size=cfg.image_size,
        device=cfg.device,
        num_workers=cfg.workers,
        drop_last=False,
        recipe=recipe,
        on_error="skip",
    ) as loader:
        for _, y in _forever(lambda: loader):
            cfg.skipped.update(path for path, _ in loader.skipped)
            yield len(y)


def _decode_counts(cfg: Config, backend: str, floor: bool = False) -> Iterator[int]:
    """Decode to uint8 RGB at full size, nothing else; with ``floor``, at the scale each train crop allows."""
    data = open_source(cfg.data)
    spec = get(backend)
    if backend in DECODE_JOBS and not floor:
        return DECODE_JOBS[backend](data, cfg)
    recipe = Recipe(cfg.image_size) if floor else None
    assert spec.decoder is not None  # _backend_job plans decode and floor only for a backend with a decoder
    ds = _DecodeOnly(data, spec.decoder(None, True), recipe)
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=cfg.batch_size,
        num_workers=cfg.workers,
        shuffle=floor,
        collate_fn=sum,
        persistent_workers=cfg.workers > 0,
    )
    return _forever(lambda: dl)


def _reference_counts(cfg: Config, train: bool) -> Iterator[int]:
    """DALI's own pipeline as its documentation writes it, reading files itself (``dali_reference_counts``)."""
    return dali_reference_counts(open_source(cfg.data), cfg, train)


class _DecodeOnly(torch.utils.data.Dataset):
    """Decode one file and touch one pixel; with a recipe, decode it as the train pipeline would before resizing."""

    def __init__(self, dataset, decoder, recipe: Recipe | None = None):
        self.dataset, self.decoder, self.recipe = dataset, decoder, recipe

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i) -> int:
        """1 for a decoded image, 0 for an unreadable one (a bench measures speed: it goes on)."""
        path = self.dataset.samples[i][0]
        try:
            data = self.dataset.read(i)
            if self.recipe is not None:
                self.decoder.decode(data, path, self.recipe.plan(True, 0, 0, i), self.recipe.train_size(0))
                return 1
            img = self.decoder.decode(data, path).image
        except (DecodeError, OSError):
            return 0
        if isinstance(img, Image.Image):
            img.getpixel((0, 0))  # decoded, and nothing more (an array is decoded already)
        return 1


def mean_megapixels(data: Source) -> float:
    """The mean size of up to 200 samples spread over the data set: from the index of a prepared set, else from the
    image headers (an unreadable file is left out)."""
    dataset = open_source(data)
    picks = range(0, len(dataset), max(1, len(dataset) // 200))
    if dataset.sizes is not None:
        sizes = [dataset.sizes[i][0] * dataset.sizes[i][1] for i in picks]
    else:
        sizes = []
        for i in picks:
            try:
                source = dataset.samples[i][0] if dataset.reads_files else io.BytesIO(dataset.read(i))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                    with Image.open(source) as im:
                        sizes.append(im.size[0] * im.size[1])
            except (OSError, ValueError, Image.DecompressionBombError):
                continue
    sizes = [n for n in sizes if n <= default_max_pixels()]  # over the limit: left out by every loader
    return sum(sizes) / len(sizes) / 1e6 if sizes else 0.0


def run(cfg: Config, progress: Callable[..., None] = lambda text, fraction=None: None) -> list[Result]:
    """Every (backend, pipeline) of the config, plus the baseline for train and eval. ``progress(text, fraction)``
    hears of each job and window, with the fraction of the planned time done."""
    mp = mean_megapixels(cfg.data)
    jobs = _plan(cfg)
    eta = _eta(cfg, jobs)
    results = _time_interleaved(cfg, jobs, mp, progress, eta)
    if cfg.skipped:
        first = sorted(cfg.skipped)[0]
        logging.getLogger("gpupipe").warning(
            f"{cfg.data}: {len(cfg.skipped)} unreadable file(s) left out of the measurements, e.g. {first}; "
            f"`gpupipe check {cfg.data}` lists them all"
        )
    results.sort(key=lambda r: cfg.pipelines.index(r.pipeline))  # stable: backends keep their order
    _add_ratios(results)
    if cfg.model:
        results += run_end_to_end(cfg, progress, mp, eta)
    return results


def estimate(cfg: Config) -> float:
    """Seconds the run of ``cfg`` is planned to take, before anything is measured (its first progress line)."""
    return _eta(cfg, _plan(cfg)).left()


def _eta(cfg: Config, jobs: list[_Job]) -> Eta:
    rounds = [[job.backend for job in group] for group in _rounds(cfg, jobs).values()]
    shape = RunShape(
        rounds,
        trained_backends(cfg) if cfg.model else [],
        cfg.workers,
        cfg.batch_size,
        cfg.seconds,
        cfg.repeats,
        len(open_source(cfg.data)),
        cfg.device.type,
    )
    return plan(shape)


def _rounds(cfg: Config, jobs: list[_Job]) -> dict[str, list[_Job]]:
    """The jobs by the round they are timed in, in order: one per pipeline, the floor and the augment policies in
    train's (train figures are read against the floor, and each policy's cost against plain train)."""
    timed_with = lambda p: "train" if p in ("floor", "augment") and "train" in cfg.pipelines else p
    rounds: dict[str, list[_Job]] = {timed_with(p): [] for p in cfg.pipelines}
    for job in jobs:
        rounds[timed_with(job.pipeline)].append(job)
    return rounds


class _Job(NamedTuple):
    backend: str
    pipeline: str
    make: Callable[[], Iterator[int]]  # starts the job: an endless stream of batch sizes
    policy: str | None = None  # augment: the label of the policies it trains with
    size: int | None = None  # its output side, when the config names several (``image_sizes``)


def _plan(cfg: Config) -> list[_Job]:
    """The jobs in the config's order: per pipeline (and per size, with several ``image_sizes``; decode has none),
    the baseline (train, eval), then each backend that has that pipeline, with DALI's own reference pipeline beside
    the dali backend."""
    jobs = []
    reference = cfg.dali_reference and open_source(cfg.data).reads_files  # DALI's file reader: no tar members
    for pipeline in cfg.pipelines:
        if pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")
        several = len(cfg.image_sizes) > 1 and pipeline != "decode"
        sizes: list[int | None] = [*cfg.image_sizes] if several else [None]
        for size in sizes:
            jobs += [job._replace(size=size) for job in _pipeline_jobs(_sized(cfg, size), pipeline, reference)]
    return jobs


def _pipeline_jobs(cfg: Config, pipeline: str, reference: bool) -> list[_Job]:
    jobs = []
    if pipeline in ("train", "eval"):
        jobs.append(_Job("baseline", pipeline, partial(baseline_counts, cfg, pipeline == "train")))
    for b in cfg.backends:
        jobs += _backend_jobs(cfg, b, pipeline)
        if b == "dali" and pipeline in ("train", "eval") and reference:
            jobs.append(_Job("dali-reference", pipeline, partial(_reference_counts, cfg, pipeline == "train")))
    return jobs


def _sized(cfg: Config, size: int | None) -> Config:
    """The config at one of its ``image_sizes`` (its recipes too); the same ``skipped`` set."""
    if size is None:
        return cfg
    recipes = {label: dataclasses.replace(r, size=size) for label, r in cfg.recipes.items()}
    return dataclasses.replace(cfg, image_size=size, image_sizes=[], recipes=recipes)


def _backend_jobs(cfg: Config, backend: str, pipeline: str) -> list[_Job]:
    """``backend``'s jobs for ``pipeline``: one, or one per policy for augment (a train pipeline with that recipe;
    without policies, the plain recipe), or none when the backend has no such pipeline."""
    if pipeline == "augment":
        recipes = cfg.recipes or {"none": Recipe(cfg.image_size)}
        return [
            _Job(backend, pipeline, partial(_loader_counts, cfg, backend, True, recipe), policy)
            for policy, recipe in recipes.items()
        ]
    make = _backend_job(cfg, backend, pipeline)
    return [] if make is None else [_Job(backend, pipeline, make)]


def _backend_job(cfg: Config, backend: str, pipeline: str) -> Callable[[], Iterator[int]] | None:
    """How to start ``backend``'s ``pipeline`` (not augment); None when the backend has no such pipeline (decode
    needs a decode job or a CPU decoder, floor a CPU decoder)."""
    spec = get(backend)
    if pipeline == "decode" and backend not in DECODE_JOBS and spec.decoder is None:
        return None
    if pipeline == "floor" and spec.decoder is None:
        return None
    if pipeline in ("decode", "floor"):
        return lambda: _decode_counts(cfg, backend, floor=pipeline == "floor")
    return lambda: _loader_counts(cfg, backend, pipeline == "train")


def _time_interleaved(
    cfg: Config, jobs: list[_Job], mp: float, progress: Callable[..., None], eta: Eta
) -> list[Result]:
    """One Result per job, pipeline by pipeline. Interleaved: the jobs of one pipeline are all started, then timed
    in turns (one window each per round), so a slow patch of a noisy machine hits every backend alike and the ratios
    to the baseline hold. The floor and the augment policies are timed in the train rounds, as train figures are read
    against the floor, and each policy's cost against plain train."""

    sync = _sync_for(cfg.device)
    results: list[Result] = []
    window = cfg.seconds / cfg.repeats
    warm = max(1.0, cfg.seconds / 4)
    report = lambda text: progress(text, eta.fraction(), left=eta.left())
    report(
        f"{len(jobs)} measurements (backend x pipeline), each: start-up, {warm:g} s warm-up, {cfg.repeats} timed "
        f"window(s) of {window:.2g} s"
    )
    drain = 4 * max(cfg.workers, 1) + 2  # DataLoaders keep prefetch_factor batches per worker (2, ours 4)
    for group in _rounds(cfg, jobs).values():
        streams = []
        for job in group:
            report(f"{job.pipeline}: starting {_name(job)}")
            t0 = time.monotonic()
            streams.append(job.make())
            _warm(streams[-1], warm)
            eta.started(time.monotonic() - t0)
        rates: list[list[float]] = [[] for _ in group]
        gpu_samplers = [GpuSampler(cfg.device) for _ in group]
        for r in range(cfg.repeats):
            for i, job in enumerate(group):
                report(f"{job.pipeline}: {_name(job)}, window {r + 1}/{cfg.repeats}")
                t0 = time.monotonic()
                _wait_quiet(limit=min(10.0, 2 * window))
                with gpu_samplers[i]:
                    rates[i].append(_window(streams[i], window, drain, sync))
                eta.timed(time.monotonic() - t0)
        for job, rs, gpu in zip(group, rates, gpu_samplers, strict=True):
            results.append(_result(cfg, job, rs, mp, gpu.mean))
        t0 = time.monotonic()
        for stream in streams:
            if isinstance(stream, Generator):  # every job's stream is one; a plain iterator has nothing to end
                stream.close()  # ends the generators: their DataLoader workers and DALI pipelines go with them
        eta.ended(time.monotonic() - t0)
    return results


def _name(job: _Job) -> str:
    return job.backend if job.policy is None else f"{job.backend} ({job.policy})"


def _result(cfg: Config, job: _Job, rates: list[float], mp: float, gpu_util: float | None) -> Result:
    rate = statistics.median(rates)
    per_worker = rate / max(cfg.workers, 1)
    return Result(
        job.backend,
        job.pipeline,
        cfg.device.type,
        cfg.workers,
        rate,
        (min(rates), max(rates)),
        rate * mp,
        per_worker,
        gpu_util=gpu_util,
        extra={k: v for k, v in (("policy", job.policy), ("image_size", job.size)) if v is not None},
    )


def _add_ratios(results: list[Result]) -> None:
    """Each figure against the baseline of its pipeline, each train figure against its backend's floor, and each
    augment figure's policy cost: its ms per image over its backend's plain train (``cost_ms_per_image``)."""
    size = lambda r: r.extra.get("image_size")  # with several sizes, each compared at its own
    base = {(r.pipeline, size(r)): r.images_per_s for r in results if r.backend == "baseline"}
    floor = {(r.backend, size(r)): r.images_per_s for r in results if r.pipeline == "floor"}
    train = {(r.backend, size(r)): r.images_per_s for r in results if r.pipeline == "train"}
    for r in results:
        if (r.pipeline, size(r)) in base:
            r.vs_baseline = r.images_per_s / base[r.pipeline, size(r)]
        if r.pipeline == "train" and (r.backend, size(r)) in floor:
            r.extra["vs_floor"] = r.images_per_s / floor[r.backend, size(r)]
        if r.pipeline == "augment" and train.get((r.backend, size(r))) and r.images_per_s > 0:
            r.extra["cost_ms_per_image"] = 1000 / r.images_per_s - 1000 / train[r.backend, size(r)]


def default_workers() -> int:
    return usable_cores()
