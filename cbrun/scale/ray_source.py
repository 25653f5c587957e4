"""The input of `cbrun generate --ray` as a Ray Data datasource: read on the workers, streamed, lazy.

Ray's own `read_json` fails a whole file on one bad line and numbers no rows,
so cbrun plans its own read tasks (`cbrun.scale.input_plan`) and reads each one
with `cbrun.scale.input_read`: a JSON Lines range, a Parquet slice, a saved or
streamed Hugging Face dataset. Ray Data runs the read tasks with backpressure,
as many as its object store budget allows, so the driver holds the plan (a few
numbers per unit) and never a row. Read tasks reserve no CPU: they only split
lines or decode Parquet, and actors that reserve every CPU of a cluster must not
leave them unschedulable; `concurrency` keeps them from crowding the engines.
"""

from __future__ import annotations

import functools
from typing import Any

from ray.data.datasource import Datasource

from cbrun.data.reader import InputError
from cbrun.scale.input_plan import InputPlan, InputUnit, count_units, number_units
from cbrun.scale.input_read import first_record, read_unit
from cbrun.scale.raw_columns import raw_schema
from cbrun.scale.row_ranges import RowRanges

COUNT_CPUS = 0.25
COUNT_BYTES_PER_TASK = 1 << 30
BYTES_PER_ROW = 256  # a guess for Ray's memory planning; rows are prompts


class CbrunInput(Datasource):
    """The plan's units as read tasks, each skipping the rows in `done` (a resumed job)."""

    def __init__(self, plan: InputPlan, done: RowRanges):
        super().__init__()
        self.plan = plan
        self.done = done

    def get_name(self) -> str:
        return "CbrunInput"

    def estimate_inmemory_data_size(self) -> int | None:
        total = self.plan.total
        return None if total is None else (total - len(self.done)) * BYTES_PER_ROW

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None) -> list:
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        tasks = []
        for unit in self.plan.units:
            end = unit.row_end
            skip = self.done if end is None else self.done.within(unit.row_base, end)
            rows = None if unit.rows is None else unit.rows - len(skip)
            if rows == 0:
                continue  # every row of this unit is in OUTPUT already
            meta = BlockMetadata(
                num_rows=rows,
                size_bytes=None if rows is None else rows * BYTES_PER_ROW,
                exec_stats=None,
                input_files=(unit.path,),
            )
            tasks.append(ReadTask(functools.partial(read_unit, unit, skip), meta, schema=raw_schema()))
        return tasks


def count_input(plan: InputPlan, parallelism: int) -> InputPlan:
    """The plan with every countable unit counted (JSON Lines ranges, arrays, saved datasets), by Ray tasks
    of up to COUNT_BYTES_PER_TASK each: a task's start-up costs more than counting a few MiB of lines."""
    import ray

    task = ray.remote(num_cpus=COUNT_CPUS, max_retries=2)(count_units)
    todo = [i for i, unit in enumerate(plan.units) if unit.rows is None and unit.kind != "hf_stream"]
    groups: list[list[int]] = []
    size = 0
    for i in todo:
        unit = plan.units[i]
        if not groups or size + unit.stop - unit.start > COUNT_BYTES_PER_TASK:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += unit.stop - unit.start
    results = _get([task.remote([plan.units[i] for i in group]) for group in groups])
    counts = {i: count for group, found in zip(groups, results) for i, count in zip(group, found)}
    return number_units(plan, counts, parallelism)


def probe_first_record(unit: InputUnit) -> dict | None:
    """The first record of a unit, read by a Ray task (is the input OpenAI Batch requests?)."""
    import ray

    (record,) = _get([ray.remote(num_cpus=COUNT_CPUS, max_retries=2)(first_record).remote(unit)])
    return record


def _get(refs: list) -> list:
    """ray.get, with an input problem raised as the InputError it was on the worker."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (InputError, OSError)):
            raise InputError(str(cause)) from None
        raise
