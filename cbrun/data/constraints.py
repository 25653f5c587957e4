"""Structured-output constraints from input rows, OpenAI `response_format` and job-wide flags.

A cbrun row may carry one of `json_schema` (an object, or a string holding
one), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF text) or
`json_object` (true: any JSON object). A row's own constraint overrides the
job's (`--json-schema FILE`, `--regex`, `--choice`, `--grammar FILE`).
Here only the shape is checked; whether a schema or pattern compiles is the
engine's check (it needs the tokenizer), reported as that row's error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbrun.engine.config import ConfigError
from cbrun.engine.sampling_params import STRUCTURED_KINDS, StructuredSpec

ROW_FIELDS = STRUCTURED_KINDS


def row_constraint(record: dict) -> StructuredSpec | str | None:
    """The row's own constraint, None when it has none, or an error message naming the field."""
    given = {name: record[name] for name in ROW_FIELDS if record.get(name) is not None}
    if given.get("json_object") is False:
        del given["json_object"]
    if "json_object" in given and given["json_object"] is not True:
        return f"json_object: must be true or false, got {given['json_object']!r}"
    if len(given) > 1:
        return f"{', '.join(sorted(given))}: give one structured output constraint per row"
    if not given:
        return None
    try:
        return StructuredSpec.from_fields(**given)
    except ConfigError as exc:
        return str(exc)


def response_format_fields(response_format: Any) -> dict | str:
    """An OpenAI `response_format` as cbrun row fields ({} for text), or the reason it is unusable."""
    if not isinstance(response_format, dict):
        return f"response_format: must be an object, got {type(response_format).__name__}"
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        return f"response_format.type: expected text, json_object or json_schema, got {kind!r}"
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        return "response_format.json_schema: must be an object with a name and a schema"
    schema = spec.get("schema", {})  # OpenAI: an absent schema allows any JSON object
    if not isinstance(schema, dict):
        return f"response_format.json_schema.schema: must be an object, got {type(schema).__name__}"
    return {"json_schema": schema or {"type": "object"}}


def job_constraint(
    *,
    json_schema_file: str | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar_file: str | None = None,
) -> StructuredSpec | None:
    """The job-wide constraint from the command line (raises ValueError with a one-line message)."""
    fields: dict[str, Any] = {}
    if json_schema_file is not None:
        text = _read(json_schema_file, "--json-schema")
        try:
            fields["json_schema"] = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--json-schema {json_schema_file}: not valid JSON: {exc}") from None
    if regex is not None:
        fields["regex"] = regex
    if choice:
        fields["choice"] = list(choice)
    elif choice is not None:
        raise ValueError("--choice: give at least one choice")
    if grammar_file is not None:
        fields["grammar"] = _read(grammar_file, "--grammar")
    if len(fields) > 1:
        raise ValueError("give one of --json-schema, --regex, --choice, --grammar")
    try:
        return StructuredSpec.from_fields(**fields)
    except ConfigError as exc:
        raise ValueError(f"--{next(iter(fields)).replace('_', '-')}: {exc}") from None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
