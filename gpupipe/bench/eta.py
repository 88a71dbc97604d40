"""How long a bench run has left, from what it has measured so far.

``--seconds`` is the timed time per measurement; a measurement also costs its start-up (building the loader,
spawning workers, a DALI pipeline, the first batch), its warm-up, and per timed window the prefetched batches it
drains untimed and the wait for a quiet machine. Those costs depend on the machine, the data and the backend, so
the estimate starts from a guess and then uses the averages seen in this run.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

GUESS_START_S = 3.0  # a loader's start-up before the first measurement shows the real one (errs long on 2 cores)
GUESS_END_S = 0.5  # stopping a job: its workers and pipeline
GUESS_WINDOW_EXTRA = 2.0  # per window, the quiet wait (at most 2 windows: a busy machine) ...
GUESS_DRAIN_S = 0.5  # ... and the drain of the prefetched batches


@dataclass(frozen=True)
class Guess:
    """What each part of a run costs before it was measured, in seconds (the suite's :func:`~.suite.guess`)."""

    start: float  # a job's start-up (loader, workers, a GPU pipeline's build, the first batch) and warm-up
    window: float  # a timed window with its quiet wait, its drain and the epoch starts it runs into
    end: float  # stopping a job
    model: float = 0.0  # one end-to-end measurement whole: the model built, its loader, warm-up and timed seconds


class Eta:
    """The plan of a run (``jobs`` measurements of ``repeats`` windows each, then ``models`` end-to-end measurements)
    and the costs measured so far; ``guess`` (default: the fixed guesses above) until a part was measured."""

    def __init__(
        self, jobs: int, warm: float, window: float, repeats: int, guess: Guess | None = None, models: int = 0
    ):
        fixed = Guess(warm + GUESS_START_S, window * (1 + GUESS_WINDOW_EXTRA) + GUESS_DRAIN_S, GUESS_END_S)
        self.guess = guess or fixed
        self.jobs_to_start, self.jobs_to_end, self.windows_left = jobs, jobs, jobs * repeats
        self.models_left = models
        self.starts: list[float] = []  # seconds from starting a job to the end of its warm-up
        self.ends: list[float] = []  # seconds to stop a job (its workers, its pipeline)
        self.windows: list[float] = []  # seconds per timed window, with its drain and quiet wait
        self.models: list[float] = []  # seconds per end-to-end measurement
        self.recent = max(1, jobs)  # windows of a round: the current pipeline's cost (decode's differ from eval's)
        self.began = time.monotonic()

    def modelled(self, seconds: float) -> None:
        """One end-to-end measurement done, in ``seconds``."""
        self.models_left -= 1
        self.models.append(seconds)

    def started(self, seconds: float) -> None:
        self.jobs_to_start -= 1
        self.starts.append(seconds)

    def timed(self, seconds: float) -> None:
        self.windows_left -= 1
        self.windows.append(seconds)

    def ended(self, seconds: float, jobs: int) -> None:
        """``jobs`` stopped together in ``seconds``."""
        self.jobs_to_end -= jobs
        self.ends.extend([seconds / max(jobs, 1)] * jobs)

    def round_of(self, jobs: int) -> None:
        """The next windows are timed in turns over ``jobs`` jobs: the last round's windows are the best guess."""
        self.recent = max(1, jobs)

    def left(self) -> float:
        """Seconds left: the jobs not started yet at their measured start-up, the windows not timed at the cost of
        the latest round's, the jobs not stopped yet at their stop, and the end-to-end measurements not made yet."""
        start = statistics.mean(self.starts) if self.starts else self.guess.start
        window = statistics.mean(self.windows[-self.recent :]) if self.windows else self.guess.window
        end = statistics.mean(self.ends) if self.ends else self.guess.end
        model = max(self.models) if self.models else self.guess.model  # the slowest: the backends differ most here
        jobs = max(0, self.jobs_to_start) * start + max(0, self.windows_left) * window + max(0, self.jobs_to_end) * end
        return jobs + max(0, self.models_left) * model

    def fraction(self) -> float:
        """The share of the run done, in time: elapsed / (elapsed + left)."""
        elapsed = time.monotonic() - self.began
        return elapsed / max(elapsed + self.left(), 1e-9)


@contextlib.contextmanager
def shown_progress(console: Console) -> Iterator[Callable[..., None]]:
    """``progress(text, fraction, left)`` for ``suite.run``, shown on ``console``: a status line on a terminal,
    else one line per window, with the share done and the time left (``left``, the suite's estimate, else
    extrapolated from ``fraction``)."""
    start = time.monotonic()

    def line(text: str, fraction: float | None = None, left: float | None = None) -> str:
        if left is None and fraction:
            left = (time.monotonic() - start) * (1 - fraction) / fraction
        if left is None:
            return f"bench: {text}"
        return f"bench {fraction or 0:4.0%}, about {int(left) // 60}m{int(left) % 60:02d}s left: {text}"

    if console.is_terminal:
        with console.status("benchmarking") as status:
            yield lambda text, fraction=None, left=None: status.update(escape(line(text, fraction, left)))
    else:
        yield lambda text, fraction=None, left=None: console.print(
            line(text, fraction, left), highlight=False, markup=False
        )


# The cost model of a run before anything was measured. Each guess errs long (an estimate that ends early is worse
# than one that ends late): a job's start-up, warm-up and first batch, every window's quiet wait at its bound, the
# prefetched batches it drains at a CPU decoder's rate, and each epoch start the batches run into (one worker builds
# a whole batch, so an epoch's first batch costs a batch's decode on one core).
IMAGE_CPU_S = 0.006  # one 224-px train image on one core (decode of a ~500x375 JPEG, crop, collate), erring slow
PROCESS_S = 0.3  # a worker process started (forked, with torch imported) and its first request answered
BASE_START_S = 1.5  # a loader built: the source opened (a folder scanned, an index read), the sampler, the first call
GPU_BUILD_S = 8.0  # a GPU pipeline before its first batch: DALI's graph and threads, nvJPEG's handles, CUDA streams
MODEL_S = {"cuda": 20.0, "cpu": 3.0}  # a timm model built and moved, and its first steps (cuDNN's search per shape)
GPU_PIPELINES = ("dali", "dali-reference", "nvjpeg")


@dataclass(frozen=True)
class RunShape:
    """What the cost model needs of a run: its settings (from ``bench.records.Config``) and the data set's size."""

    backends: list[str]  # each job's backend, in order
    end_to_end: list[str]  # the backends trained end to end (synthetic first), or none
    workers: int
    batch_size: int
    seconds: float
    repeats: int
    images: int  # samples in the data set: an epoch
    device: str


def guess(run: RunShape) -> Guess:
    """The mean cost of each part of ``run`` before any was measured (see the constants above)."""
    workers, batch, window = max(run.workers, 1), run.batch_size, run.seconds / run.repeats
    warm = max(1.0, run.seconds / 4)
    rate = workers / IMAGE_CPU_S  # images/s, the CPU decoders' (GPU pipelines are faster: their drains cost less)
    batch_s = batch * IMAGE_CPU_S  # one batch on one core: the first of a job, and of every epoch
    drain = 4 * workers + 2  # what suite._window drains: prefetch_factor 4 per worker, and 2
    epochs_per_window = (drain * batch + window * rate) / max(run.images, 1)
    starts = [_start(b, workers, batch_s) + warm for b in run.backends]
    model = 0.0
    if run.end_to_end:
        e2e_warm = max(2.0, run.seconds / 4)
        epochs = (e2e_warm + run.seconds) * rate / max(run.images, 1)
        e2e = [_start(b, workers, batch_s) + e2e_warm + run.seconds + (epochs + 1) * batch_s for b in run.end_to_end]
        model = MODEL_S.get(run.device, MODEL_S["cuda"]) + max(e2e) + _end(workers)
    return Guess(
        start=sum(starts) / len(starts) if starts else 0.0,
        window=min(10.0, 2 * window) + drain * batch / rate + window + (epochs_per_window + 1) * batch_s,
        end=_end(workers),
        model=model,
    )


def _start(backend: str, workers: int, batch_s: float) -> float:
    build = GPU_BUILD_S if backend in GPU_PIPELINES else 0.0
    return BASE_START_S + workers * PROCESS_S + build + batch_s


def _end(workers: int) -> float:
    return GUESS_END_S + 0.05 * workers
