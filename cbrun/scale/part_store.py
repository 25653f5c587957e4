"""The OUTPUT of `cbrun generate --ray`: part files written by the workers, each with a manifest.

    OUTPUT/                                      (its suffix says the format: .parquet or .jsonl)
      part-000000001024-000000002047.parquet     the output rows of input rows 1024..2047
      .cbrun/job.json                            the format; written once, checked by --resume
      .cbrun/run                                 this run's token: a worker of an older run writes nothing
      .cbrun/manifests/part-...-....manifest     Parquet: row, id, id_hash of each input row the part holds;
                                                 its metadata: the rows as ranges, and the part's counters
      .cbrun/attempts/RUN/KEY.N                  block KEY was started for the N-th time in run RUN
      .part-....tmp                              a part being written (removed by --resume)

A part is named after the first and last input row numbers it holds, so a
block retried after its worker died gets the same name and overwrites its own
part: a row is never written twice. Each file is written under a temporary
name, fsynced and renamed, the part before its manifest: a manifest means the
part is complete. pyarrow, Ray Data, DuckDB and `datasets` skip dot-files and
dot-directories, so they read OUTPUT as one dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cbrun.data.atomic import replace_atomically
from cbrun.scale.row_ranges import RowRanges

META_DIR = ".cbrun"
MANIFEST_SUFFIX = ".manifest"
META_KEY = b"cbrun"
SUFFIXES = {"parquet": ".parquet", "jsonl": ".jsonl"}


class StaleRunError(RuntimeError):
    """A worker of an earlier run of this job tried to write after a new run started."""


@dataclass
class BlockCounters:
    """What a written part holds, in input rows and tokens; sent to the driver and kept in the manifest."""

    rows: int = 0
    failed: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retried: int = 0  # blocks run in smaller pieces after their worker died
    given_up: int = 0  # rows written as error rows after their worker died on them alone, again and again

    def add(self, other: BlockCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def from_dict(cls, values: dict) -> BlockCounters:
        return cls(**{f.name: int(values.get(f.name) or 0) for f in fields(cls)})


@dataclass(frozen=True)
class BlockKey:
    """A block (or piece of one) by its first and last input row numbers: the name of its part."""

    first: int
    last: int

    @property
    def name(self) -> str:
        return f"part-{self.first:012d}-{self.last:012d}"


def id_hash(row_id: str) -> int:
    """A stable 64-bit hash of an id (blake2b, as the shards use): duplicate ids are found by sorting these."""
    digest = hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PartStore:
    """Paths and atomic writes under OUTPUT; used by the workers and by the driver."""

    def __init__(self, root: Path | str, kind: str, run: str = ""):
        if kind not in SUFFIXES:
            raise ValueError(f"unknown part format {kind!r}")
        self.root = Path(root)
        self.kind = kind
        self.suffix = SUFFIXES[kind]
        self.run = run
        self.meta = self.root / META_DIR
        self.manifests = self.meta / "manifests"
        self.node = ""  # the Ray node of the worker writing (kept in each manifest)

    def part_path(self, key: BlockKey) -> Path:
        return self.root / f"{key.name}{self.suffix}"

    def manifest_path(self, key: BlockKey) -> Path:
        return self.manifests / f"{key.name}{MANIFEST_SUFFIX}"

    # --- the worker's side ------------------------------------------------------

    def write_part(self, key: BlockKey, table_or_rows: Any) -> None:
        """The part file: a pyarrow Table (Parquet) or a list of row dicts (JSON Lines)."""
        self._atomic(self.part_path(key), lambda tmp: self._write_rows(tmp, table_or_rows))

    def write_manifest(self, key: BlockKey, rows: list[int], ids: list[str], counters: BlockCounters) -> None:
        """The manifest of a written part: its input rows and their ids; what makes the part count as done."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        meta = {
            "part": self.part_path(key).name,
            "ranges": RowRanges.of_rows(rows).pairs(),
            "node": self.node,
            **asdict(counters),
        }
        table = pa.table(
            {
                "row": pa.array(rows, pa.int64()),
                "id": pa.array(ids, pa.string()),
                "id_hash": pa.array([id_hash(i) for i in ids], pa.uint64()),
            }
        ).replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        self._atomic(self.manifest_path(key), lambda tmp: pq.write_table(table, tmp))

    def counters_of(self, key: BlockKey) -> BlockCounters | None:
        """The counters of `key`'s part if it is complete (its manifest exists), else None."""
        path = self.manifest_path(key)
        if not path.exists():
            return None
        return BlockCounters.from_dict(read_manifest_meta(path))

    def begin_attempt(self, key: BlockKey) -> int:
        """How many times `key` has been started in this run, this time included (1 the first time)."""
        folder = self.meta / "attempts" / self.run
        folder.mkdir(parents=True, exist_ok=True)
        attempt = 1
        while True:
            try:
                os.close(os.open(folder / f"{key.name}.{attempt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return attempt
            except FileExistsError:
                attempt += 1

    def end_run(self) -> None:
        """Drop this run's attempt markers (the job is complete: no block will run again)."""
        import shutil

        shutil.rmtree(self.meta / "attempts" / self.run, ignore_errors=True)

    def _check_run(self) -> None:
        if self.run and (self.meta / "run").read_text().strip() != self.run:
            raise StaleRunError(f"{self.root}: a newer run of this job has started; this worker's part is dropped")

    def _atomic(self, path: Path, write: Callable[[Path], object]) -> None:
        """Write `path` whole, under a dot-name of its own (two attempts at one block never share it),
        unless a newer run has started by the time it is on disk."""
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        replace_atomically(path, write, tmp=tmp, before_replace=self._check_run)

    def _write_rows(self, tmp: Path, table_or_rows: Any) -> None:
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table_or_rows, tmp)
            return
        from cbrun.data.writers import dumps

        with open(tmp, "wb") as f:
            for row in table_or_rows:
                f.write(dumps(row))


def read_manifest_meta(path: Path) -> dict:
    """A manifest's metadata (its part's name, row ranges and counters), from the footer alone."""
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[META_KEY])
