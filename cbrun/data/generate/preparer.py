"""generate's preparer: a row's id, its sampling overrides, its structured-output constraint and its prompt.

Beside score's (data/score/preparer.py); both build prompts as `PromptPreparer`
(data/prompts.py) does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cbrun.data.constraints import row_constraint
from cbrun.data.prompts import PromptPreparer
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow, ParsedRow, record_id, row_lora
from cbrun.engine.config import ConfigError
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer

SAMPLING_OVERRIDES = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop")
INT_FIELDS = {"max_tokens", "min_tokens", "top_k", "seed", "n", "top_logprobs"}


class GeneratePreparer(PromptPreparer):
    """Validates generate's rows; an id is used by one row only."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        base: SamplingParams,
        *,
        max_context: int,
        vocab_size: int,
        prompt_column: str | None = None,
        chat: bool = False,
        keep_columns: tuple[str, ...] = (),
    ):
        super().__init__(
            tokenizer,
            base,
            max_context=max_context,
            vocab_size=vocab_size,
            prompt_column=prompt_column,
            chat=chat,
            keep_columns=keep_columns,
        )
        self._seen: dict[str, int] = {}  # id -> first row using it

    def parse(self, raw: RawRow, record: dict | None = None, meta: dict | None = None) -> ParsedRow | BadRow:
        """Validate a row's id, sampling overrides and prompt source.

        record/meta: a converted record (OpenAI batch input) to use instead of raw.record.
        """
        record = raw.record if record is None else record
        where = raw.where
        if record is None:
            return BadRow(raw.index, str(raw.index), f"{where}: {raw.error}", meta=meta)
        keep = {name: record.get(name) for name in self.keep_columns}

        row_id, id_error = record_id(record, raw.index)

        def bad(reason: str) -> BadRow:
            return BadRow(raw.index, row_id, f"{where}: {reason}", keep, meta)

        if id_error:
            return bad(id_error)
        first = self._seen.setdefault(row_id, raw.index)
        if first != raw.index:
            return bad(f"id: duplicate id {row_id!r} (first used by row {first})")

        overrides = SAMPLING_OVERRIDES + (("top_logprobs",) if meta else ())
        changes: dict[str, Any] = {}
        for name in overrides:
            value = record.get(name)
            if value is None:
                continue
            try:
                changes[name] = _coerce(name, value)
            except ConfigError as exc:
                return bad(f"{name}: {exc}")
        try:  # all at once: a row may lower max_tokens and min_tokens together
            sampling = self.base.with_(**changes) if changes else self.base
        except (ConfigError, TypeError, ValueError) as exc:
            name = next((n for n in changes if str(exc).startswith(n + " ")), next(iter(changes)))
            return bad(f"{name}: {_strip_field(name, str(exc))}")

        constraint = row_constraint(record)  # the row's own structured-output constraint overrides the job's
        if isinstance(constraint, str):
            return bad(constraint)
        if constraint is not None:
            sampling = sampling.with_(structured=constraint)

        lora, lora_error = row_lora(record)
        if lora_error:
            return bad(lora_error)
        source = self._prompt_source(record)
        if isinstance(source, str):
            return bad(source)
        kind, field_name, value = source
        return ParsedRow(
            index=raw.index,
            id=row_id,
            where=where,
            kind=kind,
            field=field_name,
            value=value,
            sampling=sampling,
            keep=keep,
            meta=meta,
            lora=lora,
        )


def _coerce(name: str, value: Any) -> Any:
    """JSON and Parquet give 10.0 for 10 sometimes; accept integral floats for integer fields."""
    if name in INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    if name == "stop" and isinstance(value, list):
        return tuple(value)
    if name == "stop" and not isinstance(value, str):
        raise ConfigError(f"must be a string or a list of strings, got {value!r}")
    return value


def _strip_field(name: str, message: str) -> str:
    return message[len(name) + 1 :] if message.startswith(name + " ") else message
