"""Reading one input unit (see `cbrun.scale.input_plan`) into row blocks, inside a Ray read task.

Each unit yields pyarrow Tables in the columns `cbrun.scale.ray_data` reads
back into the local reader's RawRows: the job row number, the JSON line's line
number, and either the raw JSON line (parsed on the actor, so a bad line
becomes the same error row as without Ray) or the record as JSON text
(columnar inputs). Rows already in OUTPUT (`done`, on --resume) are skipped
here, before anything is parsed or sent on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cbrun.data.reader import InputError, _pick_split
from cbrun.scale.input_unit import InputUnit
from cbrun.scale.raw_columns import raw_schema
from cbrun.scale.row_ranges import RowRanges

CHUNK_ROWS = 1024  # rows per table a read task yields (Ray re-cuts them into the job's blocks)


def aligned_lines(path: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines whose first byte lies in [start, stop): the line crossing `start` belongs to the range before."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()
        position = f.tell()
        while position < stop:
            line = f.readline()
            if not line:
                return
            position += len(line)
            yield line


def load_saved_dataset(path: str, split: str | None) -> Any:  # a datasets.Dataset
    """A `save_to_disk` directory as the local reader opens it (memory-mapped; one split of a DatasetDict)."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises many types
        raise InputError(f"cannot load dataset {path!r}: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    return _pick_split(ds, split, path) if isinstance(ds, datasets.DatasetDict) else ds


class _Chunker:
    """Collects rows into RAW tables of CHUNK_ROWS rows."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.records: list[str | None] = []
        self.errors: list[str | None] = []
        self.lines: list[int | None] = []
        self.texts: list[bytes | None] = []

    def add(self, row: int, record: str | None, error: str | None, line: int | None, text: bytes | None) -> None:
        self.rows.append(row)
        self.records.append(record)
        self.errors.append(error)
        self.lines.append(line)
        self.texts.append(text)

    def full(self) -> bool:
        return len(self.rows) >= CHUNK_ROWS

    def take(self) -> Any:  # a pyarrow.Table
        import pyarrow as pa

        table = pa.table([self.rows, self.records, self.errors, self.lines, self.texts], schema=raw_schema())
        self.__init__()  # type: ignore[misc]
        return table


class _Done:
    """Membership of increasing row numbers in a RowRanges, in O(1) amortized per row."""

    def __init__(self, done: RowRanges):
        self.starts, self.ends = done.starts, done.ends
        self.slot = 0

    def __contains__(self, row: int) -> bool:
        while self.slot < len(self.ends) and self.ends[self.slot] <= row:
            self.slot += 1
        return self.slot < len(self.starts) and self.starts[self.slot] <= row


def read_unit(unit: InputUnit, done: RowRanges | None = None) -> Iterator[Any]:
    """The unit's rows not in `done`, as RAW tables (`cbrun.scale.ray_data.raw_schema`)."""
    skip = _Done(done if done is not None else RowRanges.empty())
    chunk = _Chunker()
    for row, record, error, line, text in _rows(unit):
        if row in skip:
            continue
        chunk.add(row, record, error, line, text)
        if chunk.full():
            yield chunk.take()
    if chunk.rows:
        yield chunk.take()


RawTuple = tuple[int, "str | None", "str | None", "int | None", "bytes | None"]


def _rows(unit: InputUnit) -> Iterator[RawTuple]:
    if unit.kind == "jsonl":
        yield from _jsonl_rows(unit)
    elif unit.kind == "json_array":
        yield from _json_array_rows(unit)
    elif unit.kind == "parquet":
        yield from _parquet_rows(unit)
    elif unit.kind in ("hf_saved", "hf_stream"):
        yield from _hf_rows(unit)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def _jsonl_rows(unit: InputUnit) -> Iterator[RawTuple]:
    row = unit.row_base
    for number, line in enumerate(aligned_lines(unit.path, unit.start, unit.stop), start=unit.line_base + 1):
        if line.isspace():
            continue
        yield row, None, None, number, line  # parsed on the actor: invalid lines become error rows there
        row += 1


def _json_array_rows(unit: InputUnit) -> Iterator[RawTuple]:
    items = json.loads(Path(unit.path).read_bytes())
    for index, item in enumerate(items, start=unit.row_base):
        if isinstance(item, dict):
            yield index, _as_json(item), None, None, None
        else:
            yield index, None, f"not a JSON object (got {type(item).__name__})", None, None


def _parquet_rows(unit: InputUnit) -> Iterator[RawTuple]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(unit.path)
    columns = None if unit.columns is None else list(unit.columns)
    row, skip, left = unit.row_base, unit.skip, unit.rows or 0
    try:
        for batch in pf.iter_batches(batch_size=CHUNK_ROWS, row_groups=range(unit.start, unit.stop), columns=columns):
            if skip >= batch.num_rows:  # a slice of a large row group: the rows before it are decoded, not sent
                skip -= batch.num_rows
                continue
            for record in batch.slice(skip, left).to_pylist():
                yield row, _as_json(record), None, None, None
                row += 1
            left -= min(left, batch.num_rows - skip)
            skip = 0
            if not left:
                return
    finally:
        pf.close()


def _hf_rows(unit: InputUnit) -> Iterator[RawTuple]:
    if unit.kind == "hf_saved":
        ds = load_saved_dataset(unit.path, unit.split)
        records = ds.select(range(unit.start, unit.stop)) if unit.stop else ds
    else:
        import datasets

        try:
            records = datasets.load_dataset(unit.path, split=unit.split or "train", streaming=True)
        except Exception as exc:  # datasets raises many types
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(f"cannot load dataset {unit.path!r}: {message}") from None
    for index, record in enumerate(records, start=unit.row_base):
        yield index, _as_json(dict(record)), None, None, None


def _as_json(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, default=str)


def first_record(unit: InputUnit) -> dict | None:
    """The first row of a unit that parses to an object (None if none does): is this OpenAI Batch input?"""
    for _, record, _, _, text in _rows(unit):
        try:
            value = json.loads(text if text is not None else record or "null")
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
