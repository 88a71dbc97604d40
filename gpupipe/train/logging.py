"""What a run shows and keeps: progress (rank 0), TensorBoard scalars, ``metrics.jsonl`` per epoch, ``skipped.txt``.

On a terminal the progress is a live bar, refreshed every ``log_every`` batches and at least every half second (each
batch when batches are slower); in a file or pipe it is whole lines (never wrapped at 80 columns), one every tenth of
an epoch, and one at the batch where a stop saved. Under DDP the bar's img/s are rank 0's own; the epoch summary's
are all ranks'.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .._names import escape

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_SPLITS = {"train": "training", "val": "validation"}  # a skipped file's loader, as the log names it


@dataclass
class Meter:
    """One epoch's running sums on this rank: shown as progress, all-reduced into the epoch's metrics, and
    checkpointed, so that a resumed epoch reports what the straight one would."""

    loss: float = 0.0  # summed over images
    images: int = 0
    wait: float = 0.0  # seconds spent waiting for the loader
    time: float = 0.0  # seconds of training
    startup: float = 0.0  # the loader's first batch in this process (its start-up): kept out of ``wait`` and ``time``

    def __post_init__(self) -> None:
        self._loss_sum: torch.Tensor | None = None  # on the loss's device: summed without a host sync
        self._tick = time.perf_counter()
        self._folded = self.images  # the images whose loss ``loss`` sums (the rest is on the device)

    def start(self) -> None:
        """Start the clock (at the first batch of the epoch, or of its resumed part)."""
        self._tick = time.perf_counter()

    def started(self, wait: float) -> None:
        """The loader's first batch in this process came after ``wait`` seconds: its start-up (processes, pipeline,
        first decode) is reported apart, and the epoch's clock restarts, so that data-wait and images/s are the steady
        state's (a later epoch's first batch is a wait like any other: an epoch that starts cold shows)."""
        self.startup += wait
        self.start()

    def update(self, loss: torch.Tensor, images: int, wait: float) -> None:
        """Add one micro-batch: its mean ``loss`` is weighted by ``images`` and stays on the device."""
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), device=loss.device)
        self._loss_sum += loss.detach() * images
        self.images += images
        self.wait += wait

    def sync(self) -> None:
        """Bring the loss sum to the host and the clock up to now: a device sync, so every ``log_every``
        micro-batches and before a checkpoint, not every step."""
        if self._loss_sum is not None:
            self.loss += self._loss_sum.item()
            self._loss_sum.zero_()
        self._folded = self.images
        now = time.perf_counter()
        self.time += now - self._tick
        self._tick = now

    def peek(self) -> Meter:
        """For the progress line between two :meth:`sync`: the images, the wait and the clock as of now, and the mean
        loss as of the last sync (NaN before the first: shown as ``-``). No host sync, and this meter is left as it
        is: its loss is folded every ``log_every`` batches, which decides the logged loss to the last bit."""
        mean = self.loss / self._folded if self._folded else float("nan")
        return Meter(mean * self.images, self.images, self.wait, self.time + time.perf_counter() - self._tick)

    def state_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "images": self.images, "wait": self.wait, "time": self.time, "startup": self.startup}


REFRESH_S = 0.5  # the longest the progress shown lags behind the run, batches allowing


class RunLogger:
    def __init__(self, out: Path, *, enabled: bool, total: int, world_size: int = 1):
        self.enabled, self.out, self.total, self.world_size = enabled, out, total, world_size
        self.console = Console(stderr=True)
        if not self.console.is_terminal:
            self.console = Console(stderr=True, soft_wrap=True)
        self._tb: SummaryWriter | None = None
        self._progress: Progress | None = None
        self._epoch, self._next_line, self._printed = 0, 0, -1  # _printed: the batch of the last line in a file
        self._shown = time.monotonic()  # when the progress was last refreshed
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / "tb"))
            except ImportError:
                self.console.print(
                    "[yellow]tensorboard is not installed: no TensorBoard logs (pip install tensorboard)[/]"
                )

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False)

    def start_epoch(self, epoch: int, first: int) -> None:
        if not self.enabled:
            return
        self._epoch, self._next_line, self._printed = epoch, first, -1
        if not self.console.is_terminal:
            return
        self._progress = Progress(
            TextColumn(f"epoch {epoch}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total, completed=first, stats="")

    def due(self) -> bool:
        """Whether the progress shown is :data:`REFRESH_S` old: the loop then refreshes it between its ``log_every``
        updates (each batch, when batches are slower), so that it never lags far behind the run."""
        return self.enabled and time.monotonic() - self._shown >= REFRESH_S

    def progress(
        self, done: int, meter: Meter, lr: float, step: int, *, scalars: bool = True, now: bool = False
    ) -> None:
        """After ``done`` micro-batches of the epoch and ``step`` optimizer steps of the run; ``scalars``: TensorBoard's
        too (every ``log_every``); ``now``: a line in a file or pipe even between its tenths of an epoch (a stop)."""
        if not self.enabled:
            return
        self._shown = time.monotonic()
        ips = meter.images / max(meter.time, 1e-9)
        wait = meter.wait / max(meter.time, 1e-9)
        loss = meter.loss / max(meter.images, 1)
        rank = " (rank 0)" if self.world_size > 1 else ""
        shown = f"{loss:.3f}" if math.isfinite(loss) else "-"  # not finite: a peek before the first sync
        stats = f"loss {shown}  {ips:,.0f} img/s{rank}  data-wait {wait:.0%}{rank}  lr {lr:.3g}"
        if self._progress is not None:
            self._progress.update(self._task, completed=done, stats=stats)
        elif done >= self._next_line or (now and done != self._printed):
            self.console.print(f"epoch {self._epoch}  {done}/{self.total}  {stats}", highlight=False)
            self._next_line, self._printed = done + max(1, self.total // 10), done
        if self._tb is not None and scalars:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            self._tb.add_scalar("train/images_per_s", ips, step)
            self._tb.add_scalar("train/data_wait", wait, step)

    def end_epoch(self, metrics: dict, hint: str | None, skipped: Sequence[tuple[str, str, str]] = ()) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        if self.world_size > 1:
            parts.append(f"(images_per_s, data_wait: all {self.world_size} ranks)")
        self.console.print("  ".join(parts), highlight=False)
        if skipped:
            self._list_skipped(metrics["epoch"], skipped)
        if hint:
            self.console.print(f"[yellow]{hint}[/]")
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "epoch" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"epoch/{k}", v, metrics["epoch"])
            self._tb.flush()

    def _list_skipped(self, epoch: int, skipped: Sequence[tuple[str, str, str]]) -> None:
        """All of them (path, reason, ``"train"`` or ``"val"``) in skipped.txt (epoch, path, reason, train or val;
        names escaped: one record per line, see ``_names``), the first 20 on the console."""
        counts = Counter(split for *_, split in skipped)
        where = ", ".join(f"{counts[split]} in {name}" for split, name in _SPLITS.items() if counts[split])
        self.console.print(
            f"[yellow]{len(skipped)} unreadable file(s) skipped this epoch ({where}; listed in "
            f"{self.out / 'skipped.txt'}):[/]"
        )
        lines = [(escape(path), escape(reason), split) for path, reason, split in skipped]
        with open(self.out / "skipped.txt", "a", encoding="utf-8") as f:
            f.writelines(f"{epoch}\t{path}\t{reason}\t{split}\n" for path, reason, split in lines)
        for path, reason, split in lines[:20]:
            self.console.print(f"  {_SPLITS[split]}: skipped {path}: {reason}", highlight=False, markup=False)
        if len(skipped) > 20:
            self.console.print(f"  ... and {len(skipped) - 20} more")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
