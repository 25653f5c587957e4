"""generate's own output format, cbrun rows: one per (prompt, sample), a contract other tools rely on.

Columns, in order:

    id                    string   the row's id (id, else custom_id, else row number)
    sample                int      0-based sample index (n > 1 gives several rows per id)
    completion            string   generated text
    completion_token_ids  [int]    generated token ids
    logprobs              [float]  one per generated token (with --logprobs)
    top_logprobs          [[{token_id, logprob}]]  K alternatives per token (with --top-logprobs K)
    finish_reason         string   stop | length | error | cancelled
    num_prompt_tokens     int
    num_completion_tokens int
    num_cached_tokens     int      prompt tokens served from the prefix cache
    error                 string?  null, or "row N: field: reason"
    structured            string?  complete | incomplete for a row with a structured-output
                                   constraint (incomplete: cut by max_tokens or a stop string
                                   before its grammar completed; never valid output), else null
                                   (with a job-wide constraint, or in JSONL for a row carrying one)
    prompt_token_ids      [int]    (with --prompt-token-ids)
    ...                            input columns named by --keep-columns

Error messages follow data/output_rows.py, which `--resume` reads. Beside
score's format (data/score/format.py); generate's other format answers OpenAI
Batch input (openai_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbrun.data.output_rows import RowKey, bad_row_number, engine_error, is_killed
from cbrun.data.rows import BadRow, ParsedRow
from cbrun.engine.request import GenerationOutput

GENERATE_COLUMNS = (
    "id",
    "sample",
    "completion",
    "completion_token_ids",
    "logprobs",
    "top_logprobs",
    "finish_reason",
    "num_prompt_tokens",
    "num_completion_tokens",
    "num_cached_tokens",
    "error",
    "structured",
    "prompt_token_ids",
)


def structured_status(out: GenerationOutput) -> str | None:
    """ "complete" / "incomplete" for a constrained output, None for a free or failed one."""
    if out.structured_complete is None or out.finish_reason == "error":
        return None
    return "complete" if out.structured_complete else "incomplete"


@dataclass(frozen=True)
class CbrunFormat:
    """Writes cbrun rows; the optional columns follow the command-line flags."""

    logprobs: bool = False
    top_logprobs: bool = False
    prompt_token_ids: bool = False
    keep_columns: tuple[str, ...] = ()
    structured: bool = False  # the job has a job-wide constraint: every row gets the structured column
    per_row = False  # one output row per sample, written as soon as it finishes

    def columns(self) -> list[str]:
        optional = {
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "prompt_token_ids": self.prompt_token_ids,
            "structured": self.structured,
        }
        return [c for c in GENERATE_COLUMNS if optional.get(c, True)] + list(self.keep_columns)

    def result_rows(self, parsed: ParsedRow, results: list[tuple[int, GenerationOutput]]) -> list[dict]:
        return [self._result_row(parsed, sample, out) for sample, out in results]

    def _result_row(self, parsed: ParsedRow, sample: int, out: GenerationOutput) -> dict:
        failed = out.finish_reason == "error"
        row = {"id": parsed.id, "sample": sample, "completion": out.text, "completion_token_ids": list(out.token_ids)}
        if self.logprobs:
            row["logprobs"] = list(out.logprobs)
        if self.top_logprobs:
            row["top_logprobs"] = [
                [{"token_id": t, "logprob": lp} for t, lp in position] for position in out.top_logprobs or []
            ]
        row.update(
            finish_reason=out.finish_reason,
            num_prompt_tokens=parsed.num_prompt_tokens,
            num_completion_tokens=len(out.token_ids),
            num_cached_tokens=out.num_cached_tokens,
            error=engine_error(parsed, out) if failed else None,
        )
        if self.structured or out.structured_complete is not None:
            row["structured"] = structured_status(out)
        if self.prompt_token_ids:
            row["prompt_token_ids"] = list(parsed.token_ids or ())
        row.update(parsed.keep)
        return row

    def bad_row(self, bad: BadRow) -> dict:
        row = {"id": bad.id, "sample": 0, "completion": "", "completion_token_ids": []}
        if self.logprobs:
            row["logprobs"] = []
        if self.top_logprobs:
            row["top_logprobs"] = []
        row.update(
            finish_reason="error", num_prompt_tokens=0, num_completion_tokens=0, num_cached_tokens=0, error=bad.message
        )
        if self.structured:
            row["structured"] = None
        if self.prompt_token_ids:
            row["prompt_token_ids"] = None
        row.update(bad.keep)
        return row

    @staticmethod
    def classify(row: dict) -> RowKey:
        """Resume key of one cbrun row; raises ValueError if it is not a cbrun row."""
        if not isinstance(row, dict) or "id" not in row or "sample" not in row or "finish_reason" not in row:
            raise ValueError("not a cbrun output row (needs id, sample, finish_reason)")
        reason, error = row["finish_reason"], row.get("error")
        if is_killed(reason, error):
            return RowKey(str(row["id"]), killed=True)
        bad = bad_row_number(error)
        if bad is not None:
            return RowKey(str(row["id"]), bad_row=bad, failed=True)
        return RowKey(str(row["id"]), samples=(int(row["sample"]),), failed=reason == "error")

    def arrow_schema(self, keep_types: dict | None = None) -> Any:  # a pyarrow.Schema (pyarrow is untyped)
        """The Parquet schema; keep columns take the types found in the data (string if unknown)."""
        import pyarrow as pa

        token_list = pa.list_(pa.int32())
        types = {
            "id": pa.string(),
            "sample": pa.int64(),
            "completion": pa.string(),
            "completion_token_ids": token_list,
            "logprobs": pa.list_(pa.float32()),
            "top_logprobs": pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())]))),
            "finish_reason": pa.string(),
            "num_prompt_tokens": pa.int64(),
            "num_completion_tokens": pa.int64(),
            "num_cached_tokens": pa.int64(),
            "error": pa.string(),
            "structured": pa.string(),
            "prompt_token_ids": token_list,
        }
        keep_types = keep_types or {}
        return pa.schema([(c, types[c] if c in types else keep_types.get(c, pa.string())) for c in self.columns()])
