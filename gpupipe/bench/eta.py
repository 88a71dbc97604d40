"""How long a bench run has left, from what it has measured so far.

``--seconds`` is the timed time per measurement; a measurement also costs its start-up (building the loader,
spawning workers, a DALI pipeline, the first batch), its warm-up, and per timed window the prefetched batches it
drains untimed and the wait for a quiet machine. The run is planned part by part (each job's start-up, each window,
each round's stop) with a guess for each (:func:`plan`). The seconds a part times (a warm-up, a window) are known;
what is estimated is the overhead around them, which depends on the machine, the data and the backend. So each part
not measured yet is its guess with the overhead scaled by what the parts of its kind measured so far cost against
their guesses: a start-up of DALI's graph keeps its larger guess after CPU decoders' start-ups were measured, and a
machine twice as fast as guessed makes every later guess half. A window of a job already timed costs what that job's
windows cost.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape


@dataclass(frozen=True)
class Guess:
    """What one job is guessed to cost before it was measured, in seconds (:func:`plan`): each part's
    whole, and the timed seconds in it (``warm`` in ``start``, ``timed`` in ``window``), which are not guessed."""

    start: float  # its start-up (loader, workers, a GPU pipeline's build, the first batch) and warm-up
    window: float  # one timed window with its quiet wait, its drain and the epoch starts it runs into
    end: float  # stopping it
    warm: float = 0.0
    timed: float = 0.0


@dataclass
class _Part:
    kind: str  # "start", "window", "end" or "model"
    guess: float
    known: float  # the timed seconds in it
    job: int = -1  # the job whose window it is (windows only)
    took: float | None = None  # measured

    @property
    def overhead(self) -> float:
        return max(self.guess - self.known, 0.0)


@dataclass
class Eta:
    """The plan of a run: ``rounds`` of jobs (each job's :class:`Guess`; a round's jobs are started, timed
    ``repeats`` windows each in turns, then stopped together), then ``models`` end-to-end measurements (their guesses);
    and what each part measured. The suite tells it each part as it ends, in the plan's order."""

    rounds: list[list[Guess]]
    repeats: int
    models: list[float] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._parts: list[_Part] = []
        job = 0
        for jobs in self.rounds:
            self._parts += [_Part("start", g.start, g.warm) for g in jobs]
            for _ in range(self.repeats):
                self._parts += [_Part("window", g.window, g.timed, job + k) for k, g in enumerate(jobs)]
            self._parts.append(_Part("end", sum(g.end for g in jobs), 0.0))
            job += len(jobs)
        self._parts += [_Part("model", m, 0.0) for m in self.models]

    def started(self, seconds: float) -> None:
        self._measured("start", seconds)

    def timed(self, seconds: float) -> None:
        self._measured("window", seconds)

    def ended(self, seconds: float) -> None:
        """A round's jobs stopped together in ``seconds``."""
        self._measured("end", seconds)

    def modelled(self, seconds: float) -> None:
        """One end-to-end measurement done, in ``seconds``."""
        self._measured("model", seconds)

    def _measured(self, kind: str, seconds: float) -> None:
        part = next((p for p in self._parts if p.kind == kind and p.took is None), None)
        if part is not None:  # a part the plan did not count (a run that changed under it) is not costed
            part.took = seconds

    def left(self) -> float:
        """Seconds left: every part not measured yet, at its estimate (see the module's docstring)."""
        done = [p for p in self._parts if p.took is not None]
        ratios = {kind: _ratio([p for p in done if p.kind == kind]) for kind in ("start", "window", "end")}
        overall = _ratio([p for p in done if p.kind != "model"])
        jobs: dict[int, list[float]] = {}
        for p in done:
            if p.kind == "window":
                jobs.setdefault(p.job, []).append(p.took or 0.0)
        models = [p.took or 0.0 for p in done if p.kind == "model"]
        total = 0.0
        for p in self._parts:
            if p.took is not None:
                continue
            if p.kind == "window" and p.job in jobs:
                total += statistics.mean(jobs[p.job])  # this job's own windows so far
            elif p.kind == "model":
                total += max(models) if models else p.guess  # the slowest: the backends differ most here
            else:
                ratio = ratios[p.kind] if ratios[p.kind] is not None else overall
                total += p.known + p.overhead * (1.0 if ratio is None else ratio)
        return total

    def fraction(self) -> float:
        """The share of the run done, in time: elapsed / (elapsed + left)."""
        elapsed = time.monotonic() - self.began
        return elapsed / max(elapsed + self.left(), 1e-9)


def _ratio(parts: list[_Part]) -> float | None:
    """What the overhead of ``parts`` took against its guess (None: none measured, or nothing guessed)."""
    guessed = sum(p.overhead for p in parts)
    if not parts or guessed <= 0:
        return None
    return sum(max((p.took or 0.0) - p.known, 0.0) for p in parts) / guessed


@contextlib.contextmanager
def shown_progress(console: Console) -> Iterator[Callable[..., None]]:
    """``progress(text, fraction, left)`` for ``suite.run``, shown on ``console``: a status line on a terminal,
    else one line per window, with the share done and the time left (``left``, the suite's estimate, else
    extrapolated from ``fraction``). The share shown never goes back: a part that cost more than guessed lengthens the
    time left, not the work done."""
    start = time.monotonic()
    shown = [0.0]

    def line(text: str, fraction: float | None = None, left: float | None = None) -> str:
        if left is None and fraction:
            left = (time.monotonic() - start) * (1 - fraction) / fraction
        if left is None:
            return f"bench: {text}"
        shown[0] = max(shown[0], fraction or 0.0)
        return f"bench {shown[0]:4.0%}, about {int(left) // 60}m{int(left) % 60:02d}s left: {text}"

    if console.is_terminal:
        with console.status("benchmarking") as status:
            yield lambda text, fraction=None, left=None: status.update(escape(line(text, fraction, left)))
    else:
        yield lambda text, fraction=None, left=None: console.print(
            line(text, fraction, left), highlight=False, markup=False
        )


# The cost model of a run before anything was measured: each part at what it is expected to cost on an idle machine
# (the parts measured then scale the rest, see the module's docstring): a job's start-up, warm-up and first batch;
# per window the batches made untimed around it (its drain, and the refill of its prefetch queues, which the next
# window's quiet wait waits for) at a CPU decoder's rate, and each epoch start the batches run into (one worker builds
# a whole batch, so an epoch's first batch costs a batch's decode on one core).
IMAGE_CPU_S = 0.006  # one 224-px train image on one core (decode of a ~500x375 JPEG, crop, collate)
PROCESS_S = 0.3  # a worker process started (forked, with torch imported) and its first request answered
BASE_START_S = 1.5  # a loader built: the source opened (a folder scanned, an index read), the sampler, the first call
GPU_BUILD_S = 8.0  # a GPU pipeline before its first batch: DALI's graph and threads, nvJPEG's handles, CUDA streams
MODEL_S = {"cuda": 20.0, "cpu": 3.0}  # a timm model built and moved, and its first steps (cuDNN's search per shape)
# torchvision's pipeline (the baseline) decodes each image whole, with no DCT scaling: per image it costs about twice
# the pillow backend's work (bench/README.md's CPU tables: its train rate is half of pillow's)
IMAGE_COST = {"baseline": 2.0}
POLL_S = 0.2  # the quiet wait's one look at an idle machine (suite._wait_quiet's interval)
END_S = 0.5  # stopping a job: its workers and pipeline
GPU_PIPELINES = ("dali", "dali-reference", "nvjpeg")


@dataclass(frozen=True)
class RunShape:
    """What the cost model needs of a run: its settings (from ``bench.records.Config``) and the data set's size."""

    rounds: list[list[str]]  # each round's jobs, by backend, in order (suite._time_interleaved's rounds)
    end_to_end: list[str]  # the backends trained end to end (synthetic first), or none
    workers: int
    batch_size: int
    seconds: float
    repeats: int
    images: int  # samples in the data set: an epoch
    device: str


def plan(run: RunShape) -> Eta:
    """The run's plan with each part's cost before any was measured (see the constants above)."""
    workers, batch, window = max(run.workers, 1), run.batch_size, run.seconds / run.repeats
    warm = max(1.0, run.seconds / 4)
    rate = workers / IMAGE_CPU_S  # images/s, the CPU decoders' (GPU pipelines are faster: their drains cost less)
    batch_s = batch * IMAGE_CPU_S  # one batch on one core: the first of a job, and of every epoch
    made = 4 * workers + 2  # untimed batches per window: what suite._window drains (prefetch 4 per worker, and 2)

    def job(backend: str) -> Guess:
        cost = IMAGE_COST.get(backend, 1.0)
        epochs_per_window = (made * batch + window * rate / cost) / max(run.images, 1)
        window_s = window + POLL_S + cost * (made * batch / rate + (epochs_per_window + 1) * batch_s)
        return Guess(_start(backend, workers, cost * batch_s) + warm, window_s, _end(workers), warm, window)

    models = []
    if run.end_to_end:
        e2e_warm = max(2.0, run.seconds / 4)
        epochs = (e2e_warm + run.seconds) * rate / max(run.images, 1)
        e2e = [_start(b, workers, batch_s) + e2e_warm + run.seconds + (epochs + 1) * batch_s for b in run.end_to_end]
        models = [MODEL_S.get(run.device, MODEL_S["cuda"]) + t + _end(workers) for t in e2e]
    return Eta([[job(b) for b in backends] for backends in run.rounds], run.repeats, models)


def _start(backend: str, workers: int, batch_s: float) -> float:
    build = GPU_BUILD_S if backend in GPU_PIPELINES else 0.0
    return BASE_START_S + workers * PROCESS_S + build + batch_s


def _end(workers: int) -> float:
    return END_S + 0.05 * workers
