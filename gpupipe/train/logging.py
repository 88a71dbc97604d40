"""What a run shows and keeps: progress (rank 0), TensorBoard scalars, ``metrics.jsonl`` per epoch, ``skipped.txt``.

On a terminal the progress is a live bar; in a file or pipe it is whole lines (never wrapped at 80 columns), one
every tenth of an epoch. Under DDP the bar's img/s are rank 0's own; the epoch summary's are all ranks'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunLogger:
    def __init__(self, out: Path, *, enabled: bool, total: int, world_size: int = 1):
        self.enabled, self.out, self.total, self.world_size = enabled, out, total, world_size
        self.console = Console(stderr=True)
        if not self.console.is_terminal:
            self.console = Console(stderr=True, soft_wrap=True)
        self._tb = None
        self._progress = None
        self._epoch, self._next_line = 0, 0
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
        self._epoch, self._next_line = epoch, first
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

    def progress(self, done: int, running: dict, lr: float, step: int) -> None:
        if not self.enabled:
            return
        ips = running["images"] / max(running["time"], 1e-9)
        wait = running["wait"] / max(running["time"], 1e-9)
        loss = running["loss"] / max(running["images"], 1)
        rank = " (rank 0)" if self.world_size > 1 else ""
        stats = f"loss {loss:.3f}  {ips:,.0f} img/s{rank}  data-wait {wait:.0%}{rank}  lr {lr:.3g}"
        if self._progress is not None:
            self._progress.update(self._task, completed=done, stats=stats)
        elif done >= self._next_line:
            self.console.print(f"epoch {self._epoch}  {done}/{self.total}  {stats}", highlight=False)
            self._next_line = done + max(1, self.total // 10)
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            self._tb.add_scalar("train/images_per_s", ips, step)
            self._tb.add_scalar("train/data_wait", wait, step)

    def end_epoch(self, metrics: dict, hint: str | None, skipped: Sequence[tuple[str, str]] = ()) -> None:
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
            self.console.print(
                f"[yellow]{len(skipped)} unreadable file(s) skipped this epoch (listed in "
                f"{self.out / 'skipped.txt'}):[/]"
            )
            with open(self.out / "skipped.txt", "a") as f:
                f.writelines(f"{metrics['epoch']}\t{path}\t{reason}\n" for path, reason in skipped)
            for path, reason in skipped[:20]:
                self.console.print(f"  skipped {path}: {reason}", highlight=False, markup=False)
            if len(skipped) > 20:
                self.console.print(f"  ... and {len(skipped) - 20} more")
        if hint:
            self.console.print(f"[yellow]{hint}[/]")
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "epoch" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"epoch/{k}", v, metrics["epoch"])
            self._tb.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
