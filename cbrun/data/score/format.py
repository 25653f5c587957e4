"""score's output format: one row per (id, sample), the teacher-forced logprobs of the completion given.

Beside generate's format (data/generate/format.py). Columns, in order:

    id, sample            string, int
    completion_token_ids  [int]    the tokens scored
    logprobs              [float]  one per completion token (temperature 1)
    sum_logprob           float    their sum
    num_completion_tokens int
    is_greedy             bool     every token was the argmax
    top_logprobs          [[{token_id, logprob}]]  with --top-logprobs K
    prompt_logprobs       [float]  with --prompt-logprobs: one per prompt token, the first null
    num_cached_tokens     int      prompt tokens served by the prefix cache
    error                 string?  as in generate (data/output_rows.py)
    ...                            input columns named by --keep-columns
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cbrun.data.output_rows import STOPPED_MARKER, RowKey, bad_row_number, engine_error
from cbrun.data.rows import BadRow, ParsedRow
from cbrun.engine.request import GenerationOutput

SCORE_COLUMNS = (
    "id",
    "sample",
    "completion_token_ids",
    "logprobs",
    "sum_logprob",
    "num_completion_tokens",
    "is_greedy",
    "top_logprobs",
    "prompt_logprobs",
    "num_cached_tokens",
    "error",
)


@dataclass(frozen=True)
class ScoreFormat:
    """Writes score rows (columns in SCORE_COLUMNS order; top/prompt logprobs on request)."""

    top_logprobs: bool = False
    prompt_logprobs: bool = False
    keep_columns: tuple[str, ...] = ()
    per_row = False  # one output row per completion, written as soon as it is scored

    def columns(self) -> list[str]:
        optional = {"top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs}
        return [c for c in SCORE_COLUMNS if optional.get(c, True)] + list(self.keep_columns)

    def result_rows(self, parsed: ParsedRow, results: list[tuple[int, GenerationOutput]]) -> list[dict]:
        return [self._result_row(parsed, sample, out) for sample, out in results]

    def _result_row(self, parsed: ParsedRow, sample: int, out: GenerationOutput) -> dict:
        failed = not out.ok  # an error, or a cancel (resume redoes it)
        logprobs = [] if failed else list(out.logprobs)
        row = {
            "id": parsed.id,
            "sample": sample,
            "completion_token_ids": list(out.token_ids),
            "logprobs": logprobs,
            "sum_logprob": None if failed else math.fsum(logprobs),
            "num_completion_tokens": len(out.token_ids),
            "is_greedy": None if failed else out.is_greedy,
        }
        if self.top_logprobs:
            row["top_logprobs"] = (
                []
                if failed
                else [[{"token_id": t, "logprob": lp} for t, lp in position] for position in out.top_logprobs or []]
            )
        if self.prompt_logprobs:
            row["prompt_logprobs"] = None if failed else out.prompt_logprobs
        row.update(num_cached_tokens=out.num_cached_tokens, error=engine_error(parsed, out) if failed else None)
        row.update(parsed.keep)
        return row

    def bad_row(self, bad: BadRow) -> dict:
        row = {
            "id": bad.id,
            "sample": (bad.meta or {}).get("sample", 0),
            "completion_token_ids": [],
            "logprobs": [],
            "sum_logprob": None,
            "num_completion_tokens": 0,
            "is_greedy": None,
        }
        if self.top_logprobs:
            row["top_logprobs"] = []
        if self.prompt_logprobs:
            row["prompt_logprobs"] = None
        row.update(num_cached_tokens=0, error=bad.message)
        row.update(bad.keep)
        return row

    @staticmethod
    def classify(row: dict) -> RowKey:
        """Resume key of one score row; raises ValueError if it is not one."""
        if not isinstance(row, dict) or "id" not in row or "sample" not in row or "error" not in row:
            raise ValueError("not a cbrun score output row (needs id, sample, error)")
        error = row["error"]
        if error is not None and (STOPPED_MARKER in error or error.endswith("(engine): cancelled")):
            return RowKey(str(row["id"]), killed=True)
        bad = bad_row_number(error)
        if bad is not None:
            return RowKey(str(row["id"]), bad_row=bad, failed=True)
        return RowKey(str(row["id"]), samples=(int(row["sample"]),), failed=error is not None)

    def arrow_schema(self, keep_types: dict | None = None) -> Any:  # a pyarrow.Schema (pyarrow is untyped)
        """The Parquet schema; keep columns take the types found in the data (string if unknown)."""
        import pyarrow as pa

        floats = pa.list_(pa.float32())
        types = {
            "id": pa.string(),
            "sample": pa.int64(),
            "completion_token_ids": pa.list_(pa.int32()),
            "logprobs": floats,
            "sum_logprob": pa.float64(),
            "num_completion_tokens": pa.int64(),
            "is_greedy": pa.bool_(),
            "top_logprobs": pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())]))),
            "prompt_logprobs": floats,
            "num_cached_tokens": pa.int64(),
            "error": pa.string(),
        }
        keep_types = keep_types or {}
        return pa.schema([(c, types[c] if c in types else keep_types.get(c, pa.string())) for c in self.columns()])
