"""How long a bench run has left, from what it has measured so far.

``--seconds`` is the timed time per measurement; a measurement also costs its start-up (building the loader,
spawning workers, a DALI pipeline, the first batch), its warm-up, and per timed window the prefetched batches it
drains untimed and the wait for a quiet machine. Those costs depend on the machine, the data and the backend, so
the estimate starts from a guess and then uses the averages seen in this run.
"""

from __future__ import annotations

import statistics
import time

GUESS_START_S = 3.0  # a loader's start-up before the first measurement shows the real one (2-core machine: 1-5 s)
GUESS_WINDOW_EXTRA = 1.0  # per window, the drain and the quiet wait, as a multiple of the window (a busy machine)


class Eta:
    """The plan of a run (``jobs`` measurements of ``repeats`` windows each) and the costs measured so far."""

    def __init__(self, jobs: int, warm: float, window: float, repeats: int):
        self.warm, self.window = warm, window
        self.jobs_left, self.windows_left = jobs, jobs * repeats
        self.starts: list[float] = []  # seconds from starting a job to the end of its warm-up
        self.windows: list[float] = []  # seconds per timed window, with its drain and quiet wait
        self.began = time.monotonic()

    def started(self, seconds: float) -> None:
        self.jobs_left -= 1
        self.starts.append(seconds)

    def timed(self, seconds: float) -> None:
        self.windows_left -= 1
        self.windows.append(seconds)

    def left(self) -> float:
        """Seconds left: the jobs not started yet at their measured start-up, the windows not timed at theirs."""
        start = statistics.mean(self.starts) if self.starts else self.warm + GUESS_START_S
        window = statistics.mean(self.windows) if self.windows else self.window * (1 + GUESS_WINDOW_EXTRA)
        return max(0, self.jobs_left) * start + max(0, self.windows_left) * window

    def fraction(self) -> float:
        """The share of the run done, in time: elapsed / (elapsed + left)."""
        elapsed = time.monotonic() - self.began
        return elapsed / max(elapsed + self.left(), 1e-9)
