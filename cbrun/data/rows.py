"""A dataset row once read: parsed for what it asks (`ParsedRow`), or refused with its reason (`BadRow`).

What every command's preparer makes of an input row, whatever it asks the
engine for: generate's rows (data/generate/) and score's (data/score/)
extend `ParsedRow`; a `BadRow` becomes an error row in any output format.
"row" in data/ is always a dataset row: one input record and what it becomes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cbrun.engine.sampling_params import SamplingParams

ID_FIELDS = ("id", "custom_id")


@dataclass
class BadRow:
    """A row that cannot be run; `message` names the row, the field and the reason."""

    index: int
    id: str
    message: str
    keep: dict = field(default_factory=dict)
    meta: dict | None = None

    @classmethod
    def from_row(cls, row: ParsedRow, reason: str) -> BadRow:
        """A parsed row found bad later (at tokenization or a length check): the message names its place
        as parsing would, and the row keeps its kept columns and format extras for its error row."""
        return cls(row.index, row.id, f"{row.where}: {reason}", row.keep, row.meta)


@dataclass(kw_only=True)
class ParsedRow:
    """A parsed row whose prompt is not tokenized yet.

    kind: "text", "chat" or "ids"; value: the string, the messages or the ids
    (dropped once `token_ids` is set, to keep in-flight rows small; the job
    drops `token_ids` too once submitted, keeping `num_prompt_tokens`).
    meta: format-specific extras (the OpenAI endpoint and logprob options).
    """

    index: int
    id: str
    where: str
    kind: str
    field: str
    value: Any
    sampling: SamplingParams
    keep: dict = dataclasses.field(default_factory=dict)  # (`field` is a str attribute in this class's scope)
    meta: dict | None = None
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    lora: str | None = None  # the LoRA adapter it runs (a name given with --lora), None: the base model


RowT = TypeVar("RowT", bound=ParsedRow)  # a ParsedRow or a subclass (score rows): tokenize hands back the same kind


def record_id(record: dict, index: int) -> tuple[str, str | None]:
    """The row's id as a string (id, else custom_id, else the row number) and an error, if any.

    The one rule for the output's id column: the generate and score preparers and the shard split (which
    must send all rows of an id to one shard) read ids through it.
    """
    for name in ID_FIELDS:
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return str(index), f"{name}: must be a string or an integer, got {type(value).__name__}"
        return str(value), None
    return str(index), None


LORA_FIELD = "lora"  # a row's LoRA adapter, by the name `--lora NAME=PATH` gave it


def row_lora(record: dict) -> tuple[str | None, str | None]:
    """(the row's adapter name or None, why the field is wrong or None)."""
    value = record.get(LORA_FIELD)
    if value is None or value == "":
        return None, None
    if not isinstance(value, str):
        return None, f"{LORA_FIELD}: must be the name of an adapter given with --lora NAME=PATH, got {value!r}"
    return value, None
