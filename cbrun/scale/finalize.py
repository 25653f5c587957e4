"""One schema for every Parquet part of a finished `--ray` job, so OUTPUT reads as one dataset.

Each worker writes its part with the columns its own rows need: the
`structured` column only when one of its rows carries a constraint, and kept
input columns with the type their values share there (null when all are null).
pyarrow, Ray Data, DuckDB and `datasets` each refuse or drop columns when the
files of one dataset disagree, so when the last block is written the driver
reads the parts' footers, unifies their schemas (a kept column whose types
cannot be unified becomes JSON text, as without Ray) and has Ray tasks rewrite
the parts that differ, atomically. Usually every part already agrees and
nothing is rewritten. The driver holds the distinct schemas, never rows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cbrun.data.atomic import replace_atomically
from cbrun.data.generate.format import CbrunFormat

REWRITES_IN_FLIGHT = 16


def part_schemas(parts: Iterable[Path]) -> list[Any]:  # pyarrow Schemas
    """The distinct schemas (without metadata) of `parts`, from their footers."""
    import pyarrow.parquet as pq

    found: dict[bytes, Any] = {}
    for path in parts:
        schema = pq.read_schema(path).remove_metadata()
        found.setdefault(schema.serialize().to_pybytes(), schema)
    return list(found.values())


def unified_schema(schemas: Sequence[Any], fmt: CbrunFormat) -> Any:  # a pyarrow.Schema
    """The schema every part gets: the job's columns, `structured` if any part has it, kept columns unified."""
    import pyarrow as pa

    if not fmt.structured and any("structured" in s.names for s in schemas):
        fmt = dataclasses.replace(fmt, structured=True)
    keep_types = {}
    for name in fmt.keep_columns:
        types = [s.field(name).type for s in schemas if name in s.names]
        try:
            merged = pa.unify_schemas([pa.schema([(name, t)]) for t in types], promote_options="permissive")
            keep_types[name] = merged.field(name).type if types else pa.null()
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            keep_types[name] = pa.string()
    return fmt.arrow_schema(keep_types)


def finalize_parts(parts: Sequence[Path], fmt: CbrunFormat, rewrite: Callable[[list[Path], Any], None]) -> int:
    """Bring `parts` to one schema with `rewrite(paths, schema)`; returns how many parts it rewrote."""
    import pyarrow.parquet as pq

    schemas = part_schemas(parts)
    if len(schemas) <= 1:
        return 0
    target = unified_schema(schemas, fmt)
    todo = [p for p in parts if not pq.read_schema(p).remove_metadata().equals(target)]
    rewrite(todo, target)
    return len(todo)


def rewrite_with_ray(paths: list[Path], schema: Any) -> None:
    """`conform_part` for each path in Ray tasks, at most REWRITES_IN_FLIGHT at a time."""
    import ray

    task = ray.remote(num_cpus=0.25, max_retries=3)(conform_part)
    for start in range(0, len(paths), REWRITES_IN_FLIGHT):
        ray.get([task.remote(str(p), schema) for p in paths[start : start + REWRITES_IN_FLIGHT]])


def conform_part(path: str, schema: Any) -> None:
    """Rewrite one part in `schema` (missing columns as nulls, types cast, uncastable values as JSON text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    columns = []
    for target in schema:
        if target.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, target.type))
            continue
        column = table.column(target.name)
        if column.type != target.type:
            try:
                column = column.cast(target.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                column = pa.array([_as_text(v) for v in column.to_pylist()], target.type)
        columns.append(column)
    table = pa.Table.from_arrays(columns, schema=schema)
    part = Path(path)
    replace_atomically(part, lambda tmp: pq.write_table(table, tmp), tmp=part.with_name(f".{part.name}.conform.tmp"))


def _as_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)
