"""score's preparer: a row's id, its prompt and the completions to score, one result per completion.

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

Beside generate's (data/generate/preparer.py); both build prompts as
`PromptPreparer` (data/prompts.py) does. The job is the same `Job` as
generate's, with `ScoreRows` (row_kind.py) as its row kind: scoring requests
in place of sampled ones, the same window, prefix-sorted submission, resume,
stop and error rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cbrun.data.prompts import PromptPreparer
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow, ParsedRow, RowT, record_id, row_lora
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer

COMPLETION_FIELDS = ("completions_token_ids", "completions", "completion_token_ids", "completion")
TEXT_FIELDS = ("completions", "completion")
SCORE_PROMPT_IDS = "prompt_token_ids"


@dataclass(kw_only=True)
class ParsedScoreRow(ParsedRow):
    """A parsed score row: the prompt as in `ParsedRow`, plus its completions.

    completions: texts or token-id lists as given (dropped after tokenization);
    completion_ids: their token ids, one list per entry of `samples`.
    """

    samples: list[int] = field(default_factory=list)
    completion_field: str = ""
    completions: list[Any] | None = None
    completion_ids: list[list[int]] | None = None


ScoreRowT = TypeVar("ScoreRowT", bound=ParsedScoreRow)


class ScorePreparer(PromptPreparer):
    """Validates score rows; prompts are built as `generate` builds them (see `PromptPreparer`).

    An (id, sample) pair is used by one row only; several rows may share an id."""

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

    def parse(self, raw: RawRow, record: dict | None = None, meta: dict | None = None) -> ParsedScoreRow | BadRow:
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
        lora, lora_error = row_lora(record)
        if lora_error:
            return bad(lora_error)
        source = self._score_prompt_source(record)
        if isinstance(source, str):
            return bad(source)
        kind, prompt_field, value = source
        return ParsedScoreRow(
            index=raw.index,
            id=row_id,
            where=where,
            kind=kind,
            field=prompt_field,
            value=value,
            sampling=self.base,
            keep=keep,
            meta=meta,
            samples=samples,
            completion_field=field_name,
            completions=completions,
            lora=lora,
        )

    def _score_prompt_source(self, record: dict) -> tuple[str, str, Any] | str:
        """`prompt_token_ids` (exactly what generate ran) first, then the usual prompt fields."""
        value = record.get(SCORE_PROMPT_IDS)
        if self.prompt_column is None and value is not None:
            if not isinstance(value, list) or not value or set(map(type, value)) != {int}:
                return f"{SCORE_PROMPT_IDS}: must be a non-empty list of integer token ids"
            return "ids", SCORE_PROMPT_IDS, value
        return self._prompt_source(record)

    def tokenize(self, rows: Sequence[RowT]) -> list[RowT | BadRow]:
        """Prompt token ids as `PromptPreparer.tokenize`; completion texts encoded alone, no special tokens.
        (Score rows are ScoreRowSpecs; any other row is tokenized as `PromptPreparer` does.)"""
        results = super().tokenize(rows)
        ready = [row for row in results if isinstance(row, ParsedScoreRow)]
        texts = [c for row in ready if row.completion_field in TEXT_FIELDS for c in _given(row)]
        encoded = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        for row in ready:
            if row.completion_field in TEXT_FIELDS:
                row.completion_ids = [list(next(encoded)) for _ in _given(row)]
            else:
                row.completion_ids = [list(c) for c in _given(row)]
            row.completions = None
        return [self._check_completions(r) if isinstance(r, ParsedScoreRow) else r for r in results]

    def _check_completions(self, row: ScoreRowT) -> ScoreRowT | BadRow:
        multi = row.completion_field.startswith("completions")
        assert row.completion_ids is not None  # set by tokenize just before
        for index, ids in enumerate(row.completion_ids):
            name = f"{row.completion_field}[{index}]" if multi else row.completion_field
            if not ids:
                return BadRow.from_row(row, f"{name}: empty completion (no tokens)")
            if not (min(ids) >= 0 and max(ids) < self.vocab_size):
                pos, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
                return BadRow.from_row(
                    row, f"{name}: token id {token} at position {pos} is outside the vocabulary [0, {self.vocab_size})"
                )
            total = row.num_prompt_tokens + len(ids)
            if total > self.max_context:
                return BadRow.from_row(
                    row,
                    f"{name}: prompt ({row.num_prompt_tokens} tokens) plus completion "
                    f"({len(ids)} tokens) exceed the model's context of {self.max_context} tokens",
                )
        return row


def _given(row: ParsedScoreRow) -> list[Any]:
    """The completions as given; present from `parse` until `tokenize` turns them into ids."""
    assert row.completions is not None
    return row.completions


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
