"""MixUp and CutMix on a device batch, with soft targets: timm's ``Mixup`` semantics, public as ``gpupipe.Mix``."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from .plumbing.host_pack import HostPack


def soft_targets(
    labels: torch.Tensor, num_classes: int, lam: float | torch.Tensor = 1.0, smoothing: float = 0.0
) -> torch.Tensor:
    """Smoothed one-hot targets mixed with the reversed batch's: ``y * lam + y.flip(0) * (1 - lam)`` (timm's
    ``mixup_target``). Each row sums to 1."""
    off = smoothing / num_classes
    y = torch.full((len(labels), num_classes), off, device=labels.device)
    y.scatter_(1, labels.long().view(-1, 1), 1.0 - smoothing + off)
    return y * lam + y.flip(0) * (1.0 - lam)


def _blend(a: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
    """MixUp's ``a * lam + b * (1 - lam)``, in ``a``'s dtype: uint8 images (``normalize=False``) rounded, as timm's
    ``FastCollateMixup`` does, so a batch stays uint8 whichever of MixUp and CutMix it got."""
    if a.is_floating_point():
        return a * lam + b * (1.0 - lam)
    return (a.float() * lam + b.float() * (1.0 - lam)).round_().to(a.dtype)


class Mix:
    """``Mix(...)(images, labels) -> (images, targets)``: MixUp or CutMix with the reversed batch as partner.

    Args:
        mixup_alpha: Beta(alpha, alpha) for MixUp's lambda; 0 turns MixUp off.
        cutmix_alpha: Beta(alpha, alpha) for CutMix's lambda; 0 turns CutMix off.
        prob: probability of mixing a batch (``mode="batch"``) or an element (``"elem"``).
        switch_prob: with both on, the probability of CutMix rather than MixUp.
        mode: ``"batch"``: one lambda for the batch (timm's default); ``"elem"``: one per image.
        label_smoothing: as timm's (0.1 by default there).
        num_classes: the targets' width.
        correct_lam: CutMix's lambda from the box actually pasted (clipped at the borders), as timm.
        seed: seeds this object's own stream (numpy ``RandomState``, drawn in timm's order); ``None`` seeds from
            the OS. ``set_key(...)`` restarts it at any key.

    Images are float (normalized) batches on any device, or uint8 ones (``normalize=False``), which stay uint8 (a
    MixUp blend rounded); they are not modified in place. The batch size must be even, as timm requires.
    """

    def __init__(
        self,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: Literal["batch", "elem"] = "batch",
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        correct_lam: bool = True,
        seed: int | None = None,
    ):
        if mixup_alpha < 0 or cutmix_alpha < 0 or mixup_alpha == cutmix_alpha == 0:
            raise ValueError(f"mixup_alpha and cutmix_alpha must be >= 0, one > 0; got {mixup_alpha}, {cutmix_alpha}")
        if mode not in ("batch", "elem"):
            raise ValueError(f"mode must be 'batch' or 'elem', got {mode!r}")
        if not 0 <= prob <= 1 or not 0 <= switch_prob <= 1:
            raise ValueError(f"prob and switch_prob must be in [0, 1], got {prob}, {switch_prob}")
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.prob, self.switch_prob, self.mode = prob, switch_prob, mode
        self.label_smoothing, self.num_classes, self.correct_lam = label_smoothing, num_classes, correct_lam
        self._rng = np.random.RandomState(seed)

    def set_key(self, *key: int) -> None:
        """Restart this object's stream at ``key`` (the training loop's: seed, epoch, batch, rank), so that what it
        draws next depends on the key alone, not on what it drew before: a resumed run mixes as the straight one."""
        self._rng.seed(list(key))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(images) % 2:
            raise ValueError(f"Mix needs an even batch size, got {len(images)}")
        if labels.device.type == "cpu" and len(labels):  # on a GPU the check would wait for it: scatter_ asserts there
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= self.num_classes:
                raise ValueError(
                    f"Mix(num_classes={self.num_classes}) got labels {low}..{high}: each in [0, {self.num_classes})"
                )
        images, lam = self._mix_batch(images) if self.mode == "batch" else self._mix_elem(images)
        return images, soft_targets(labels, self.num_classes, lam, self.label_smoothing)

    def _lambda(self, cutmix: bool) -> float:
        a = self.cutmix_alpha if cutmix else self.mixup_alpha
        return float(self._rng.beta(a, a))

    def _box(self, h: int, w: int, lam: float) -> tuple[tuple[int, int, int, int], float]:
        """timm's ``rand_bbox`` + lambda correction: a box of area ~(1 - lam) centred anywhere, clipped."""
        ratio = np.sqrt(1 - lam)
        cut_h, cut_w = int(h * ratio), int(w * ratio)
        cy, cx = self._rng.randint(0, h), self._rng.randint(0, w)
        yl, yh = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + (cut_h + 1) // 2, 0, h)
        xl, xh = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + (cut_w + 1) // 2, 0, w)
        if self.correct_lam:
            lam = 1.0 - (yh - yl) * (xh - xl) / float(h * w)
        return (int(yl), int(yh), int(xl), int(xh)), lam

    def _mix_batch(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self._rng.rand() >= self.prob:
            return x, 1.0
        both = self.mixup_alpha > 0 and self.cutmix_alpha > 0
        cutmix = self._rng.rand() < self.switch_prob if both else self.cutmix_alpha > 0
        lam = self._lambda(cutmix)
        if lam == 1.0:
            return x, 1.0
        if cutmix:
            (yl, yh, xl, xh), lam = self._box(x.shape[-2], x.shape[-1], lam)
            out = x.clone()
            out[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
            return out, lam
        return _blend(x, x.flip(0), lam), lam

    def _mix_elem(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(x)
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cutmix = self._rng.rand(n) < self.switch_prob
            lam = np.where(
                cutmix,
                self._rng.beta(self.cutmix_alpha, self.cutmix_alpha, size=n),
                self._rng.beta(self.mixup_alpha, self.mixup_alpha, size=n),
            )
        else:
            cutmix = np.full(n, self.cutmix_alpha > 0)
            a = self.cutmix_alpha if self.cutmix_alpha > 0 else self.mixup_alpha
            lam = self._rng.beta(a, a, size=n)
        lam = np.where(self._rng.rand(n) < self.prob, lam.astype(np.float32), np.ones(n, np.float32))
        out, partner = x.clone(), x.flip(0)
        for i in range(n):
            if lam[i] == 1.0:
                continue
            if cutmix[i]:
                (yl, yh, xl, xh), lam[i] = self._box(x.shape[-2], x.shape[-1], lam[i])
                out[i, :, yl:yh, xl:xh] = partner[i, :, yl:yh, xl:xh]
            else:
                out[i] = _blend(x[i], partner[i], float(lam[i]))
        pack = HostPack()  # one non-blocking copy from pinned memory: torch.tensor(lam, device=) would block the host
        slot = pack.add(lam, torch.float32)
        pack.send(x.device)
        lam_dtype = x.dtype if x.is_floating_point() else torch.float32  # uint8 images: lambdas of 0 or 1 were given
        return out, pack.get(slot).to(lam_dtype).unsqueeze(1)
