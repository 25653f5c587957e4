"""`cbrun generate` with structured outputs: per-row constraints, job-wide flags, OpenAI
`response_format`, incomplete rows, bad constraints as error rows, resume, one-line CLI errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow.parquet as pq
import pytest
from cli_helpers import engine_args, read_jsonl, write_jsonl

from cbrun.cli.app import main
from cbrun.cli.common import EXIT_ROWS_FAILED, EXIT_USAGE
from cbrun.data.constraints import response_format_fields, row_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["label", "score", "note"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"\n'


def _rows():
    return [
        {"id": "schema", "prompt": "classify: buy now", "json_schema": SCHEMA},
        {"id": "schema-text", "prompt": "classify: hello", "json_schema": json.dumps(SCHEMA)},
        {"id": "regex", "prompt": "a code", "regex": r"[A-Z]{2}[0-9]{2,3}"},
        {"id": "choice", "prompt": "yes or no?", "choice": ["yes", "no"]},
        {"id": "grammar", "prompt": "a colour", "grammar": GRAMMAR},
        {"id": "free", "prompt": "anything"},
        {"id": "bad-regex", "prompt": "x", "regex": "(unclosed"},
        {"id": "bad-keyword", "prompt": "x", "json_schema": {"type": "array", "uniqueItems": True}},
        {"id": "empty-choice", "prompt": "x", "choice": []},
        {"id": "two", "prompt": "x", "regex": "a", "choice": ["a"]},
    ]


def test_row_constraints_give_valid_rows_and_bad_ones_error_rows(tiny_llama_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "generate",
            str(write_jsonl(tmp_path / "in.jsonl", _rows())),
            str(out),
            *engine_args(tiny_llama_dir, max_tokens=80),
        ]
    )
    assert code == EXIT_ROWS_FAILED  # the bad rows; every other row went on
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert len(rows) == 10
    for rid in ("schema", "schema-text"):
        assert rows[rid]["finish_reason"] == "stop" and rows[rid]["structured"] == "complete"
        jsonschema.validate(json.loads(rows[rid]["completion"]), SCHEMA)
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2,3}", rows["regex"]["completion"])
    assert rows["choice"]["completion"] in ("yes", "no")
    assert re.fullmatch(r"colour: (red|green|blue)", rows["grammar"]["completion"])
    assert "structured" not in rows["free"] and rows["free"]["error"] is None
    errors = {rid: rows[rid]["error"] for rid in ("bad-regex", "bad-keyword", "empty-choice", "two")}
    assert errors["bad-regex"].startswith("row 6 (engine): regex: does not compile")
    assert "uniqueItems" in errors["bad-keyword"] and errors["bad-keyword"].startswith("row 7 ")
    assert errors["empty-choice"] == "row 8: choice: the list of choices is empty"
    assert errors["two"].startswith("row 9: choice, regex: give one")
    assert all(rows[rid]["finish_reason"] == "error" and "\n" not in rows[rid]["error"] for rid in errors)


def test_job_wide_schema_is_overridden_by_a_rows_own_and_parquet_has_the_column(tiny_llama_dir, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    rows = [{"id": f"r{i}", "prompt": f"row {i} text"} for i in range(6)] + [
        {"id": "own", "prompt": "pick", "choice": ["alpha", "beta"]}
    ]
    out = tmp_path / "out.parquet"
    assert (
        main(
            [
                "generate",
                str(write_jsonl(tmp_path / "in.jsonl", rows)),
                str(out),
                "--json-schema",
                str(schema_file),
                "--seed",
                "3",
                "--n",
                "2",
                *engine_args(tiny_llama_dir, max_tokens=80),
                "--temperature",
                "0.8",
            ]
        )
        == 0
    )
    table = pq.read_table(out).to_pylist()
    assert len(table) == 14
    for row in table:
        assert row["structured"] == "complete"
        if row["id"] == "own":
            assert row["completion"] in ("alpha", "beta")
        else:
            jsonschema.validate(json.loads(row["completion"]), SCHEMA)


def test_max_tokens_before_completion_is_length_and_incomplete_then_resume_finishes(tiny_llama_dir, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"text {i}", "json_schema": SCHEMA} for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(inp), str(out), *engine_args(tiny_llama_dir, max_tokens=3)]) == 0
    for row in read_jsonl(out):
        assert row["finish_reason"] == "length" and row["structured"] == "incomplete"
    # resume: keep two finished rows, the rest is redone under the same constraint
    full = tmp_path / "full.jsonl"
    assert main(["generate", str(inp), str(full), *engine_args(tiny_llama_dir, max_tokens=80)]) == 0
    first = read_jsonl(full)
    full.write_text("".join(json.dumps(r) + "\n" for r in first[:2]))
    assert main(["generate", str(inp), str(full), "--resume", *engine_args(tiny_llama_dir, max_tokens=80)]) == 0
    resumed = read_jsonl(full)
    assert sorted(r["id"] for r in resumed) == [f"r{i}" for i in range(4)]
    assert {r["id"]: r["completion"] for r in resumed} == {r["id"]: r["completion"] for r in first}
    for row in resumed:
        jsonschema.validate(json.loads(row["completion"]), SCHEMA)


def test_openai_batch_response_format_validates_with_the_openai_sdk(tiny_llama_dir, tmp_path):
    openai_types = pytest.importorskip("openai.types.chat")

    def line(cid, response_format, **body):
        return {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": cid}],
                "response_format": response_format,
                **body,
            },
        }

    requests = [
        line(
            "schema",
            {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA, "strict": True}},
            n=2,
            temperature=0.7,
            seed=1,
            logprobs=True,
            top_logprobs=2,
        ),
        line("object", {"type": "json_object"}, max_tokens=6),
        line("text", {"type": "text"}),
        line("bad", {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    ]
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                str(write_jsonl(tmp_path / "in.jsonl", requests)),
                str(out),
                *engine_args(tiny_llama_dir, max_tokens=80),
            ]
        )
        == EXIT_ROWS_FAILED
    )
    lines = {r["custom_id"]: r for r in read_jsonl(out)}
    for cid in ("schema", "object", "text"):
        body = lines[cid]["response"]["body"]
        completion = openai_types.ChatCompletion.model_validate(body)
        assert completion.object == "chat.completion"
    schema_body = openai_types.ChatCompletion.model_validate(lines["schema"]["response"]["body"])
    assert len(schema_body.choices) == 2
    for choice in schema_body.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.logprobs.content and len(choice.logprobs.content[0].top_logprobs) == 2
    cut = openai_types.ChatCompletion.model_validate(lines["object"]["response"]["body"]).choices[0]
    assert cut.finish_reason == "length"  # a JSON object cut short says so
    bad = lines["bad"]["response"]
    assert bad["status_code"] == 400 and "response_format.json_schema" in bad["body"]["error"]["message"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--json-schema", "missing.json"], "--json-schema missing.json: cannot read it"),
        (["--regex", "a", "--choice", "b"], "give one of --json-schema, --regex, --choice, --grammar"),
    ],
)
def test_bad_job_flags_are_one_line_errors(tiny_llama_dir, tmp_path, capsys, flags, message):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    assert main(["generate", str(inp), str(tmp_path / "o.jsonl"), *flags, *engine_args(tiny_llama_dir)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_row_fields_and_response_format_parse_to_specs():
    assert row_constraint({"prompt": "x"}) is None
    assert row_constraint({"json_object": True}).kind == "json_object"
    assert row_constraint({"json_object": False}) is None
    assert row_constraint({"json_object": "yes"}).startswith("json_object: must be true or false")
    assert row_constraint({"json_schema": "{bad"}).startswith("json_schema: not valid JSON")
    assert response_format_fields({"type": "json_schema", "json_schema": {"name": "a"}}) == {
        "json_schema": {"type": "object"}
    }
    assert response_format_fields({"type": "xml"}).startswith("response_format.type")


def test_parquet_output_has_the_structured_column_from_rows_own_constraints(tiny_llama_dir, tmp_path):
    """No job-wide flag: a row's own constraint still gives the Parquet file its structured column (the
    unconstrained rows null there), so an incomplete row says so in Parquet as in JSON Lines."""
    rows = [
        {"id": "free", "prompt": "anything"},
        {"id": "choice", "prompt": "yes or no?", "choice": ["yes", "no"]},
        {"id": "cut", "prompt": "classify", "json_schema": SCHEMA, "max_tokens": 3},
    ]
    out = tmp_path / "out.parquet"
    main(["generate", str(write_jsonl(tmp_path / "in.jsonl", rows)), str(out), *engine_args(tiny_llama_dir)])
    table = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert table["free"]["structured"] is None
    assert table["choice"]["structured"] == "complete" and table["choice"]["completion"] in ("yes", "no")
    assert table["cut"]["finish_reason"] == "length" and table["cut"]["structured"] == "incomplete"
