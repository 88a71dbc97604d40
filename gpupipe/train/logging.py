"""What a run shows and keeps: a progress bar (rank 0), TensorBoard scalars, and ``metrics.jsonl`` per epoch."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunLogger:
    def __init__(self, out: Path, *, enabled: bool, total: int):
        self.enabled, self.out, self.total = enabled, out, total
        self.console = Console(stderr=True)
        self._tb = None
        self._progress = None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / "tb"))
            except ImportError:
                self.console.print("[yellow]tensorboard is not installed: no TensorBoard logs (pip install "
                                   '"gpupipe[train]")[/]')

    def start_epoch(self, epoch: int, first: int) -> None:
        if not self.enabled:
            return
        self._progress = Progress(TextColumn(f"epoch {epoch}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=self.console,
                                  transient=False)
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total, completed=first, stats="")

    def progress(self, done: int, running: dict, lr: float, step: int) -> None:
        if not self.enabled:
            return
        ips = running["images"] / max(running["time"], 1e-9)
        wait = running["wait"] / max(running["time"], 1e-9)
        loss = running["loss"] / max(running["images"], 1)
        self._progress.update(self._task, completed=done,
                              stats=f"loss {loss:.3f}  {ips:,.0f} img/s  data-wait {wait:.0%}  lr {lr:.3g}")
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            self._tb.add_scalar("train/images_per_s", ips, step)
            self._tb.add_scalar("train/data_wait", wait, step)

    def end_epoch(self, metrics: dict, hint: str | None) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        self.console.print("  ".join(parts))
        if metrics.get("skipped"):
            self.console.print(f"[yellow]{metrics['skipped']} unreadable file(s) skipped this epoch[/]")
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
