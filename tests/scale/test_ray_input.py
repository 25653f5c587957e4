"""`cbrun generate --ray`'s input (issue 35), planned and read without Ray: the same rows as the local reader.

The driver plans read units from file sizes and Parquet footers only; Ray tasks
count and read them. Whatever the cut (ranges mid-line, slices of one large row
group, several files), the rows read back must be the local reader's: same row
numbers, same line numbers, the same error for a bad line, none lost or doubled,
and rows already done (--resume) skipped before parsing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.data.reader import InputError, RawRow, open_input
from cbrun.scale import input_plan
from cbrun.scale.input_plan import InputPlan, count_unit, number_units, plan_input
from cbrun.scale.input_read import read_unit
from cbrun.scale.ray_data import raw_rows
from cbrun.scale.row_ranges import RowRanges


def jsonl_text(rows: int) -> str:
    """Rows with blank lines, a bad line, a non-object line and one long line among them."""
    lines = []
    for i in range(rows):
        if i % 17 == 5:
            lines.append("")
        if i == 40:
            lines.append("{not json")
        elif i == 41:
            lines.append("[1, 2]")
        elif i == 42:
            lines.append(json.dumps({"id": "long", "prompt": "x" * 9000}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"prompt {i}"}))
    return "\n".join(lines) + "\n"


def read_plan(plan: InputPlan, done: RowRanges | None = None) -> list[RawRow]:
    """Count and read every unit as Ray would, in-process; rows back through the actor's raw_rows."""
    counts = {i: count_unit(u) for i, u in enumerate(plan.units) if u.rows is None and u.kind != "hf_stream"}
    counted = number_units(plan, counts, parallelism=4)
    return [row for unit in counted.units for table in read_unit(unit, done) for row in raw_rows(table)]


def local_rows(spec: str | None, **kwargs) -> list[RawRow]:
    return list(open_input(spec, **kwargs))


@pytest.fixture
def small_units(monkeypatch):
    """Units of a few KiB / rows, so small test inputs are cut in many places."""
    monkeypatch.setattr(input_plan, "UNIT_BYTES", (1, 64 << 20))
    monkeypatch.setattr(input_plan, "UNIT_ROWS", 7)


def test_json_lines_cut_in_byte_ranges_read_as_the_local_reader_reads(tmp_path, small_units):
    source = tmp_path / "in.jsonl"
    source.write_text(jsonl_text(200))
    plan = plan_input(str(source), parallelism=23)
    assert len(plan.units) == 23 and plan.total is None  # counted by Ray tasks before the job
    assert read_plan(plan) == local_rows(str(source))
    bad = [r for r in read_plan(plan) if r.error]
    assert [(r.where, r.error[:14]) for r in bad] == [
        ("row 40 (line 44)", "not valid JSON"),
        ("row 41 (line 45)", "not a JSON obj"),
    ]


def test_rows_already_done_are_skipped_and_the_rest_keep_their_numbers(tmp_path, small_units):
    source = tmp_path / "in.jsonl"
    source.write_text(jsonl_text(120))
    done = RowRanges.of_pairs([(0, 30), (50, 51), (100, 120)])
    rows = read_plan(plan_input(str(source), parallelism=9), done)
    expected = [r for r in local_rows(str(source)) if r.index not in done]
    assert rows == expected and len(rows) == 120 - 51


def test_a_directory_of_json_lines_parts_numbers_rows_across_files(tmp_path, small_units):
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text(jsonl_text(30))
    (folder / "part-1.jsonl").write_text("\n" + jsonl_text(20))
    plan = plan_input(str(folder), parallelism=3)
    assert read_plan(plan) == local_rows(str(folder))


def test_parquet_runs_of_row_groups_and_slices_of_a_large_one_read_every_row_once(tmp_path, small_units):
    folder = tmp_path / "pq"
    folder.mkdir()
    records = [{"id": f"p{i}", "prompt": f"p {i}", "extra": i} for i in range(100)]
    table = pa.Table.from_pylist(records)
    pq.write_table(table.slice(0, 40), folder / "a.parquet", row_group_size=3)  # small groups: runs of them
    pq.write_table(table.slice(40), folder / "b.parquet", row_group_size=60)  # one large group: slices
    plan = plan_input(str(folder), columns={"id", "prompt"}, parallelism=10)
    assert plan.total == 100 and all(u.rows and u.rows <= 7 for u in plan.units)
    assert any(u.skip for u in plan.units)
    assert read_plan(plan) == local_rows(str(folder), columns={"id", "prompt"})


def test_a_json_array_file_is_one_unit(tmp_path):
    source = tmp_path / "in.json"
    source.write_text(json.dumps([{"id": "a", "prompt": "x"}, 3, {"prompt": "y"}]))
    plan = plan_input(str(source))
    assert [u.kind for u in plan.units] == ["json_array"]
    assert read_plan(plan) == local_rows(str(source))


def test_hugging_face_datasets_saved_and_streamed_read_as_the_local_reader_reads(tmp_path, small_units):
    datasets = pytest.importorskip("datasets")
    records = [{"id": f"h{i}", "prompt": f"hf {i}"} for i in range(30)]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records[:20]), "test": datasets.Dataset.from_list(records[20:])}
    ).save_to_disk(saved)
    for split in ("train", "test"):
        plan = plan_input(None, dataset=str(saved), split=split)
        assert read_plan(plan) == local_rows(None, dataset=str(saved), split=split)
    streamed = tmp_path / "stream"
    streamed.mkdir()
    (streamed / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    plan = plan_input(None, dataset=str(streamed))
    assert [u.kind for u in plan.units] == ["hf_stream"] and plan.total is None
    assert read_plan(plan, RowRanges.of_pairs([(0, 5)])) == local_rows(None, dataset=str(streamed))[5:]


def test_inputs_ray_workers_cannot_read_are_refused_with_one_line(tmp_path):
    with pytest.raises(InputError, match="cannot read stdin"):
        plan_input("-")
    with pytest.raises(InputError, match="input not found"):
        plan_input(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(InputError, match="cannot read Parquet input"):
        plan_input(str(tmp_path / "bad.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown input format"):
        plan_input(str(tmp_path / "x.csv"))


def test_row_ranges_hold_a_set_of_rows_as_ranges():
    import random

    rng = random.Random(0)
    rows = {rng.randrange(1000) for _ in range(400)} | set(range(500, 700))
    ranges = RowRanges.of_rows(rows)
    assert len(ranges) == len(rows) and ranges.num_ranges < len(rows)
    probe = list(range(-3, 1003))
    assert [bool(m) for m in ranges.mask(probe)] == [p in rows for p in probe]
    halves = RowRanges.union(
        [RowRanges.of_rows(r for r in rows if r < 600), RowRanges.of_rows(r for r in rows if r >= 600)]
    )
    assert halves == ranges == RowRanges.of_pairs(ranges.pairs()[::-1])
    assert RowRanges.of_pairs([(0, 10), (5, 20), (20, 25), (30, 31)]).pairs() == [[0, 25], [30, 31]]
    inside = ranges.within(550, 650)
    assert list(inside.pairs()) == [[550, 650]] and 549 not in inside
    assert len(RowRanges.empty()) == 0 and not RowRanges.empty().mask([1, 2]).any()


def test_every_unit_kind_is_counted_or_needs_no_count(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"a": 1}\n\n{"a": 2}\n')
    (unit,) = plan_input(str(source)).units
    assert count_unit(unit) == (2, 3)
    with pytest.raises(ValueError, match="needs no count"):
        count_unit(input_plan.InputUnit("parquet", str(source)))
    assert Path(unit.path) == source
