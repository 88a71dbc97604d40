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

from rich.console import Console
from rich.markup import escape

GUESS_START_S = 3.0  # a loader's start-up before the first measurement shows the real one (2-core machine: 1-5 s)
GUESS_END_S = 0.5  # stopping a job: its workers and pipeline
GUESS_WINDOW_EXTRA = 2.0  # per window, the quiet wait (at most 2 windows: a busy machine) ...
GUESS_DRAIN_S = 0.5  # ... and the drain of the prefetched batches


class Eta:
    """The plan of a run (``jobs`` measurements of ``repeats`` windows each) and the costs measured so far."""

    def __init__(self, jobs: int, warm: float, window: float, repeats: int):
        self.warm, self.window = warm, window
        self.jobs_to_start, self.jobs_to_end, self.windows_left = jobs, jobs, jobs * repeats
        self.starts: list[float] = []  # seconds from starting a job to the end of its warm-up
        self.ends: list[float] = []  # seconds to stop a job (its workers, its pipeline)
        self.windows: list[float] = []  # seconds per timed window, with its drain and quiet wait
        self.recent = max(1, jobs)  # windows of a round: the current pipeline's cost (decode's differ from eval's)
        self.began = time.monotonic()

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
        the latest round's, and the jobs not stopped yet at their stop."""
        start = statistics.mean(self.starts) if self.starts else self.warm + GUESS_START_S
        window = (
            statistics.mean(self.windows[-self.recent :])
            if self.windows
            else self.window * (1 + GUESS_WINDOW_EXTRA) + GUESS_DRAIN_S
        )
        end = statistics.mean(self.ends) if self.ends else GUESS_END_S
        return max(0, self.jobs_to_start) * start + max(0, self.windows_left) * window + max(0, self.jobs_to_end) * end

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
