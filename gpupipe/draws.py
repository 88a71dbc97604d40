"""Counter-based random numbers for per-sample draws: each sample's numbers come from a hash (splitmix64) of its key
``(seed, epoch, index)``, a stream number and a counter. A whole batch is drawn with a few array ops, and a sample
draws the same numbers whatever batch, worker, rank or backend asks for it, so resume stays exact. One stream per
drawer (the crop, each augmentation), so adding a drawer leaves the others' numbers as they were."""

from __future__ import annotations

import numpy as np

STREAM_CROP, STREAM_AUTO_AUGMENT, STREAM_ERASING = 0, 1, 2

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _C1
    x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


def sample_keys(seed: int, epochs, indices) -> np.ndarray:
    """(N,) uint64: the key of each sample ``(seed, epochs[i], indices[i])`` (``epochs``: one for all, or one each)."""
    base = np.array([seed & _M64], np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(base + _mix(np.asarray(epochs, np.int64).astype(np.uint64) + _GOLDEN))
        return _mix(key + np.asarray(indices, np.int64).astype(np.uint64).reshape(-1))


def uniforms(keys: np.ndarray, stream: int, count: int, skip: int = 0) -> np.ndarray:
    """(N, count) float64 uniforms in [0, 1), 53 bits each: numbers ``skip`` to ``skip + count - 1`` of each sample's
    ``stream`` (counters ``stream * 2**32 + skip + 1, ...`` of its key): any of them can be drawn on its own."""
    counters = (np.arange(skip + 1, skip + count + 1, dtype=np.uint64) + np.uint64(stream << 32)) * _GOLDEN
    with np.errstate(over="ignore"):
        bits = _mix(keys[:, None] + counters[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
