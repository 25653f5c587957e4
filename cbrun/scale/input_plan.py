"""Which read tasks a `cbrun generate --ray` input becomes, planned without reading its rows.

The driver never holds rows, but every row must keep the number the local
reader gives it (0-based, blank JSON lines skipped, running on across the files
of a directory), so that error rows and resume name rows as without Ray. The
input is cut into units, each read by one Ray task:

    JSON Lines  byte ranges of each file (a line belongs to the range holding its
                first byte); how many rows and lines precede a range is counted by
                a Ray task per range before the job starts (`count_unit`)
    .json array the whole file (it has to be parsed whole anyway)
    Parquet     row slices: runs of small row groups, or slices of a large one;
                row counts come from the footers
    HF saved    row slices of a `save_to_disk` directory; its length is asked for once
    HF name     one streaming task (`load_dataset(..., streaming=True)`), numbered as it goes

Units are sized so that there are about `parallelism` of them (the actors take
a unit at a time, so this is what balances the replicas), within bounds that
keep a read task's memory small.

`plan_input` lists units (some not yet counted), `count_unit` counts one
(anywhere), `number_units` gives each its first row number. Reading is
`cbrun.scale.input_read`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cbrun.data.reader import InputError, _is_saved_hf_dataset, _parquet_files
from cbrun.scale.input_unit import InputUnit

UNIT_BYTES = (4 << 10, 64 << 20)  # JSON Lines ranges: at least 4 KiB, at most 64 MiB
UNIT_ROWS = 65_536  # Parquet / saved-dataset rows per read task, at most


@dataclass(frozen=True)
class InputPlan:
    """The units of an input, in row order; `total` is None when an HF stream's length is unknown."""

    name: str
    units: tuple[InputUnit, ...]

    @property
    def total(self) -> int | None:
        if any(u.rows is None for u in self.units):
            return None
        return sum(u.rows or 0 for u in self.units)

    @property
    def counted(self) -> bool:
        return all(u.rows is not None or u.kind == "hf_stream" for u in self.units)


def plan_input(
    spec: str | None,
    *,
    dataset: str | None = None,
    split: str | None = None,
    columns: set[str] | None = None,
    parallelism: int = 8,
) -> InputPlan:
    """INPUT (a file or directory) or --dataset as units; raises InputError for what cannot be read.

    Mirrors `cbrun.data.reader.open_input`'s choice of format; stdin cannot be read by Ray workers.
    parallelism: about how many units the input should give (JSON Lines: per file).
    """
    if dataset is not None:
        return _plan_hf(dataset, split)
    if spec is None:
        raise InputError("no INPUT given (a file, a directory, or --dataset NAME)")
    if spec == "-":
        raise InputError("--ray reads INPUT on the Ray workers, which cannot read stdin: save it to a file first")
    path = Path(spec)
    if not path.exists():
        raise InputError(f"input not found: {spec}")
    if path.is_dir():
        if _is_saved_hf_dataset(path):
            return _plan_hf(str(path), split)
        if not any(path.rglob("*.parquet")) and any(path.glob("*.jsonl")):
            files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
            return InputPlan(spec, tuple(u for f in files for u in _jsonl_ranges(f, parallelism)))
        return _plan_parquet(spec, _parquet_files(path), columns, parallelism)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _plan_parquet(spec, [path], columns, parallelism)
    if suffix in (".jsonl", ".json", ".ndjson"):
        if suffix == ".json" and _starts_with_array(path):
            return InputPlan(spec, (InputUnit("json_array", str(path)),))
        return InputPlan(spec, tuple(_jsonl_ranges(path, parallelism)))
    raise InputError(f"unknown input format: {spec} (expected .jsonl, .json, .parquet or a directory)")


def _starts_with_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _jsonl_ranges(path: Path, parallelism: int) -> list[InputUnit]:
    size = path.stat().st_size
    low, high = UNIT_BYTES
    step = max(low, min(high, -(-size // max(1, parallelism))))
    starts = range(0, max(size, 1), step)
    return [InputUnit("jsonl", str(path), start, min(size, start + step)) for start in starts]


def _plan_parquet(name: str, files: Sequence[Path], columns: set[str] | None, parallelism: int) -> InputPlan:
    """Row slices of about total / parallelism rows (runs of small row groups, slices of large ones), with the
    local reader's column choice (the columns of the first file)."""
    import pyarrow.parquet as pq

    groups: list[tuple[Path, int, int]] = []  # (file, row group, rows)
    column_sets: list[tuple[str, ...] | None] = []
    wanted: list[str] | None = None
    for file in files:
        try:
            meta = pq.read_metadata(file)
            schema = pq.read_schema(file)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise InputError(f"cannot read Parquet input {file}: {exc}") from None
        if wanted is None:
            wanted = None if columns is None else [c for c in schema.names if c in columns]
        column_sets.append(None if wanted is None else tuple(c for c in wanted if c in schema.names))
        groups.extend((file, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups))
    total = sum(rows for _, _, rows in groups)
    target = max(1, min(UNIT_ROWS, -(-total // max(1, parallelism))))
    cols = dict(zip(files, column_sets))
    units: list[InputUnit] = []
    run: list[tuple[Path, int, int]] = []

    def close_run() -> None:
        if run:
            file = run[0][0]
            units.append(
                InputUnit(
                    "parquet", str(file), run[0][1], run[-1][1] + 1, rows=sum(r for *_, r in run), columns=cols[file]
                )
            )
            run.clear()

    for file, group, rows in groups:
        if run and (run[0][0] != file or sum(r for *_, r in run) + rows > target):
            close_run()
        if rows > target:  # a large group: slices of it
            units.extend(
                InputUnit(
                    "parquet", str(file), group, group + 1, skip=a, rows=min(target, rows - a), columns=cols[file]
                )
                for a in range(0, rows, target)
            )
        elif rows:
            run.append((file, group, rows))
    close_run()
    return InputPlan(name, tuple(_numbered(units)))


def _plan_hf(name: str, split: str | None) -> InputPlan:
    path = Path(name)
    if path.is_dir() and _is_saved_hf_dataset(path):
        return InputPlan(name, (InputUnit("hf_saved", name, split=split),))
    return InputPlan(name, (InputUnit("hf_stream", name, split=split or "train"),))


def count_unit(unit: InputUnit) -> tuple[int, int]:
    """(rows, lines) of an uncounted unit; runs in a Ray task (reads the unit once, holds one line)."""
    from cbrun.scale.input_read import aligned_lines

    if unit.kind == "jsonl":
        rows = lines = 0
        for line in aligned_lines(unit.path, unit.start, unit.stop):
            lines += 1
            rows += not line.isspace()
        return rows, lines
    if unit.kind == "json_array":
        try:
            items = json.loads(Path(unit.path).read_bytes())
        except ValueError as exc:
            raise InputError(f"{unit.path}: not valid JSON: {exc}") from None
        if not isinstance(items, list):
            raise InputError(f"{unit.path}: not a JSON array")
        return len(items), 0
    if unit.kind == "hf_saved":
        from cbrun.scale.input_read import load_saved_dataset

        return len(load_saved_dataset(unit.path, unit.split)), 0
    raise ValueError(f"a {unit.kind} unit needs no count")


def count_units(units: Sequence[InputUnit]) -> list[tuple[int, int]]:
    """`count_unit` of each unit, in one task."""
    return [count_unit(unit) for unit in units]


def number_units(plan: InputPlan, counts: dict[int, tuple[int, int]], parallelism: int = 8) -> InputPlan:
    """The plan with `counts` (unit position -> (rows, lines)) filled in, row and line bases set,
    and a counted saved dataset cut into about `parallelism` slices (of at most UNIT_ROWS rows)."""
    units: list[InputUnit] = []
    for position, unit in enumerate(plan.units):
        if position in counts:
            rows, lines = counts[position]
            unit = dataclasses.replace(unit, rows=rows, lines=lines)
        if unit.kind == "hf_saved" and unit.stop == 0 and unit.rows:
            size = max(1, min(UNIT_ROWS, -(-unit.rows // max(1, parallelism))))
            units.extend(
                dataclasses.replace(unit, start=a, stop=min(unit.rows, a + size), rows=min(size, unit.rows - a))
                for a in range(0, unit.rows, size)
            )
        else:
            units.append(unit)
    return InputPlan(plan.name, tuple(_numbered(units)))


def _numbered(units: list[InputUnit]) -> list[InputUnit]:
    """Row bases running on across units; line bases running on within each file."""
    numbered: list[InputUnit] = []
    row, line, path = 0, 0, None
    for unit in units:
        if unit.path != path:
            line, path = 0, unit.path
        numbered.append(dataclasses.replace(unit, row_base=row, line_base=line))
        row += unit.rows or 0
        line += unit.lines
    return numbered
