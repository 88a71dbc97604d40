"""CTAugment, the adaptive policy of ReMixMatch (Berthelot et al. 2019) as FixMatch uses it: weights per magnitude
bin, per-image draws from them, and the feedback that moves them.

The op list, bin counts, level maps and rules are FixMatch's ``libml/ctaugment.py`` (google-research/fixmatch):

- 19 ops; ``identity`` has no magnitude, ``posterize`` 8 bins, ``rescale`` 17 scale bins and 6 method bins, every
  other op 17 bins. Every bin's rate starts at 1.
- Drawing (the strong augmentation): each of ``depth`` layers picks an op uniformly, then for each of its magnitudes
  a bin with probability proportional to ``p = rate + (1 - decay); p /= max(p); p[p < threshold] = 0``, and a level
  uniformly inside the bin: ``(bin + u) / bins``. Bins under the threshold are never drawn; the best bin always is
  drawable.
- Probing: the op uniformly and every level uniformly in [0, 1), the ops and levels recorded.
- Feedback: for each probe image and each level it used, ``bin = int(level * bins * 0.999)`` and
  ``rate[bin] = decay * rate[bin] + (1 - decay) * proximity``, image by image, where proximity is the model's score
  of the probe image (FixMatch: ``1 - 0.5 * |softmax - onehot|_1``, :func:`proximity`; ReMixMatch: 0/1 accuracy).
  Under DDP the ranks' records are gathered and applied in rank order, so every rank ends with the same rates.

Defaults are FixMatch's flags: ``depth`` 2, ``decay`` 0.99, ``threshold`` 0.80. Draws come from the sample's own
stream ``random.Random(f"{seed}/{epoch}/{index}/aug")`` and the weights snapshot the batch was given
(:class:`CTWeights`), so a draw is a function of (seed, epoch, index, weights): the same in a decode worker and on
the device. Its own ops' pixel maths are ``ct_*`` in :mod:`.kernels`; the others are gpupipe's kernels with
FixMatch's arguments (geometric ops nearest, filled with black: PIL's defaults in FixMatch's ``rotate``/``transform``).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from functools import cached_property
from typing import NamedTuple

import torch

from ..ops import Op
from ..parse import CTAugmentConfig, parse_ctaugment
from .update import PendingUpdate, gather_rows, score_rows

CT_OPS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("autocontrast", (17,)),
    ("blur", (17,)),
    ("brightness", (17,)),
    ("color", (17,)),
    ("contrast", (17,)),
    ("cutout", (17,)),
    ("equalize", (17,)),
    ("invert", (17,)),
    ("identity", ()),
    ("posterize", (8,)),
    ("rescale", (17, 6)),
    ("rotate", (17,)),
    ("sharpness", (17,)),
    ("shear_x", (17,)),
    ("shear_y", (17,)),
    ("smooth", (17,)),
    ("solarize", (17,)),
    ("translate_x", (17,)),
    ("translate_y", (17,)),
)
_OP_INDEX = {name: k for k, (name, _) in enumerate(CT_OPS)}
_MAX_LEVELS = max(len(b) for _, b in CT_OPS)


def _segments() -> tuple[tuple[int, ...], ...]:
    """Each op's magnitudes' offsets into the flat rate vector."""
    out, at = [], 0
    for _, bins in CT_OPS:
        out.append(tuple(at + sum(bins[:j]) for j in range(len(bins))))
        at += sum(bins)
    return tuple(out)


_OFFSETS = _segments()
NUM_RATES = sum(sum(b) for _, b in CT_OPS)

# FixMatch's rescale methods (PIL's ANTIALIAS, BICUBIC, BILINEAR, BOX, HAMMING, NEAREST) as grid_sample's modes
_RESCALE_OPS = tuple(f"CtRescale{m}" for m in ("Bicubic", "Bicubic", "Bilinear", "Nearest", "Bilinear", "Nearest"))

# One layer of one image's record: the op and its levels in [0, 1) (FixMatch's ``OP(k, [levels])``).
CTLayer = tuple[str, tuple[float, ...]]
CTRecord = tuple[CTLayer, ...]


class CTWeights:
    """A snapshot of the rates: what one batch draws from. Immutable and small (303 floats), so it travels with the
    batch's keys to the decode workers; its drawing tables are built once per process that unpickles it."""

    def __init__(self, rates: Sequence[float], decay: float, threshold: float):
        self.rates = tuple(float(r) for r in rates)
        self.decay, self.threshold = decay, threshold
        if len(self.rates) != NUM_RATES:
            raise ValueError(f"CTAugment has {NUM_RATES} rates, got {len(self.rates)}")

    def __getstate__(self) -> dict:
        return {"rates": self.rates, "decay": self.decay, "threshold": self.threshold}  # not the cached tables

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def probabilities(self, op: str, level: int = 0) -> list[float]:
        """FixMatch's ``rate_to_p``: the drawing weights of the bins of ``op``'s ``level``-th magnitude (max 1)."""
        at, n = _OFFSETS[_OP_INDEX[op]][level], CT_OPS[_OP_INDEX[op]][1][level]
        p = [r + (1 - self.decay) for r in self.rates[at : at + n]]
        top = max(p)
        return [v / top if v / top >= self.threshold else 0.0 for v in p]

    @cached_property
    def _tables(self) -> dict[int, tuple[list[int], list[float]]]:
        """Per magnitude (keyed by offset): the drawable bins and their cumulative weights."""
        out = {}
        for (name, bins), offsets in zip(CT_OPS, _OFFSETS, strict=True):
            for j, at in enumerate(offsets):
                p = self.probabilities(name, j)
                keep = [b for b in range(bins[j]) if p[b] > 0]
                cum, total = [], 0.0
                for b in keep:
                    total += p[b]
                    cum.append(total)
                out[at] = (keep, cum)
        return out

    def pick(self, offset: int, u: float) -> int:
        """The bin that ``u`` in [0, 1) selects; only drawable bins have an interval, so no other is ever picked."""
        keep, cum = self._tables[offset]
        return keep[min(bisect.bisect_right(cum, u * cum[-1]), len(keep) - 1)]


class CTDraw(NamedTuple):
    """One image's draw: the record the feedback uses and the ops the kernels apply."""

    record: CTRecord
    ops: tuple[Op, ...]


class CTAugment:
    """The weights and their feedback; one object the user holds (``loader.ctaugment`` of a ``"ctaugment"`` loader).

    Args:
        size: the side of the (square) images it augments (cutout's box and the translations scale with it).
        depth: ops per image (FixMatch's ``adepth``).
        decay: the rates' moving-average decay (``adecay``).
        threshold: bins whose normalised weight is under it are not drawn (``ath``).
        probe: draw uniformly (the probe batch), ignoring the weights.
    """

    def __init__(self, size: int = 224, depth: int = 2, decay: float = 0.99, threshold: float = 0.8, probe=False):
        CTAugmentConfig(depth, decay, threshold, probe)  # checks the values
        self.size, self.depth, self.decay, self.threshold, self.probe = size, depth, decay, threshold, probe
        self._rates = [1.0] * NUM_RATES
        self._snapshot: CTWeights | None = None
        self._pending: PendingUpdate | None = None  # an update(defer=True) not applied yet

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pending": None}  # a worker draws; it never applies an update

    @property
    def rates(self) -> list[float]:
        """Every bin's rate, op by op in ``CT_OPS`` order (a copy: change them with ``update`` or by assigning)."""
        return list(self._rates)

    @rates.setter
    def rates(self, values: Sequence[float]) -> None:
        if len(values) != NUM_RATES:
            raise ValueError(f"CTAugment has {NUM_RATES} rates, got {len(values)}")
        self._rates, self._snapshot = [float(v) for v in values], None

    @classmethod
    def from_config(cls, config: CTAugmentConfig, size: int = 224) -> CTAugment:
        return cls(size, config.depth, config.decay, config.threshold, config.probe)

    @classmethod
    def from_string(cls, config: str, size: int = 224) -> CTAugment:
        """``"ctaugment"`` with timm-style sections: ``-d0.99`` decay, ``-t0.8`` threshold, ``-n2`` ops per image,
        ``-probe`` the probe draw (e.g. ``"ctaugment-d0.99-t0.8-n2"``)."""
        if config.lower().split("-")[0] != "ctaugment":
            raise ValueError(f"not a ctaugment string: {config!r}")
        return cls.from_config(parse_ctaugment(config), size)

    @property
    def active(self) -> bool:
        return True

    # ---- the weights: snapshots, feedback, state ---------------------------------------------------------------
    def weights(self) -> CTWeights:
        """The current rates as an immutable snapshot (the same object until the rates change)."""
        if self._snapshot is None:
            self._snapshot = CTWeights(self._rates, self.decay, self.threshold)
        return self._snapshot

    def update(
        self,
        records: Sequence[CTRecord],
        proximity,
        *,
        distributed: bool | None = None,
        defer: bool = False,
        capacity: int | None = None,
    ) -> None:
        """Move each bin the probe records used toward its image's score (FixMatch's ``update_rates``).

        Args:
            records: one record per probe image (a ``"ctaugment-probe"`` loader's ``records`` of its last batch).
            proximity: one score per image in [0, 1]: :func:`proximity`, or 0/1 correctness (bools work).
            distributed: gather every rank's records and apply them all, in rank order, on every rank (all ranks
                must call it together); ``None``: when ``torch.distributed`` is initialised with several ranks.
            defer: apply this update at the next deferred one, and the one before it now: the scores (on the GPU)
                travel to the host meanwhile, so the host never waits for the GPU to compute them. The update
                waiting is part of :meth:`state_dict`, so a resumed run applies it where the straight one does.
            capacity: at most this many records per rank (the probe batch size): the ranks' records are then
                gathered in one collective, with no host wait for their counts.
        """
        codes = encode_records(records, self.depth)
        scores = torch.as_tensor(proximity).detach().reshape(-1)
        if len(scores) != len(codes):
            raise ValueError(f"update got {len(codes)} records and {len(scores)} scores")
        dist = torch.distributed
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rows = score_rows(codes, scores)
        if distributed:
            rows = gather_rows(rows, capacity)
        if not defer:
            self._apply(rows.cpu())
            return
        previous, self._pending = self._pending, PendingUpdate(rows)
        if previous is not None:
            self._apply(previous.rows())

    def _apply(self, rows: torch.Tensor) -> None:
        """Rows of :func:`.ctupdate.score_rows` (on the host), in order; a row of -1 codes (a rank's padding)
        moves nothing."""
        codes, scores = rows[:, :-1], rows[:, -1].contiguous().view(torch.float64)
        rates, d = self._rates, self.decay
        for row, s in zip(codes.tolist(), scores.tolist(), strict=True):
            for at in row:
                if at >= 0:
                    rates[at] = rates[at] * d + s * (1 - d)
        self._snapshot = None

    def state_dict(self) -> dict:
        state = {"rates": torch.tensor(self._rates, dtype=torch.float64), "decay": self.decay, "depth": self.depth}
        if self._pending is not None:
            state["pending"] = self._pending.rows().clone()  # the host waits here, at a checkpoint, not every step
        return state

    def load_state_dict(self, state: dict) -> None:
        rates = torch.as_tensor(state["rates"], dtype=torch.float64).reshape(-1)
        if len(rates) != NUM_RATES:
            raise ValueError(f"a ctaugment state holds {NUM_RATES} rates, this one {len(rates)}")
        self.rates = rates.tolist()
        pending = state.get("pending")
        self._pending = None if pending is None else PendingUpdate(torch.as_tensor(pending, dtype=torch.int64))

    def stats(self) -> str:
        """The drawing weights, one line per op (FixMatch's ``stats``)."""
        w = self.weights()
        lines = []
        for name, bins in CT_OPS:
            parts = (" ".join(f"{v:.2f}" for v in w.probabilities(name, j)) for j in range(len(bins)))
            lines.append(f"{name:<16}{' / '.join(parts)}")
        return "\n".join(lines)

    # ---- drawing ----------------------------------------------------------------------------------------------
    def draw(self, rng: random.Random, weights: CTWeights | None = None, size: int | None = None) -> list[Op]:
        """The ops of one image from the sample's stream (the interface every policy has); ``weights``: the batch's
        snapshot (default: the current rates); ``size``: the image's side, when not ``self.size`` (an epoch of a
        resolution schedule)."""
        return list(self._choose(rng, weights, size).ops)

    def choose(self, seed: int, epoch: int, index: int, weights: CTWeights | None = None) -> CTDraw:
        """Sample ``(seed, epoch, index)``'s record and ops, as the recipe's policy draws them (CTAugment comes first
        in the sample's stream)."""
        return self._choose(random.Random(f"{seed}/{epoch}/{index}/aug"), weights)

    def _choose(self, rng: random.Random, weights: CTWeights | None, size: int | None = None) -> CTDraw:
        w = None if self.probe else weights or self.weights()
        record: list[CTLayer] = []
        ops: list[Op] = []
        for _ in range(self.depth):
            k = rng.randrange(len(CT_OPS))
            name, bins = CT_OPS[k]
            levels = []
            for j, n in enumerate(bins):
                u = rng.random()
                levels.append(u if w is None else (w.pick(_OFFSETS[k][j], rng.random()) + u) / n)
            record.append((name, tuple(levels)))
            op = _to_op(name, levels, rng, size or self.size)
            if op is not None:
                ops.append(op)
        return CTDraw(tuple(record), tuple(ops))

    def records(self, seed: int, keys: Sequence[tuple[int, int]]) -> list[CTRecord]:
        """The records of the samples ``keys`` ((epoch, index) pairs), as drawn (probe draws need no weights)."""
        return [self.choose(seed, e, i).record for e, i in keys]


def _to_op(name: str, levels: Sequence[float], rng: random.Random, size: int) -> Op | None:
    """FixMatch's level maps, as arguments of gpupipe's kernels (``Ct*`` ops are CTAugment's own)."""
    v = levels[0] if levels else 0.0
    if name == "identity":
        return None
    if name in ("autocontrast", "equalize", "invert", "blur", "smooth"):
        return Op(f"Ct{name.capitalize()}", (v,))  # blended with the image at ``level``
    if name in ("brightness", "color", "contrast", "sharpness"):
        return Op(name.capitalize(), (0.1 + 1.9 * v,))
    if name == "cutout":
        # a box of side ~ level * size / 2 around a random centre, cut at the border, grey 127
        half = (1 + int(v * size * 0.499)) // 2
        cy, cx = rng.randrange(size), rng.randrange(size)
        return Op("CtCutout", (max(0, cy - half), max(0, cx - half), min(size, cy + half), min(size, cx + half)))
    if name == "posterize":
        return Op("Posterize", (float(1 + int(v * 7.999)),))
    if name == "solarize":
        return Op("Solarize", (float(int(v * 255.999)),))
    if name == "rescale":
        return Op(_RESCALE_OPS[int(levels[1] * 5.99)], (v * 0.25,))
    if name == "rotate":
        return Op("Rotate", (float(round((2 * v - 1) * 45)),))
    if name in ("shear_x", "shear_y"):
        return Op("ShearX" if name == "shear_x" else "ShearY", ((2 * v - 1) * 0.3,))
    # translate: (2 * level - 1) * 0.3 of the side (FixMatch passes the fraction as pixels to PIL, a slip that
    # makes it a sub-pixel shift; ReMixMatch's paper means the fraction of the image)
    return Op("TranslateXRel" if name == "translate_x" else "TranslateYRel", ((2 * v - 1) * 0.3,))


def encode_records(records: Sequence[CTRecord], depth: int) -> torch.Tensor:
    """(N, depth * 2) int64: the offsets of the rates each record's levels fall in (-1: none), FixMatch's
    ``int(level * bins * 0.999)``."""
    out = torch.full((len(records), depth * _MAX_LEVELS), -1, dtype=torch.int64)
    for i, record in enumerate(records):
        if len(record) > depth:
            raise ValueError(f"a record has {len(record)} ops, this policy draws {depth}")
        for layer, (name, levels) in enumerate(record):
            if name not in _OP_INDEX:
                raise ValueError(f"unknown ctaugment op {name!r} in a record; ops: {', '.join(_OP_INDEX)}")
            k = _OP_INDEX[name]
            for j, (level, n) in enumerate(zip(levels, CT_OPS[k][1], strict=True)):
                if not 0 <= level <= 1:
                    raise ValueError(f"a ctaugment level must be in [0, 1], got {level} for {name!r}")
                out[i, layer * _MAX_LEVELS + j] = _OFFSETS[k][j] + int(level * n * 0.999)
    return out
