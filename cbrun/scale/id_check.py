"""Duplicate input ids across a whole `--ray` job, found from the manifests with bounded memory.

Each worker's preparer sees only its own block, so an id used by two rows of
different blocks is generated twice (within one block the second row is an
error row, as without Ray). When the job ends, the driver reads the 64-bit id
hashes of every manifest (8 bytes a row), spreads them over buckets of at most
BUCKET_ROWS (temporary files when there is more than one), sorts each bucket
and counts the hashes seen more than once; a second pass over the manifests
reads the ids and rows of the first few, to show them. The driver never holds
more than one bucket: 4 MiB at the default size, whatever the job's length.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BUCKET_ROWS = 1 << 19  # 4 MiB of hashes per bucket


@dataclass
class DuplicateIds:
    """ids used by more than one input row: how many, and (id, row numbers) of the first few."""

    count: int = 0
    examples: list[tuple[str, list[int]]] = field(default_factory=list)

    def describe(self) -> str:
        shown = ", ".join(f"{row_id!r} (rows {', '.join(map(str, rows))})" for row_id, rows in self.examples)
        more = f", and {self.count - len(self.examples)} more" if self.count > len(self.examples) else ""
        return f"{self.count} ids are used by more than one input row: {shown}{more}"


def find_duplicate_ids(manifests: Sequence[Path], total_rows: int, examples: int = 5) -> DuplicateIds:
    """The duplicate ids of the rows the `manifests` hold (`total_rows` of them, about: it sizes the buckets)."""
    buckets = max(1, -(-total_rows // BUCKET_ROWS))
    with tempfile.TemporaryDirectory(prefix="cbrun-ids-") as scratch:
        repeated = [_repeated(bucket) for bucket in _buckets(manifests, buckets, Path(scratch))]
    found = np.concatenate(repeated) if repeated else np.zeros(0, np.uint64)
    result = DuplicateIds(count=len(found))
    if len(found):
        result.examples = _examples(manifests, found[:examples])
    return result


def _hashes(manifest: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    return pq.read_table(manifest, columns=["id_hash"]).column("id_hash").to_numpy()


def _buckets(manifests: Sequence[Path], count: int, scratch: Path) -> Iterator[np.ndarray]:
    """The id hashes, `count` buckets of them (by hash modulo count), one bucket in memory at a time."""
    if count == 1:
        yield np.concatenate([_hashes(p) for p in manifests] or [np.zeros(0, np.uint64)])
        return
    files = [scratch / f"bucket-{b}.u64" for b in range(count)]
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(f, "wb")) for f in files]
        for path in manifests:
            hashes = _hashes(path)
            which = (hashes % np.uint64(count)).astype(np.int64)
            order = np.argsort(which, kind="stable")
            ends = np.cumsum(np.bincount(which, minlength=count))
            for handle, part in zip(handles, np.split(hashes[order], ends[:-1])):
                part.tofile(handle)
    for f in files:
        yield np.fromfile(f, dtype=np.uint64)


def _repeated(hashes: np.ndarray) -> np.ndarray:
    """The values that occur more than once, each once."""
    ordered = np.sort(hashes)
    same = ordered[1:] == ordered[:-1]
    return np.unique(ordered[1:][same])


def _examples(manifests: Sequence[Path], hashes: np.ndarray) -> list[tuple[str, list[int]]]:
    import pyarrow.parquet as pq

    rows_of: dict[str, list[int]] = defaultdict(list)
    for path in manifests:
        table = pq.read_table(path)
        hit = np.isin(table.column("id_hash").to_numpy(), hashes)
        if hit.any():
            for row, row_id in zip(
                table.column("row").to_numpy()[hit], table.column("id").to_numpy(zero_copy_only=False)[hit]
            ):
                rows_of[row_id].append(int(row))
    return [(row_id, sorted(rows)) for row_id, rows in rows_of.items() if len(rows) > 1]
