"""`CbrunGenerator`, the `Dataset.map_batches` callable (issue 16), called directly: no Ray needed.

A batch in, the rows of `cbrun generate` out: same columns, same greedy tokens,
and every bad row an error row instead of an exception (which would fail the
Ray task and, after retries, the whole job).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import write_jsonl

from cbrun.cli.app import main
from cbrun.cli.generate_options import GenerateOptions
from cbrun.cli.ray_run import generator_args
from cbrun.data.generate.format import CbrunFormat
from cbrun.data.reader import RawRow
from cbrun.engine import EngineConfig, SamplingParams, StructuredSpec
from cbrun.scale.ray_data import ERROR, LINE, RECORD, ROW, TEXT, CbrunGenerator, raw_blocks, raw_rows

ROWS = [
    {"id": "fox", "prompt": "the quick brown fox"},
    {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "ids", "input_ids": [1, 40, 41, 42, 43]},
    {"id": "hot", "prompt": "paged attention", "temperature": 0.0, "max_tokens": 3},
]
SAMPLING = dict(max_tokens=6, temperature=0.0)
ENGINE = dict(num_blocks=128, page_size=16)
# no `threads=`: it would call torch.set_num_threads for every later test of this pytest process


def table_of(rows: list[dict]) -> pa.Table:
    """A Table with every key of every row (pyarrow's from_pylist takes the columns of the first row only)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows])


@pytest.fixture(scope="module")
def generator(tiny_llama_dir):
    return CbrunGenerator(str(tiny_llama_dir), sampling=SAMPLING, engine=ENGINE, logprobs=True)


@pytest.fixture(scope="module")
def cli_rows(tiny_llama_dir, tmp_path_factory):
    """What `cbrun generate` writes for ROWS (Parquet, so logprobs are float32 as in the callable's table)."""
    folder = tmp_path_factory.mktemp("cli")
    out = folder / "out.parquet"
    assert (
        main(
            [
                "generate",
                str(write_jsonl(folder / "in.jsonl", ROWS)),
                str(out),
                "-m",
                str(tiny_llama_dir),
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--num-blocks",
                "128",
                "--page-size",
                "16",
                "--logprobs",
                "-q",
            ]
        )
        == 0
    )
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}


def test_a_pyarrow_batch_gives_the_rows_and_columns_of_cbrun_generate(generator, cli_rows):
    table = generator(table_of(ROWS))
    assert table.schema == CbrunFormat(logprobs=True).arrow_schema()
    rows = {r["id"]: r for r in table.to_pylist()}
    assert set(rows) == set(cli_rows)
    for row_id, row in rows.items():
        expected = cli_rows[row_id]
        assert row["completion_token_ids"] == expected["completion_token_ids"], row_id
        assert row["completion"] == expected["completion"] and row["finish_reason"] == expected["finish_reason"]
        assert len(row["logprobs"]) == len(expected["logprobs"]) and row["error"] is None
    assert rows["hot"]["num_completion_tokens"] == 3  # a row's own sampling fields override


@pytest.mark.parametrize("batch_format", ["pandas", "numpy"])
def test_pandas_and_numpy_batches_give_the_same_rows(generator, batch_format):
    table = table_of(ROWS)
    batch = (
        table.to_pandas()
        if batch_format == "pandas"
        else {name: np.array(table.column(name).to_pylist(), dtype=object) for name in table.column_names}
    )
    expected = {r["id"]: r["completion_token_ids"] for r in generator(table).to_pylist()}
    assert {r["id"]: r["completion_token_ids"] for r in generator(batch).to_pylist()} == expected


def test_bad_rows_become_error_rows_and_never_raise(generator):
    batch = table_of(
        [
            {"id": "ok", "prompt": "the quick brown fox", "max_tokens": None},
            {"id": "empty", "prompt": "", "max_tokens": None},
            {"id": None, "prompt": "no id here", "max_tokens": None},
            {"id": "too-long", "prompt": "fox", "max_tokens": 10_000},
            {"id": "ok", "prompt": "a duplicate id", "max_tokens": None},
        ]
    )
    rows = generator(batch).to_pylist()
    errors = sorted((r["id"], r["error"]) for r in rows if r["error"])
    assert [r["id"] for r in rows if not r["error"]] == ["ok"]
    assert errors[0][0] == "2" and "rows of a Ray dataset have no row numbers" in errors[0][1]
    assert "empty prompt" in dict(errors)["empty"] and "exceeds the model's context" in dict(errors)["too-long"]
    assert "duplicate id 'ok'" in dict(errors)["ok"]
    assert generator(pa.Table.from_pylist([])).num_rows == 0


def test_rows_sent_by_cbrun_generate_ray_keep_their_row_numbers_in_error_messages(generator):
    raws = [
        RawRow(40, {"id": "a", "prompt": "fox"}),
        RawRow(41, None, "not valid JSON: oops", 43),
        RawRow(42, {"prompt": ""}),
    ]
    (block,) = raw_blocks(raws, block_rows=10)
    assert block.column_names == [ROW, RECORD, ERROR, LINE, TEXT]
    back = raw_rows(block)
    assert [(r.index, r.record, r.error, r.line) for r in back] == [
        (40, {"id": "a", "prompt": "fox"}, None, None),
        (41, None, "not valid JSON: oops", 43),
        (42, {"prompt": ""}, None, None),
    ]
    rows = {r["id"]: r for r in generator(block).to_pylist()}
    assert rows["41"]["error"] == "row 41 (line 43): not valid JSON: oops"
    assert rows["42"]["error"] == "row 42: prompt: empty prompt"  # no id: the row number, as without Ray
    assert rows["a"]["error"] is None


def test_kept_columns_of_mixed_types_become_json_text(tiny_llama_dir):
    generator = CbrunGenerator(str(tiny_llama_dir), sampling=SAMPLING, engine=ENGINE, keep_columns=("meta",))
    table = generator(
        {
            "id": np.array(["a", "b"], dtype=object),
            "prompt": np.array(["fox", "dog"], dtype=object),
            "meta": np.array([{"k": 1}, "text"], dtype=object),
        }
    )
    assert table.schema.field("meta").type == pa.string()
    assert sorted(r["meta"] for r in table.to_pylist()) == sorted([json.dumps({"k": 1}), "text"])


def test_a_job_wide_constraint_and_a_rows_own_both_give_the_structured_column(tiny_llama_dir):
    """Ray blocks share one schema, so the structured column is decided per job (issue 26): on with a
    job-wide constraint (the sampling's own turns it on), and on with structured=True (rows carrying their
    own constraints), where a block without constrained rows has the column too. (`cbrun generate --ray`
    writes parts itself and brings them to one schema when the job ends: tests/scale/test_ray_parts.py.)"""
    opts, engine = GenerateOptions(model=str(tiny_llama_dir)), EngineConfig(**ENGINE)
    with_column = CbrunFormat(structured=True).arrow_schema()
    free = [{"id": "free", "prompt": "anything", "choice": None}]

    job_wide = SamplingParams(**SAMPLING, structured=StructuredSpec("choice", ("yes", "no")))
    generator = CbrunGenerator(**generator_args(opts, job_wide, engine, (), structured=False))
    table = generator(table_of([{"id": "a", "prompt": "yes or no?"}, {"id": "b", "prompt": "the quick brown fox"}]))
    assert table.schema == with_column
    assert all(r["structured"] == "complete" and r["completion"] in ("yes", "no") for r in table.to_pylist())

    raws = [RawRow(0, {"id": "own", "prompt": "yes or no?", "choice": ["yes", "no"]}), RawRow(1, free[0])]
    generator = CbrunGenerator(**generator_args(opts, SamplingParams(**SAMPLING), engine, (), structured=True))
    (block,) = raw_blocks(raws, block_rows=10)
    rows = {r["id"]: r for r in generator(block).to_pylist()}
    assert rows["own"]["structured"] == "complete" and rows["own"]["completion"] in ("yes", "no")
    assert rows["free"]["structured"] is None and rows["free"]["error"] is None
    assert generator(block).schema == generator(table_of(free)).schema == with_column
