"""The score job: rows of (prompt, completions) -> teacher-forced logprobs, one output row per completion.

Input rows hold a prompt as `generate` reads it (`prompt`, `messages`,
`input_ids`, or `prompt_token_ids` as `generate --prompt-token-ids` writes
it) and the completions to score, in the first of these fields present:

    completions_token_ids  [[int]]  several completions: samples 0..n-1
    completions            [str]    several completions: samples 0..n-1
    completion_token_ids   [int]    one completion; sample = the row's `sample` (default 0)
    completion             str      one completion; sample = the row's `sample` (default 0)

so the output of `cbrun generate --prompt-token-ids` is valid input as it is
(token ids win over the `completion` text it also holds). Rows are keyed by
(id, sample): several input rows may share an id, never an (id, sample).

Completion text is tokenized on its own, without special tokens, and appended
to the prompt's tokens: no token spans the boundary and no BOS is added, as in
`generate`, whose completions start right after the prompt's last token. A
space between prompt and completion belongs in the completion text (" Paris"),
where the model's own tokenization puts it.

The job itself is `GenerateJob` with `ScoreRows` as its row kind (scoring
requests in place of sampled ones): same window, prefix-sorted submission,
resume, stop and error rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cbrun.data.prompts import BadRow, RowPreparer, RowSpec, SpecT, record_id
from cbrun.data.reader import RawRow
from cbrun.data.resume import ResumeState
from cbrun.data.schema import STOPPED_MARKER, RowKey, bad_row_number, engine_error
from cbrun.engine.request import GenerationOutput
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.engine import Engine
    from cbrun.engine.model_spec import Tokenizer

COMPLETION_FIELDS = ("completions_token_ids", "completions", "completion_token_ids", "completion")
TEXT_FIELDS = ("completions", "completion")
SCORE_PROMPT_IDS = "prompt_token_ids"
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


@dataclass
class ScoreRowSpec(RowSpec):
    """A parsed score row: the prompt as in `RowSpec`, plus its completions.

    completions: texts or token-id lists as given (dropped after tokenization);
    completion_ids: their token ids, one list per entry of `samples`.
    """

    samples: list[int] = field(default_factory=list)
    completion_field: str = ""
    completions: list[Any] | None = None
    completion_ids: list[list[int]] | None = None


ScoreSpecT = TypeVar("ScoreSpecT", bound=ScoreRowSpec)


class ScorePreparer(RowPreparer):
    """Validates score rows; prompts are built as `generate` builds them (see `RowPreparer`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_context: int,
        vocab_size: int,
        prompt_column: str | None = None,
        chat: bool = False,
        keep_columns: tuple[str, ...] = (),
    ):
        super().__init__(
            tokenizer,
            SamplingParams(max_tokens=1),
            max_context=max_context,
            vocab_size=vocab_size,
            prompt_column=prompt_column,
            chat=chat,
            keep_columns=keep_columns,
        )
        self._seen_pairs: dict[tuple[str, int], int] = {}  # (id, sample) -> first row using it

    def parse(self, raw: RawRow, record: dict | None = None, meta: dict | None = None) -> ScoreRowSpec | BadRow:
        record = raw.record if record is None else record
        where = raw.where
        if record is None:
            return BadRow(raw.index, str(raw.index), f"{where}: {raw.error}")
        keep = {name: record.get(name) for name in self.keep_columns}
        row_id, id_error = record_id(record, raw.index)
        sample = _sample_of(record)
        meta = {"sample": sample if isinstance(sample, int) else 0}  # the error row's sample

        def bad(reason: str) -> BadRow:
            return BadRow(raw.index, row_id, f"{where}: {reason}", keep, meta)

        if id_error:
            return bad(id_error)
        found = _completions(record)
        if isinstance(found, str):
            return bad(found)
        field_name, completions = found
        samples = list(range(len(completions)))
        if field_name.startswith("completions"):
            meta["sample"] = 0
        else:
            if isinstance(sample, str):
                return bad(sample)
            samples = [sample]
        for sample in samples:
            first = self._seen_pairs.setdefault((row_id, sample), raw.index)
            if first != raw.index:
                return bad(f"id: duplicate (id, sample) ({row_id!r}, {sample}) (first used by row {first})")
        source = self._score_prompt_source(record)
        if isinstance(source, str):
            return bad(source)
        kind, prompt_field, value = source
        return ScoreRowSpec(
            raw.index,
            row_id,
            where,
            kind,
            prompt_field,
            value,
            self.base,
            keep,
            meta,
            samples=samples,
            completion_field=field_name,
            completions=completions,
        )

    def _score_prompt_source(self, record: dict) -> tuple[str, str, Any] | str:
        """`prompt_token_ids` (exactly what generate ran) first, then the usual prompt fields."""
        value = record.get(SCORE_PROMPT_IDS)
        if self.prompt_column is None and value is not None:
            if not isinstance(value, list) or not value or set(map(type, value)) != {int}:
                return f"{SCORE_PROMPT_IDS}: must be a non-empty list of integer token ids"
            return "ids", SCORE_PROMPT_IDS, value
        return self._prompt_source(record)

    def tokenize(self, specs: Sequence[SpecT]) -> list[SpecT | BadRow]:
        """Prompt token ids as `RowPreparer.tokenize`; completion texts encoded alone, no special tokens.
        (Score rows are ScoreRowSpecs; any other spec is tokenized as `RowPreparer` does.)"""
        results = super().tokenize(specs)
        ready = [spec for spec in results if isinstance(spec, ScoreRowSpec)]
        texts = [c for spec in ready if spec.completion_field in TEXT_FIELDS for c in _given(spec)]
        encoded = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        for spec in ready:
            if spec.completion_field in TEXT_FIELDS:
                spec.completion_ids = [list(next(encoded)) for _ in _given(spec)]
            else:
                spec.completion_ids = [list(c) for c in _given(spec)]
            spec.completions = None
        return [self._check_completions(r) if isinstance(r, ScoreRowSpec) else r for r in results]

    def _check_completions(self, spec: ScoreSpecT) -> ScoreSpecT | BadRow:
        multi = spec.completion_field.startswith("completions")
        assert spec.completion_ids is not None  # set by tokenize just before
        for index, ids in enumerate(spec.completion_ids):
            name = f"{spec.completion_field}[{index}]" if multi else spec.completion_field
            if not ids:
                return BadRow.from_spec(spec, f"{name}: empty completion (no tokens)")
            if not (min(ids) >= 0 and max(ids) < self.vocab_size):
                pos, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
                return BadRow.from_spec(
                    spec, f"{name}: token id {token} at position {pos} is outside the vocabulary [0, {self.vocab_size})"
                )
            total = spec.num_prompt_tokens + len(ids)
            if total > self.max_context:
                return BadRow.from_spec(
                    spec,
                    f"{name}: prompt ({spec.num_prompt_tokens} tokens) plus completion "
                    f"({len(ids)} tokens) exceed the model's context of {self.max_context} tokens",
                )
        return spec


def _given(spec: ScoreRowSpec) -> list[Any]:
    """The completions as given; present from `parse` until `tokenize` turns them into ids."""
    assert spec.completions is not None
    return spec.completions


def _completions(record: dict) -> tuple[str, list[Any]] | str:
    """(field, completions) of a row, or why there is none usable."""
    for name in COMPLETION_FIELDS:
        value = record.get(name)
        if value is None:
            continue
        items = value if name.startswith("completions") else [value]
        if name.startswith("completions") and (not isinstance(value, list) or not value):
            return f"{name}: must be a non-empty list"
        text = name in TEXT_FIELDS
        for index, item in enumerate(items):
            label = f"{name}[{index}]" if name.startswith("completions") else name
            if text and (not isinstance(item, str) or not item):
                return f"{label}: must be non-empty text"
            if not text and (not isinstance(item, list) or not item):
                return f"{label}: must be a non-empty list of integer token ids" + _error_hint(record)
            if not text and set(map(type, item)) != {int}:
                return f"{label}: must be a list of integer token ids"
        return name, items
    return (
        "no completion: expected 'completion', 'completion_token_ids', 'completions' or "
        "'completions_token_ids'" + _error_hint(record)
    )


def _error_hint(record: dict) -> str:
    error = record.get("error")
    return f" (the input row is an error row: {error})" if isinstance(error, str) and error else ""


def _sample_of(record: dict) -> int | str:
    value = record.get("sample", 0)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"sample: must be an integer >= 0, got {value!r}"
    return value


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

    def result_rows(self, spec: RowSpec, results: list[tuple[int, GenerationOutput]]) -> list[dict]:
        return [self._result_row(spec, sample, out) for sample, out in results]

    def _result_row(self, spec: RowSpec, sample: int, out: GenerationOutput) -> dict:
        failed = not out.ok  # an error, or a cancel (resume redoes it)
        logprobs = [] if failed else list(out.logprobs)
        row = {
            "id": spec.id,
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
        row.update(num_cached_tokens=out.num_cached_tokens, error=engine_error(spec, out) if failed else None)
        row.update(spec.keep)
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


@dataclass(frozen=True)
class ScoreRows:
    """Scored rows, the `RowKind` of a score job: one scoring request per input row, one result
    (sample) per completion still to write; resume skips every (id, sample) already written."""

    prompt_logprobs: bool = False
    top_logprobs: int = 0

    def pending_samples(self, spec: ScoreRowSpec, resume: ResumeState | None) -> list[int]:
        return resume.missing_samples(spec.id, spec.samples) if resume is not None else list(spec.samples)

    def sort_key(self, spec: ScoreRowSpec) -> tuple[list[int], list[list[int]]]:
        return spec.token_ids or [], spec.completion_ids or []  # shared prompts adjacent (tokenized: both set)

    def submit(self, engine: Engine, spec: ScoreRowSpec, samples: list[int], request_id: str) -> list[int]:
        assert spec.token_ids is not None and spec.completion_ids is not None  # tokenized, not yet submitted
        by_sample = dict(zip(spec.samples, spec.completion_ids))
        engine.add_score_request(
            spec.token_ids,
            [by_sample[s] for s in samples],
            request_id,
            samples=samples,
            prompt_logprobs=self.prompt_logprobs,
            top_logprobs=self.top_logprobs,
        )
        spec.token_ids, spec.completion_ids = None, None  # the engine holds its own copies
        return samples
