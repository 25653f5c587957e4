"""Sets of input row numbers as sorted, disjoint half-open ranges: what a resumed Ray job skips.

A job's input rows are numbered 0..N-1 (blank JSON lines skipped, as the local
reader counts them). A part file holds a block of rows that is nearly always one
contiguous run, so the rows done by a whole job are a few ranges per part, never
a Python set of N numbers: 100M rows in 25k parts are at most ~25k ranges.

    RowRanges.of_rows([3, 4, 5, 9])          ->  [3, 6) [9, 10)
    RowRanges.union([a, b, ...])             ->  merged, sorted
    ranges.within(0, 1000)                   ->  the part of the set a read task needs
    ranges.mask(np.array(rows))              ->  which of these rows are in the set
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class RowRanges:
    """An immutable set of non-negative integers stored as sorted, disjoint [start, end) ranges."""

    __slots__ = ("ends", "starts")

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        self.starts = starts  # int64 [K], strictly increasing
        self.ends = ends  # int64 [K], ends[i] > starts[i], ends[i] < starts[i + 1]

    @classmethod
    def empty(cls) -> RowRanges:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def of_rows(cls, rows: Iterable[int] | np.ndarray) -> RowRanges:
        """The ranges covering exactly `rows` (any order, repeats allowed)."""
        values = np.unique(np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64))
        if not len(values):
            return cls.empty()
        breaks = np.flatnonzero(np.diff(values) != 1) + 1  # where a new run starts
        starts = values[np.concatenate(([0], breaks))]
        ends = values[np.concatenate((breaks - 1, [len(values) - 1]))] + 1
        return cls(starts, ends)

    @classmethod
    def of_pairs(cls, pairs: Iterable[Sequence[int]]) -> RowRanges:
        """From [start, end) pairs in any order, overlapping or not (as read back from manifests)."""
        array = np.asarray([(int(a), int(b)) for a, b in pairs if int(b) > int(a)], dtype=np.int64).reshape(-1, 2)
        return cls._merged(array[:, 0], array[:, 1])

    @classmethod
    def union(cls, sets: Iterable[RowRanges]) -> RowRanges:
        items = list(sets)
        if not items:
            return cls.empty()
        return cls._merged(np.concatenate([s.starts for s in items]), np.concatenate([s.ends for s in items]))

    @classmethod
    def _merged(cls, starts: np.ndarray, ends: np.ndarray) -> RowRanges:
        if not len(starts):
            return cls.empty()
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        running_end = np.maximum.accumulate(ends)
        # a range opens a new run when it starts after every earlier range has ended (touching ranges merge)
        new_run = np.concatenate(([True], starts[1:] > running_end[:-1]))
        run_ids = np.cumsum(new_run) - 1
        merged_ends = np.zeros(int(run_ids[-1]) + 1, np.int64)
        np.maximum.at(merged_ends, run_ids, ends)
        return cls(starts[new_run].copy(), merged_ends)

    def __len__(self) -> int:
        """The number of rows in the set (not of ranges)."""
        return int((self.ends - self.starts).sum())

    @property
    def num_ranges(self) -> int:
        return len(self.starts)

    def pairs(self) -> list[list[int]]:
        """[[start, end], ...] as plain ints (JSON-ready)."""
        return [[int(a), int(b)] for a, b in zip(self.starts, self.ends)]

    def within(self, lo: int, hi: int) -> RowRanges:
        """The set intersected with [lo, hi)."""
        keep = (self.ends > lo) & (self.starts < hi)
        return RowRanges(np.maximum(self.starts[keep], lo), np.minimum(self.ends[keep], hi))

    def mask(self, rows: np.ndarray) -> np.ndarray:
        """bool [len(rows)]: whether each row number is in the set."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.num_ranges:
            return np.zeros(len(rows), bool)
        slot = np.searchsorted(self.starts, rows, side="right") - 1  # the last range starting at or before
        inside = slot >= 0
        inside[inside] = rows[inside] < self.ends[slot[inside]]
        return inside

    def __contains__(self, row: int) -> bool:
        return bool(self.mask(np.array([row]))[0])

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RowRanges)
            and np.array_equal(self.starts, other.starts)
            and np.array_equal(self.ends, other.ends)
        )

    def __repr__(self) -> str:
        shown = " ".join(f"[{a}, {b})" for a, b in self.pairs()[:6])
        more = f" ... ({self.num_ranges} ranges)" if self.num_ranges > 6 else ""
        return f"RowRanges({shown}{more})"
