"""`--resume`: find what an earlier run of the same job already wrote.

The existing OUTPUT (and, for Parquet, its journal) is read into a
`ResumeState`; the job then skips every (id, sample) already there and every
bad input row already reported (keyed by row number, which error messages
start with). Rows that are not answers (a hard stop's "engine stopped" errors,
cancellations) are removed so they are redone.

JSON Lines files are repaired in place first: a partial last line (a kill in
the middle of a write) is cut off; unreadable, duplicate or killed lines are
removed by rewriting the file (to a temporary file renamed over it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cbrun.data.atomic import replace_atomically
from cbrun.data.output_rows import RowKey
from cbrun.data.writers import journal_path

Classify = Callable[[dict], RowKey]


class ResumeError(Exception):
    """The existing output cannot be resumed (wrong format, unreadable); one line."""


@dataclass
class ResumeState:
    """What an earlier run completed."""

    done: set[tuple[str, int]] = field(default_factory=set)  # (id, sample)
    done_ids: set[str] = field(default_factory=set)  # ids whose samples all sit in one row
    bad_rows: set[int] = field(default_factory=set)  # input row numbers reported as bad
    failed_ids: set[str] = field(default_factory=set)  # ids the engine failed
    rows: int = 0  # output rows kept

    def add(self, key: RowKey) -> bool:
        """Record one output row; False when it repeats one already recorded."""
        if key.bad_row is not None:
            if key.bad_row in self.bad_rows:
                return False
            self.bad_rows.add(key.bad_row)
        elif key.all:
            if key.id in self.done_ids:
                return False
            self.done_ids.add(key.id)
        else:
            pairs = {(key.id, s) for s in key.samples}
            if pairs & self.done:
                return False
            self.done |= pairs
        if key.failed and key.bad_row is None:
            self.failed_ids.add(key.id)
        self.rows += 1
        return True

    @property
    def failed_rows(self) -> int:
        return len(self.bad_rows) + len(self.failed_ids)

    def missing_samples(self, row_id: str, samples: Iterable[int]) -> list[int]:
        """Those of a row's `samples` not written yet (none when the id was written whole, as OpenAI rows are).

        The one resume filter of every row kind: generated rows ask for samples 0..n-1, score rows
        for the samples their completions are.
        """
        if row_id in self.done_ids:
            return []
        return [s for s in samples if (row_id, s) not in self.done]

    def has_bad_row(self, index: int) -> bool:
        return index in self.bad_rows


def load_resume_state(output: Path, kind: str, classify: Classify) -> ResumeState:
    """Read (and repair) the existing output of a job: kind is "jsonl" or "parquet"."""
    state = ResumeState()
    if kind == "parquet":
        if output.exists():
            _scan_parquet(output, classify, state)
        journal = journal_path(output)
        if journal.exists():
            scan_jsonl(journal, classify, state)
    elif output.exists():
        scan_jsonl(output, classify, state)
    return state


def scan_jsonl(path: Path, classify: Classify, state: ResumeState) -> int:
    """Add a JSON Lines output's rows to state and repair the file; returns lines removed."""
    drop: list[int] = []
    partial_tail = False
    good_end = 0  # byte offset just after the last kept line
    with open(path, "rb") as f:
        offset = 0
        for number, line in enumerate(f):
            offset += len(line)
            if not line.endswith(b"\n"):
                drop.append(number)  # a partial last line: the kill came mid-write
                partial_tail = True
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                drop.append(number)
                continue
            try:
                key = classify(row)
            except (ValueError, TypeError, KeyError) as exc:
                raise ResumeError(f"cannot resume {path}: line {number + 1}: {exc}") from None
            if key.killed or not state.add(key):
                drop.append(number)
                continue
            good_end = offset
    if len(drop) > int(partial_tail):
        _rewrite_without(path, set(drop))
    elif partial_tail:
        os.truncate(path, good_end)
    return len(drop)


def _rewrite_without(path: Path, drop: set[int]) -> None:
    def write(tmp: Path) -> None:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for number, line in enumerate(src):
                if number not in drop:
                    dst.write(line)

    replace_atomically(path, write)  # beside it as OUT.jsonl.tmp, fsynced, renamed over it


def _scan_parquet(path: Path, classify: Classify, state: ResumeState) -> None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        columns = [c for c in ("id", "sample", "finish_reason", "error") if c in names]
        for batch in pf.iter_batches(batch_size=8192, columns=columns):
            for row in batch.to_pylist():
                key = classify(row)
                if not key.killed:
                    state.add(key)
        pf.close()
    except (ValueError, TypeError, KeyError) as exc:
        raise ResumeError(f"cannot resume {path}: {exc}") from None
    except OSError as exc:
        raise ResumeError(f"cannot resume {path}: not a readable Parquet file ({exc})") from None
