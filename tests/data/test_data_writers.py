"""Incremental writers and resume state: partial lines, journals, atomic Parquet, duplicates."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.data.generate.format import CbrunFormat
from cbrun.data.resume import ResumeError, ResumeState, load_resume_state, scan_jsonl
from cbrun.data.writers import JsonlWriter, ParquetOutput, journal_path

FMT = CbrunFormat(logprobs=True, keep_columns=("label",))


def row(i, sample=0, reason="length", error=None, label=None):
    return {
        "id": str(i),
        "sample": sample,
        "completion": f"c{i}",
        "completion_token_ids": [i, i + 1],
        "logprobs": [-0.5, -0.25],
        "finish_reason": reason,
        "num_prompt_tokens": 3,
        "num_completion_tokens": 2,
        "num_cached_tokens": 0,
        "error": error,
        "label": label,
    }


def test_jsonl_writer_flushes_every_n_rows_and_after_a_delay():
    class Spy(io.BytesIO):
        flushes = 0

        def flush(self):
            Spy.flushes += 1

    writer = JsonlWriter(Spy(), fsync=False, flush_rows=3, flush_seconds=0.0)
    for i in range(3):
        writer.write(row(i))
    assert Spy.flushes == 1
    writer.write(row(3))
    writer.maybe_flush()
    assert Spy.flushes == 2
    writer.maybe_flush()  # nothing new: no flush
    assert Spy.flushes == 2


def test_jsonl_rows_are_one_line_each_and_non_json_values_become_text(tmp_path):
    path = tmp_path / "o.jsonl"
    writer = JsonlWriter.open(path, append=False)
    writer.write({"id": "1", "when": __import__("datetime").date(2024, 1, 2), "text": "é\nx"})
    writer.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == {"id": "1", "when": "2024-01-02", "text": "é\nx"}


def test_resume_cuts_a_partial_last_line_and_collects_done_samples(tmp_path):
    path = tmp_path / "o.jsonl"
    body = b"".join(json.dumps(r).encode() + b"\n" for r in (row(0), row(1, sample=1), row(2)))
    path.write_bytes(body + b'{"id": "3", "sam')
    state = load_resume_state(path, "jsonl", FMT.classify)
    assert path.read_bytes() == body
    assert state.done == {("0", 0), ("1", 1), ("2", 0)}
    assert state.missing_samples("1", range(3)) == [0, 2]
    assert state.missing_samples("3", range(1)) == [0]


def test_resume_drops_killed_and_duplicate_lines_and_keys_bad_rows_by_number(tmp_path):
    path = tmp_path / "o.jsonl"
    rows = [
        row(0),
        row(1, reason="error", error="row 1 (engine): engine stopped before the request finished"),
        row(2, reason="cancelled"),
        row(0),
        row(5, reason="error", error="row 5 (line 7): prompt: empty prompt"),
        row(6, reason="error", error="row 6 (engine): boom"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "garbage\n")
    state = load_resume_state(path, "jsonl", FMT.classify)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in kept] == ["0", "5", "6"]
    assert state.done == {("0", 0), ("6", 0)} and state.bad_rows == {5}
    assert state.failed_rows == 2 and state.rows == 3


def test_resume_refuses_output_of_another_format(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text('{"custom_id": "a", "response": {}}\n')
    with pytest.raises(ResumeError, match="line 1"):
        load_resume_state(path, "jsonl", FMT.classify)


def test_parquet_output_is_journaled_then_finalized_atomically(tmp_path):
    path = tmp_path / "o.parquet"
    out = ParquetOutput(path, FMT)
    out.write(row(0, label=1))
    out.write(row(1, label=2))
    out.flush()
    assert journal_path(path).exists() and not path.exists()
    out.close()
    assert not journal_path(path).exists()
    table = pq.read_table(path)
    assert table.column_names == FMT.columns()
    assert table.column("id").to_pylist() == ["0", "1"]
    assert table.column("label").to_pylist() == [1, 2]
    assert table.schema.field("logprobs").type.value_type == pa.float32()


def test_parquet_resume_reads_file_and_journal_and_merges_without_duplicates(tmp_path):
    path = tmp_path / "o.parquet"
    first = ParquetOutput(path, FMT)  # an interrupted first run: finalized with rows 0, 1
    first.write(row(0, label="a"))
    first.write(row(1, label="b"))
    first.close()
    # a killed second run: journal holds row 2, a stale copy of row 1 and a partial line
    journal = journal_path(path)
    journal.write_bytes(
        (json.dumps(row(2, label="c")) + "\n" + json.dumps(row(1, label="b")) + "\n" + '{"id": "9"').encode()
    )
    state = load_resume_state(path, "parquet", FMT.classify)
    assert state.done == {("0", 0), ("1", 0), ("2", 0)}
    third = ParquetOutput(path, FMT)
    third.write(row(3, label=None))
    third.close()
    table = pq.read_table(path)
    assert table.column("id").to_pylist() == ["0", "1", "2", "3"]
    assert table.column("label").to_pylist() == ["a", "b", "c", None]


def test_keep_columns_of_mixed_types_are_stored_as_text(tmp_path):
    path = tmp_path / "o.parquet"
    out = ParquetOutput(path, FMT)
    out.write(row(0, label=1))
    out.write(row(1, label={"x": 2}))
    out.close()
    assert pq.read_table(path).column("label").to_pylist() == ["1", '{"x": 2}']


def test_empty_parquet_output_is_still_a_valid_file(tmp_path):
    path = tmp_path / "o.parquet"
    ParquetOutput(path, FMT).close()
    table = pq.read_table(path)
    assert table.num_rows == 0 and table.column_names == FMT.columns()


def test_scan_jsonl_on_a_clean_file_changes_nothing(tmp_path):
    path = tmp_path / "o.jsonl"
    text = json.dumps(row(0)) + "\n\n" + json.dumps(row(1)) + "\n"
    path.write_text(text)
    assert scan_jsonl(path, FMT.classify, ResumeState()) == 0
    assert path.read_text() == text
