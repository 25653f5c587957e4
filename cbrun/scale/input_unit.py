"""A piece of the input one Ray read task reads: where it lies and which job rows it holds (the driver plans
these in input_plan.py; the workers read them in input_read.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputUnit:
    """A piece of the input one read task reads.

    kind: "jsonl", "json_array", "parquet", "hf_saved" or "hf_stream".
    path: the file (a dataset directory or name for hf_*).
    start, stop: jsonl: byte range; parquet: row groups [start, stop); hf_saved: rows of the dataset.
    skip: parquet: rows of the first row group before the unit (a large group is read in slices).
    rows: rows in the unit, None until counted (hf_stream: never).
    row_base: the job row number of the unit's first row; line_base: jsonl lines of the file before it.
    columns: parquet columns to read (None: all); split: hf_* split.
    """

    kind: str
    path: str
    start: int = 0
    stop: int = 0
    skip: int = 0
    rows: int | None = None
    row_base: int = 0
    line_base: int = 0
    lines: int = 0
    columns: tuple[str, ...] | None = None
    split: str | None = None

    @property
    def row_end(self) -> int | None:
        return None if self.rows is None else self.row_base + self.rows
