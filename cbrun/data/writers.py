"""Incremental output writers that survive `kill -9`.

JSON Lines (a file or stdout): each row is appended as one line; the stream is
flushed, and a file fsynced, every `flush_rows` rows and every `flush_seconds`.
A kill can leave at most a partial last line, which `--resume` cuts off.

Parquet: a Parquet file cannot be appended to, and one killed mid-write has no
footer and cannot be read at all. So rows go first to a JSON Lines journal next
to the output (`OUT.parquet.partial.jsonl`), written exactly like a JSONL output;
`close()` converts journal (plus any Parquet OUTPUT from an earlier, interrupted
run) into `OUT.parquet.tmp`, fsyncs it, renames it over `OUT.parquet` (atomic)
and deletes the journal. After a kill the journal holds everything written so
far and `--resume` continues it. If a kill lands between the rename and the
journal's deletion, resume finds the journal's rows already in the Parquet file
and drops them as duplicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol, cast, runtime_checkable

from cbrun.data.atomic import replace_atomically
from cbrun.data.output_rows import STOPPED_MARKER


@runtime_checkable
class TableFormat(Protocol):
    """An output format whose rows have fixed columns, so they can be a Parquet table (CbrunFormat, ScoreFormat)."""

    @property
    def keep_columns(self) -> tuple[str, ...]: ...

    def arrow_schema(self, keep_types: dict | None = None) -> Any:  # a pyarrow.Schema (pyarrow is untyped)
        ...


FLUSH_ROWS = 256
FLUSH_SECONDS = 2.0
CONVERT_CHUNK_ROWS = 4096


def journal_path(output: Path) -> Path:
    """Where a Parquet output's rows are journaled while the job runs."""
    return output.with_name(output.name + ".partial.jsonl")


def dumps(row: dict) -> bytes:
    """One JSON line; values JSON cannot hold (dates, bytes) are written as text."""
    return json.dumps(row, ensure_ascii=False, default=str).encode() + b"\n"


class JsonlWriter:
    """Appends rows as JSON lines, flushing (and fsyncing files) regularly."""

    def __init__(
        self,
        stream: IO[bytes],
        *,
        fsync: bool = True,
        flush_rows: int = FLUSH_ROWS,
        flush_seconds: float = FLUSH_SECONDS,
    ):
        self._stream = stream
        self._fsync = fsync
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._unflushed = 0
        self._last_flush = time.monotonic()
        self.rows_written = 0

    @classmethod
    def open(cls, path: Path, append: bool, **kwargs: Any) -> JsonlWriter:
        return cls(open(path, "ab" if append else "wb"), **kwargs)

    def write(self, row: dict) -> None:
        self._stream.write(dumps(row))
        self.rows_written += 1
        self._unflushed += 1
        if self._unflushed >= self.flush_rows:
            self.flush()

    def maybe_flush(self) -> None:
        """Flush when rows have waited `flush_seconds`; called from the job's loop."""
        if self._unflushed and time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._stream.flush()
        if self._fsync:
            with contextlib.suppress(OSError, ValueError):  # a pipe or a closed stream: nothing to sync
                os.fsync(self._stream.fileno())
        self._unflushed = 0
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if not self._stream.closed:
            self.flush()
            self._stream.close()


class ParquetOutput:
    """A Parquet output written through a JSON Lines journal (see the module docstring)."""

    def __init__(self, path: Path, fmt: TableFormat, **kwargs: Any):
        self.path = path
        self.journal = journal_path(path)
        self.fmt = fmt
        self._writer = JsonlWriter.open(self.journal, append=True, **kwargs)

    @property
    def rows_written(self) -> int:
        return self._writer.rows_written

    def write(self, row: dict) -> None:
        self._writer.write(row)

    def maybe_flush(self) -> None:
        self._writer.maybe_flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        finalize_parquet(self.path, self.journal, self.fmt)


def finalize_parquet(path: Path, journal: Path, fmt: TableFormat) -> None:
    """Merge an existing Parquet OUTPUT and the journal into a new OUTPUT, atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = pq.ParquetFile(path) if path.exists() else None
    if (
        getattr(fmt, "structured", None) is False  # a generate format without the column (score rows have none)
        and (_journal_has(journal, "structured") or (old and "structured" in old.schema_arrow.names))
    ):
        # rows' own constraints: the column without a job-wide flag
        fmt = dataclasses.replace(cast(Any, fmt), structured=True)
    keep_types = _keep_types(journal, fmt.keep_columns, old)
    schema = fmt.arrow_schema({name: t for name, (t, _) in keep_types.items()})
    as_text = {name for name, (_, text) in keep_types.items() if text}

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema) as writer:
            if old is not None:
                for batch in old.iter_batches(batch_size=CONVERT_CHUNK_ROWS):
                    writer.write_table(_conform(batch, schema))
                old.close()
            for rows in _journal_chunks(journal):
                for row in rows:
                    for name in as_text:
                        row[name] = _as_text(row.get(name))
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))

    replace_atomically(path, write, sync_dir=True)  # OUT.parquet.tmp, then the rename made durable
    journal.unlink(missing_ok=True)


def _journal_has(journal: Path, column: str) -> bool:
    """Whether any journal row has this column (rows are JSON objects, one per line)."""
    if not journal.exists():
        return False
    with open(journal, "rb") as f:
        return any(column in json.loads(line) for line in f if f'"{column}"'.encode() in line)


def _journal_chunks(journal: Path) -> Iterator[list[dict]]:
    if not journal.exists():
        return
    rows: list[dict] = []
    with open(journal, "rb") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) >= CONVERT_CHUNK_ROWS:
                yield rows
                rows = []
    if rows:
        yield rows


def _keep_types(journal: Path, keep: tuple[str, ...], old: Any) -> dict:  # old: a pyarrow ParquetFile or None
    """Arrow type of each kept input column, and whether it must be stored as text.

    Types are inferred from the data (a first pass over the journal); a column
    whose values do not share one type is written as JSON text.
    """
    import pyarrow as pa

    if not keep:
        return {}
    found: dict[str, list] = {name: [] for name in keep}
    if old is not None:
        for name in keep:
            if name in old.schema_arrow.names:
                found[name].append(old.schema_arrow.field(name).type)
    for rows in _journal_chunks(journal):
        for name in keep:
            try:
                found[name].append(pa.array([r.get(name) for r in rows]).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                found[name].append(None)
    result = {}
    for name, types in found.items():
        unified = _unify(types)
        result[name] = (pa.string(), True) if unified is None else (unified, False)
    return result


def _unify(types: list) -> Any:  # pyarrow types (pyarrow is untyped)
    import pyarrow as pa

    if not types:
        return pa.null()
    if any(t is None for t in types):
        return None
    try:
        schema = pa.unify_schemas([pa.schema([("c", t)]) for t in types], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    return schema.field("c").type


def _as_text(value):
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _conform(batch, schema):
    """An older Parquet batch in the current schema (columns added as nulls, killed rows dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = pa.Table.from_batches([batch])
    if "finish_reason" in table.column_names:
        error = table.column("error") if "error" in table.column_names else pa.nulls(len(table), pa.string())
        killed = pc.or_(
            pc.equal(table.column("finish_reason"), "cancelled"),
            pc.and_(
                pc.equal(table.column("finish_reason"), "error"),
                pc.fill_null(pc.match_substring(error, STOPPED_MARKER), False),
            ),
        )
        table = table.filter(pc.invert(pc.fill_null(killed, False)))
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type == field.type else _cast(column, field.type))
        else:
            columns.append(pa.nulls(len(table), field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _cast(column, target):
    import pyarrow as pa

    try:
        return column.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([_as_text(v) for v in column.to_pylist()], pa.string()).cast(target)
