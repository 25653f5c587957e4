"""Input readers: every source yields `RawRow`s, one per input row, streamed.

Sources: JSON Lines (a file, a directory of `.jsonl` part files, or stdin), a
JSON array file, a Parquet file or a directory of Parquet files, and Hugging Face datasets (a directory written by
`save_to_disk`, or a dataset name loaded with `load_dataset(..., streaming=True)`,
which reads the local cache when `HF_DATASETS_OFFLINE=1`).

A row that cannot be parsed (a line that is not JSON, not UTF-8 or not an
object) is still yielded, with `error` set, so the job turns it into an error
row instead of stopping. Blank lines are skipped and do not count as rows.
Row numbers are 0-based and are the default row id.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

PARQUET_BATCH_ROWS = 1024


class InputError(Exception):
    """The input as a whole cannot be read (missing file, unknown format); one line."""


@dataclass
class RawRow:
    """One input row before validation.

    index: 0-based row number (blank lines skipped).
    record: the parsed row, or None when it could not be parsed.
    error: why the row could not be parsed.
    line: 1-based line number for JSON Lines input, else None.
    """

    index: int
    record: dict | None
    error: str | None = None
    line: int | None = None

    @property
    def where(self) -> str:
        """How error messages name this row: `row 3` or `row 3 (line 5)`."""
        if self.line is not None and self.line != self.index + 1:
            return f"row {self.index} (line {self.line})"
        return f"row {self.index}"


class InputSource:
    """A stream of rows plus what is cheaply known about it."""

    def __init__(self, name: str, rows: Iterator[RawRow], total: int | None, columns: list[str] | None = None):
        self.name = name
        self._rows = rows
        self.total = total
        self.columns = columns
        self._peeked: list[RawRow] = []

    def peek(self) -> RawRow | None:
        """The first row, without consuming it (None for an empty input)."""
        if not self._peeked:
            first = next(self._rows, None)
            if first is None:
                return None
            self._peeked.append(first)
        return self._peeked[0]

    def __iter__(self) -> Iterator[RawRow]:
        yield from self._peeked
        self._peeked = []
        yield from self._rows


def open_input(
    spec: str | None, *, dataset: str | None = None, split: str | None = None, columns: set[str] | None = None
) -> InputSource:
    """Open INPUT (`-` for stdin, a file or directory) or `--dataset NAME_OR_PATH`.

    columns: for columnar inputs, the columns worth reading (others are skipped);
    None reads every column.
    """
    if dataset is not None:
        return _open_hf(dataset, split)
    if spec is None:
        raise InputError("no INPUT given (a file, a directory, '-' for stdin, or --dataset NAME)")
    if spec == "-":
        return InputSource("<stdin>", iter_jsonl(sys.stdin.buffer), None)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"input not found: {spec}")
    if path.is_dir():
        if _is_saved_hf_dataset(path):
            return _open_hf(str(path), split)
        if not any(path.rglob("*.parquet")) and any(path.glob("*.jsonl")):
            return _open_jsonl_parts(path)  # the part files of a sharded JSON Lines output
        return _open_parquet(path, columns)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _open_parquet(path, columns)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _open_json_file(path)
    raise InputError(f"unknown input format: {spec} (expected .jsonl, .json, .parquet, a directory or '-')")


# --- JSON -------------------------------------------------------------------


def iter_jsonl(stream: BinaryIO, close: bool = False) -> Iterator[RawRow]:
    """Rows of a JSON Lines byte stream; unparseable lines become error rows."""
    index = 0
    try:
        for line_no, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            yield _parse_json_line(raw, index, line_no)
            index += 1
    finally:
        if close:
            stream.close()


def _parse_json_line(raw: bytes, index: int, line_no: int) -> RawRow:
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        return RawRow(index, None, "not valid UTF-8", line_no)
    except ValueError as exc:
        return RawRow(index, None, f"not valid JSON: {exc}", line_no)
    if not isinstance(record, dict):
        return RawRow(index, None, f"not a JSON object (got {type(record).__name__})", line_no)
    return RawRow(index, record, None, line_no)


def _open_json_file(path: Path) -> InputSource:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        return _open_json_array(path)
    return InputSource(str(path), iter_jsonl(path.open("rb"), close=True), count_jsonl_rows(path))


def _open_json_array(path: Path) -> InputSource:
    """A `.json` file holding one array of objects; read whole (use JSON Lines for big inputs)."""
    try:
        items = json.loads(path.read_bytes())
    except ValueError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None

    def rows() -> Iterator[RawRow]:
        for index, item in enumerate(items):
            if isinstance(item, dict):
                yield RawRow(index, item)
            else:
                yield RawRow(index, None, f"not a JSON object (got {type(item).__name__})")

    return InputSource(str(path), rows(), len(items))


def _open_jsonl_parts(directory: Path) -> InputSource:
    """The `*.jsonl` files of a directory, in name order, as one input (row numbers run on across files)."""
    files = sorted(p for p in directory.glob("*.jsonl") if p.is_file())

    def rows() -> Iterator[RawRow]:
        index = 0
        for f in files:
            for raw in iter_jsonl(f.open("rb"), close=True):
                raw.index = index
                index += 1
                yield raw

    counts = [count_jsonl_rows(f) for f in files]
    total = None if None in counts else sum(c for c in counts if c is not None)
    return InputSource(str(directory), rows(), total)


def count_jsonl_rows(path: Path, max_bytes: int = 4 << 30) -> int | None:
    """Non-blank lines of a JSON Lines file (None when the file is too big to count quickly)."""
    if os.path.getsize(path) > max_bytes:
        return None
    count = 0
    with path.open("rb") as f:
        for line in f:
            if not line.isspace():
                count += 1
    return count


# --- Parquet ----------------------------------------------------------------


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if not files:
        raise InputError(f"no .parquet files in directory {path}")
    return files


def _open_parquet(path: Path, columns: set[str] | None) -> InputSource:
    import pyarrow.parquet as pq

    files = _parquet_files(path)
    try:
        metas = [pq.ParquetFile(f) for f in files]
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise InputError(f"cannot read Parquet input {path}: {exc}") from None
    names = list(metas[0].schema_arrow.names)
    wanted = None if columns is None else [c for c in names if c in columns]
    total = sum(m.metadata.num_rows for m in metas)

    def rows() -> Iterator[RawRow]:
        index = 0
        for pf in metas:
            have = set(pf.schema_arrow.names)
            cols = None if wanted is None else [c for c in wanted if c in have]
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols):
                for record in batch.to_pylist():
                    yield RawRow(index, record)
                    index += 1
            pf.close()

    return InputSource(str(path), rows(), total, names)


# --- Hugging Face datasets --------------------------------------------------


def _is_saved_hf_dataset(path: Path) -> bool:
    return (
        (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    )


def _open_hf(name: str, split: str | None) -> InputSource:
    """A saved dataset directory (memory-mapped) or a dataset loaded in streaming mode."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise InputError("the 'datasets' package is needed for --dataset") from None

    path = Path(name)
    try:
        if path.is_dir() and _is_saved_hf_dataset(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = _pick_split(ds, split, name)
            total: int | None = len(ds)
        else:
            ds = datasets.load_dataset(name, split=split or "train", streaming=True)
            total = _streaming_total(ds, split or "train")
    except InputError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"cannot load dataset {name!r}: {message}") from None

    def rows() -> Iterator[RawRow]:
        for index, record in enumerate(ds):
            yield RawRow(index, dict(record))

    return InputSource(name, rows(), total)


def _pick_split(dd: Any, split: str | None, name: str) -> Any:  # a datasets.DatasetDict and one of its splits
    if split is None:
        if len(dd) == 1:
            return next(iter(dd.values()))
        split = "train"
    if split not in dd:
        raise InputError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(dd)})")
    return dd[split]


def _streaming_total(ds: Any, split: str) -> int | None:  # ds: a datasets dataset (untyped)
    info = getattr(ds, "info", None)
    splits = getattr(info, "splits", None) or {}
    try:
        return splits[split].num_examples or None
    except (KeyError, AttributeError, TypeError):
        return None
