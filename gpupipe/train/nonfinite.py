"""Stop a run whose loss is no longer a number, before it saves weights that are.

Each micro-batch's "is the loss finite" flag stays on the device; the loop reads them where it syncs anyway (every
``log_every`` micro-batches, at the epoch's end, before a checkpoint), so watching costs no host sync per step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import GpupipeError


class NonFiniteLossError(GpupipeError):
    """The loss became NaN or infinite: the run stopped, and saved nothing after its last finite step."""


class LossWatch:
    """The micro-batches since the last check: (batch index, optimizer step it belongs to, finite flag)."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, int, torch.Tensor]] = []

    def add(self, batch: int, step: int, loss: torch.Tensor) -> None:
        self._pending.append((batch, step, torch.isfinite(loss.detach())))

    def check(self, epoch: int, checkpoint: Path) -> None:
        """Raise :class:`NonFiniteLossError` naming the first micro-batch whose loss was not finite, if any."""
        if not self._pending:
            return
        finite = torch.stack([flag for _, _, flag in self._pending]).cpu()
        pending, self._pending = self._pending, []
        if bool(finite.all()):
            return
        batch, step, _ = pending[int((~finite).nonzero()[0])]
        fixes = "Lower --lr, set --clip, or use fp32/bf16"
        if checkpoint.exists():
            then = f"the last good checkpoint is {checkpoint}. {fixes}, then --resume (with --allow-config-change) or "
            then += "start again"
        else:  # nothing to resume: the same command, changed, starts the run afresh in the same --out
            then = f"no checkpoint was saved yet, so there is nothing to resume. {fixes}, and start the run again"
        raise NonFiniteLossError(
            f"the loss is not finite (NaN or inf) at optimizer step {step} (epoch {epoch}, batch {batch}): "
            f"training stopped and saved nothing more; {then}"
        )
