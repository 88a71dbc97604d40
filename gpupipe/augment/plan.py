"""A batch's draws as columns: each sample's random numbers come from a counter-based hash (:mod:`gpupipe.draws`),
so a whole batch is drawn with a few array ops and a sample's draws never depend on its batch, its worker or how
many samples came before it (resume stays exact); the ops drawn are held per position in the samples' records
(:class:`Column`), the form the kernels take them in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .ops import Op, Record


def normals(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Standard normals from two uniforms (Box-Muller)."""
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


class Column(NamedTuple):
    """The ops at one position of a batch's records: ``code[i]`` indexes ``names`` (-1: sample i has none here),
    ``args[i, :arity[code]]`` its arguments."""

    names: tuple[str, ...]
    arity: tuple[int, ...]
    code: np.ndarray  # (N,) int64
    args: np.ndarray  # (N, k) float64


def records(columns: Sequence[Column], n: int) -> list[Record]:
    """The columns as one record per sample (its ops in order, the absent ones left out)."""
    out: list[list[Op]] = [[] for _ in range(n)]
    for col in columns:
        for i in np.flatnonzero(col.code >= 0).tolist():
            c = int(col.code[i])
            out[i].append(Op(col.names[c], tuple(col.args[i, : col.arity[c]].tolist())))
    return [tuple(r) for r in out]


def from_records(recs: Sequence[Record]) -> list[Column]:
    """Per-sample records as columns: column k holds each sample's k-th op."""
    columns = []
    for k in range(max((len(r) for r in recs), default=0)):
        ops = [r[k] if k < len(r) else None for r in recs]
        names = tuple(sorted({op.name for op in ops if op is not None}))
        arity = {op.name: len(op.args) for op in ops if op is not None}
        width = max(arity.values())
        code = np.full(len(recs), -1, np.int64)
        args = np.zeros((len(recs), width), np.float64)
        for i, op in enumerate(ops):
            if op is not None:
                code[i] = names.index(op.name)
                args[i, : len(op.args)] = op.args
        columns.append(Column(names, tuple(arity[n] for n in names), code, args))
    return columns
