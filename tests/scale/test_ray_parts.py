"""Worker-written parts and their manifests (issue 35), without Ray: the actor called directly, fake engine.

A block becomes one part named after its rows, written atomically with a
manifest of its rows and ids; a retried block overwrites its own part; a block
whose worker died is written in pieces that skip what the dead attempt wrote; a
row that kills its worker alone becomes an error row. The driver's side reads
the manifests back (--resume) as row ranges, removes what a kill left
half-written, and refuses an OUTPUT it must not touch.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from ray_fakes import FakeEngineWriter

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.reader import RawRow
from cbrun.scale import id_check
from cbrun.scale.finalize import conform_part, finalize_parts
from cbrun.scale.id_check import find_duplicate_ids
from cbrun.scale.output_dir import OutputError, manifest_paths, part_files, prepare_output, scan_output
from cbrun.scale.part_store import BlockCounters, BlockKey, PartStore, StaleRunError, read_manifest_meta
from cbrun.scale.part_writer import DEPTH_PER_RETRY, MAX_ROW_ATTEMPTS, part_table
from cbrun.scale.ray_data import raw_blocks
from cbrun.scale.row_ranges import RowRanges

SAMPLING = dict(max_tokens=4, temperature=0.0, seed=0)


def block(first: int, count: int, bad: int | None = None):
    """A RAW block of input rows first..first+count-1 (row `bad` unparseable)."""
    rows = [
        RawRow(i, None, "not valid JSON: oops", i + 3)
        if i == bad
        else RawRow(i, {"id": f"r{i}", "prompt": f"prompt {i}"})
        for i in range(first, first + count)
    ]
    (table,) = raw_blocks(rows, block_rows=count)
    return table


def writer(tmp_path, kind: str = "parquet", run: str = "", **kwargs) -> FakeEngineWriter:
    return FakeEngineWriter(
        output=str(tmp_path / f"out.{kind}"), output_kind=kind, run=run, sampling=SAMPLING, **kwargs
    )


def counters(table) -> BlockCounters:
    (values,) = table.to_pylist()
    return BlockCounters.from_dict(values)


def output_rows(store: PartStore) -> list[dict]:
    if store.kind == "parquet":
        return pads.dataset(store.root, format="parquet").to_table().to_pylist()
    return [json.loads(line) for part in part_files(store) for line in part.read_text().splitlines()]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_block_becomes_one_part_named_after_its_rows_with_a_manifest_of_its_ids(tmp_path, kind):
    actor = writer(tmp_path, kind, logprobs=True)
    result = counters(actor(block(100, 20, bad=105)))
    assert (result.rows, result.failed, result.samples) == (20, 1, 20)
    store = actor.store
    assert [p.name for p in part_files(store)] == [f"part-000000000100-000000000119.{kind}"]
    rows = output_rows(store)
    assert sorted(r["id"] for r in rows) == sorted(["105"] + [f"r{i}" for i in range(100, 120) if i != 105])
    assert next(r for r in rows if r["id"] == "105")["error"] == "row 105 (line 108): not valid JSON: oops"
    (manifest,) = manifest_paths(store)
    table = pq.read_table(manifest)
    assert table.column("row").to_pylist() == list(range(100, 120))
    assert table.column("id").to_pylist()[5] == "105"
    meta = read_manifest_meta(manifest)
    assert meta["ranges"] == [[100, 120]] and meta["rows"] == 20 and meta["part"] == part_files(store)[0].name
    assert not list(store.root.glob(".part-*")) and not list(store.manifests.glob(".*"))  # no temporary files


def test_a_block_run_again_keeps_its_one_part(tmp_path):
    actor = writer(tmp_path)
    first = counters(actor(block(0, 10)))
    again = counters(actor(block(0, 10)))  # Ray ran the block again (its first result was lost)
    assert first == again and len(part_files(actor.store)) == 1
    assert len(output_rows(actor.store)) == 10


def test_a_block_whose_worker_died_is_written_in_pieces_skipping_what_was_written(tmp_path):
    actor = writer(tmp_path)
    key = BlockKey(0, 63)
    actor.store.begin_attempt(key)  # a first attempt started and died
    actor.store.write_part(key, pa.table({"stale": [1]}))  # ... between writing its part and its manifest
    result = counters(actor(block(0, 64)))
    assert (result.rows, result.retried) == (64, 1)
    names = [p.name for p in part_files(actor.store)]
    assert len(names) == 2**DEPTH_PER_RETRY and f"{key.name}.parquet" not in names  # the stale part is gone
    assert sorted(r["id"] for r in output_rows(actor.store)) == sorted(f"r{i}" for i in range(64))

    # a third attempt: pieces of the second stay as they are, the rest is cut finer
    (actor.store.manifest_path(BlockKey(0, 7))).unlink()
    actor.store.part_path(BlockKey(0, 7)).unlink()
    result = counters(actor(block(0, 64)))
    assert result.rows == 64 and len(output_rows(actor.store)) == 64
    assert len(part_files(actor.store)) == 2**DEPTH_PER_RETRY - 1 + 8


def test_a_row_that_kills_its_worker_alone_becomes_an_error_row(tmp_path):
    actor = writer(tmp_path)
    for _ in range(3):  # three attempts died: the third cut the block down to single rows
        actor.store.begin_attempt(BlockKey(10, 17))
    for _ in range(MAX_ROW_ATTEMPTS):  # ... and row 12 killed its worker alone, each time
        actor.store.begin_attempt(BlockKey(12, 12))
    result = counters(actor(block(10, 8)))
    assert (result.rows, result.failed, result.given_up) == (8, 1, 1)
    (given_up,) = [r for r in output_rows(actor.store) if r["error"]]
    assert given_up["id"] == "r12" and given_up["finish_reason"] == "error"
    assert given_up["error"].startswith("row 12: not generated: the Ray worker running this row died 3 times")


def test_resume_reads_manifests_as_row_ranges_and_removes_half_written_parts(tmp_path):
    prepare_output(
        PartStore(tmp_path / "out.parquet", "parquet", "run1"), resume=False, overwrite=False, input_name="x"
    )
    actor = writer(tmp_path, run="run1")
    store = actor.store
    actor(block(0, 30))
    actor(block(50, 10))
    store.write_part(BlockKey(70, 79), pa.table({"x": [1]}))  # killed before its manifest
    (store.root / ".part-000000000080-000000000089.parquet.1234.tmp").write_text("half")
    with pytest.raises(OutputError, match=r"exists .*--resume"):
        prepare_output(PartStore(store.root, "parquet", "run2"), resume=False, overwrite=False, input_name="x")
    with pytest.raises(OutputError, match="holds parquet parts, not jsonl"):
        prepare_output(PartStore(store.root, "jsonl", "run2"), resume=True, overwrite=False, input_name="x")
    resumed = PartStore(store.root, "parquet", "run2")
    state = prepare_output(resumed, resume=True, overwrite=False, input_name="in.jsonl")
    assert state.done.pairs() == [[0, 30], [50, 60]] and state.removed == 1
    assert (state.parts, state.counters.rows) == (2, 40)
    assert not resumed.part_path(BlockKey(70, 79)).exists() and not list(store.root.glob(".part-*"))
    with pytest.raises(StaleRunError):  # a worker of the first run, still alive, writes nothing now
        actor(block(90, 5))
    assert scan_output(resumed).done == RowRanges.of_pairs([(0, 30), (50, 60)])
    fresh = prepare_output(PartStore(store.root, "parquet", "run3"), resume=False, overwrite=True, input_name="x")
    assert len(fresh.done) == 0 and part_files(resumed) == []


def test_an_output_that_is_not_a_ray_job_is_refused(tmp_path):
    one_file = tmp_path / "out.parquet"
    pq.write_table(pa.table({"id": ["a"]}), one_file)
    with pytest.raises(OutputError, match="one file, written without --ray"):
        prepare_output(PartStore(one_file, "parquet", "r"), resume=True, overwrite=False, input_name="x")
    with pytest.raises(OutputError, match="contradict"):
        prepare_output(PartStore(one_file, "parquet", "r"), resume=True, overwrite=True, input_name="x")
    prepare_output(PartStore(one_file, "parquet", "r"), resume=False, overwrite=True, input_name="x")
    assert one_file.is_dir()
    foreign = tmp_path / "other.jsonl"
    foreign.mkdir()
    (foreign / "part-1.jsonl").write_text("{}\n")
    with pytest.raises(OutputError, match="not written by cbrun generate --ray"):
        prepare_output(PartStore(foreign, "jsonl", "r"), resume=True, overwrite=False, input_name="x")


def test_duplicate_ids_across_parts_are_found_with_bounded_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(id_check, "BUCKET_ROWS", 8)  # many buckets, on disk
    store = PartStore(tmp_path / "out.parquet", "parquet")
    store.manifests.mkdir(parents=True)
    ids = [f"id{i}" for i in range(60)]
    ids[45], ids[59] = "id3", "id3"  # rows 3, 45 and 59 share an id
    ids[30] = "id7"  # rows 7 and 30
    for first in range(0, 60, 10):
        store.write_manifest(
            BlockKey(first, first + 9), list(range(first, first + 10)), ids[first : first + 10], BlockCounters()
        )
    found = find_duplicate_ids(manifest_paths(store), total_rows=60)
    assert found.count == 2 and sorted(found.examples) == [("id3", [3, 45, 59]), ("id7", [7, 30])]
    assert "2 ids are used by more than one input row" in found.describe()
    assert find_duplicate_ids(manifest_paths(store)[:1], total_rows=10).count == 0


def test_parts_that_disagree_on_columns_are_brought_to_one_schema(tmp_path):
    fmt = CbrunFormat(keep_columns=("meta", "score"))
    base = {"sample": 0, "completion": "", "completion_token_ids": [], "finish_reason": "stop"}
    base.update(num_prompt_tokens=1, num_completion_tokens=0, num_cached_tokens=0, error=None)
    rows_a = [{**base, "id": "a", "meta": 1, "score": None, "structured": "complete"}]
    rows_b = [{**base, "id": "b", "meta": None, "score": 2.5}]
    rows_c = [{**base, "id": "c", "meta": "text", "score": 1}]
    folder = tmp_path / "out.parquet"
    folder.mkdir()
    for name, rows in (("part-a", rows_a), ("part-b", rows_b), ("part-c", rows_c)):
        pq.write_table(part_table(rows, fmt), folder / f"{name}.parquet")
    parts = sorted(folder.glob("*.parquet"))

    def rewrite(paths, schema):
        for path in paths:
            conform_part(str(path), schema)

    assert finalize_parts(parts, fmt, rewrite) == 3
    table = pads.dataset(folder, format="parquet").to_table()
    assert table.schema.field("score").type == pa.float64() and table.schema.field("meta").type == pa.string()
    got = {r["id"]: (r["meta"], r["score"], r["structured"]) for r in table.to_pylist()}
    assert got == {"a": ("1", None, "complete"), "b": (None, 2.5, None), "c": ("text", 1.0, None)}
    assert finalize_parts(parts, fmt, rewrite) == 0  # nothing left to do
