"""Input readers: JSON Lines, JSON arrays, Parquet files and directories, HF datasets."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.data.reader import InputError, count_jsonl_rows, iter_jsonl, open_input


def test_jsonl_skips_blank_lines_and_turns_bad_lines_into_error_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n   \nnot json\n[1, 2]\n{"prompt": "b"}\n\xff\xfe\n')
    source = open_input(str(path))
    rows = list(source)
    assert source.total == 5
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0].record == {"prompt": "a"} and rows[0].error is None
    assert rows[1].record is None and "not valid JSON" in rows[1].error and rows[1].line == 4
    assert rows[1].where == "row 1 (line 4)"
    assert "not a JSON object" in rows[2].error
    assert rows[3].record == {"prompt": "b"}
    assert rows[4].record is None and rows[4].error


def test_jsonl_stream_rows_are_numbered_from_zero():
    rows = list(iter_jsonl(io.BytesIO(b'{"a": 1}\n{"a": 2}')))
    assert [(r.index, r.record, r.where) for r in rows] == [(0, {"a": 1}, "row 0"), (1, {"a": 2}, "row 1")]


def test_json_array_file_is_read(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps([{"prompt": "a"}, 3, {"prompt": "b"}], indent=2))
    source = open_input(str(path))
    rows = list(source)
    assert source.total == 3
    assert rows[0].record == {"prompt": "a"} and rows[1].error and rows[2].record == {"prompt": "b"}


def test_peek_does_not_consume(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    source = open_input(str(path))
    assert source.peek().record == {"prompt": "a"}
    assert [r.record["prompt"] for r in source] == ["a", "b"]


def test_parquet_file_and_directory_stream_rows_with_total(tmp_path):
    table = pa.table({"id": ["x", "y", "z"], "prompt": ["a", "b", "c"], "other": [1, 2, 3]})
    pq.write_table(table, tmp_path / "one.parquet")
    source = open_input(str(tmp_path / "one.parquet"), columns={"id", "prompt"})
    assert source.total == 3
    assert [r.record for r in source] == [
        {"id": "x", "prompt": "a"},
        {"id": "y", "prompt": "b"},
        {"id": "z", "prompt": "c"},
    ]
    folder = tmp_path / "dir"
    folder.mkdir()
    pq.write_table(table.slice(0, 2), folder / "part-0.parquet")
    pq.write_table(table.slice(2), folder / "part-1.parquet")
    source = open_input(str(folder))
    assert source.total == 3
    rows = list(source)
    assert [r.index for r in rows] == [0, 1, 2] and rows[2].record["other"] == 3


def test_saved_hf_dataset_is_read_by_path(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "a", "id": "1"}, {"prompt": "b", "id": "2"}]).save_to_disk(
        str(tmp_path / "ds")
    )
    for source in (open_input(None, dataset=str(tmp_path / "ds")), open_input(str(tmp_path / "ds"))):
        assert source.total == 2
        assert [r.record["prompt"] for r in source] == ["a", "b"]


def test_missing_and_unknown_inputs_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="not found"):
        open_input(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown input format"):
        open_input(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"no \.parquet files"):
        open_input(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="cannot load dataset"):
        open_input(None, dataset=str(tmp_path / "no-such-dataset"))


def test_count_jsonl_rows_ignores_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a":1}\n\n{"a":2}')
    assert count_jsonl_rows(path) == 2
