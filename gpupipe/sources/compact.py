"""Sample lists without a Python object per sample: every path in one UTF-8 buffer with an offsets array, labels in
an int64 array. A list of ``(path, label)`` tuples costs ~170 bytes a sample in objects whose reference counts
every forked DataLoader worker writes as it reads them, copying the pages they sit on: at ImageNet's 1.28M files
that grows each worker's private memory by hundreds of MB (bench/results/imagenet_size_memory.json). Arrays are
read, never written, so the workers keep sharing them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

_SEP = "\0"  # no path holds a NUL


class SampleList(Sequence):
    """``(name, label)`` per sample, made on access from arrays (``labels`` and what :meth:`name` reads); equal to the
    list of tuples it stands for, and unhashable as that list is."""

    labels: np.ndarray

    def name(self, i: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        label = int(self.labels[i])  # IndexError past the end, as a list
        return self.name(int(i) % len(self)), label

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Sequence)
            and len(other) == len(self)
            and all(tuple(b) == a for a, b in zip(self, other, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]


class PathList(SampleList):
    """A folder's or CSV list's ``(path, label)`` per sample: every path in one UTF-8 buffer with an offsets array."""

    def __init__(self, paths: Sequence[str], labels: Iterable[int]):
        data = "".join(p + _SEP for p in paths).encode("utf-8", "surrogateescape")
        self._buf = np.frombuffer(data, np.uint8)
        self._starts = np.concatenate([[0], np.flatnonzero(self._buf == 0) + 1]).astype(np.int64)  # n + 1 of them
        self.labels = np.fromiter(labels, np.int64, count=len(paths))

    def name(self, i: int) -> str:
        return self._buf[self._starts[i] : self._starts[i + 1] - 1].tobytes().decode("utf-8", "surrogateescape")

    def path_bytes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The paths' buffer (uint8; each path's bytes as ``os.fsencode`` gives them, then a NUL), each path's start
        and its length (int64): read, never written (DALI's file reader takes rows of it)."""
        return self._buf, self._starts[:-1], np.diff(self._starts) - 1
