"""From an input row to what the engine needs: an id, prompt token ids, sampling.

Validation happens here so that every bad row becomes an error row whose message
names the row, the field and the reason (`row 3: top_p: must be in (0, 1], got 2`).
The engine checks again (it fails a bad request alone), but its messages cannot
name input rows.

Preparation is split in two steps so that `--resume` can skip finished rows
before paying for tokenization: `parse()` (id, sampling, which prompt) and
`tokenize()` (token ids, context and vocabulary checks), done per window so the
tokenizer encodes many texts in one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cbrun.data.chat import ChatContentError, flatten_messages
from cbrun.data.constraints import row_constraint
from cbrun.data.reader import RawRow
from cbrun.engine.config import ConfigError
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer

PROMPT_FIELDS = ("prompt", "messages", "input_ids")
SAMPLING_OVERRIDES = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop")
INT_FIELDS = {"max_tokens", "min_tokens", "top_k", "seed", "n", "top_logprobs"}
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
    def from_spec(cls, spec: RowSpec, reason: str) -> BadRow:
        """A parsed row found bad later (at tokenization or a length check): the message names its place
        as parsing would, and the row keeps its kept columns and format extras for its error row."""
        return cls(spec.index, spec.id, f"{spec.where}: {reason}", spec.keep, spec.meta)


@dataclass
class RowSpec:
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


SpecT = TypeVar("SpecT", bound=RowSpec)  # a RowSpec or a subclass (score rows): tokenize hands back the same kind


class RowPreparer:
    """Validates rows and builds prompt token ids.

    tokenizer: a transformers tokenizer (chat template for `messages` rows).
    base: the command line's sampling values; rows may override some fields.
    max_context: the model's context length; prompt plus max_tokens must fit in it.
    vocab_size: token ids must be in [0, vocab_size).
    prompt_column: read the prompt from this column instead of prompt/messages/input_ids.
    chat: render text prompts with the chat template as one user message.
    keep_columns: input columns copied to the output row.
    """

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
        self.tokenizer = tokenizer
        self.base = base
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.prompt_column = prompt_column
        self.chat = chat
        self.keep_columns = keep_columns
        self._seen: dict[str, int] = {}  # id -> first row using it

    # --- step 1: everything but tokenization --------------------------------

    def parse(self, raw: RawRow, record: dict | None = None, meta: dict | None = None) -> RowSpec | BadRow:
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

        source = self._prompt_source(record)
        if isinstance(source, str):
            return bad(source)
        kind, field_name, value = source
        return RowSpec(raw.index, row_id, where, kind, field_name, value, sampling, keep, meta)

    def _prompt_source(self, record: dict) -> tuple[str, str, Any] | str:
        """(kind, field, value) of the row's prompt, or an error message."""
        if self.prompt_column is not None:
            names: tuple[str, ...] = (self.prompt_column,)
            if self.prompt_column not in record:
                return f"{self.prompt_column}: no such column in this row"
        else:
            names = PROMPT_FIELDS
        for name in names:
            value = record.get(name)
            if value is None:
                continue
            kind = _prompt_kind(value)
            if kind is None or (name == "input_ids" and kind != "ids") or (name == "messages" and kind != "chat"):
                return f"{name}: {_describe_bad_prompt(name, value)}"
            if kind == "text" and self.chat:
                return "chat", name, [{"role": "user", "content": value}]
            if kind == "chat":
                try:
                    value = flatten_messages(value)
                except ChatContentError as exc:
                    return f"{name}{exc}"
            return kind, name, value
        if self.prompt_column is not None:
            return f"{self.prompt_column}: is null"
        return "no prompt: expected a 'prompt', 'messages' or 'input_ids' field"

    # --- step 2: token ids ----------------------------------------------------

    def tokenize(self, specs: Sequence[SpecT]) -> list[SpecT | BadRow]:
        """Fill in `token_ids` for each spec (texts encoded in few tokenizer calls).

        Text prompts are encoded as the tokenizer does by default (special tokens
        added); rendered chats already hold their special tokens.
        """
        results: list[SpecT | BadRow] = []
        to_encode: list[tuple[SpecT, str, bool]] = []  # (spec, text, add_special_tokens)
        for spec in specs:
            if spec.kind == "ids":
                spec.token_ids = spec.value if isinstance(spec.value, list) else list(spec.value)
                spec.value = None
                results.append(spec)
                continue
            text = spec.value if spec.kind == "text" else self._render_chat(spec)
            if isinstance(text, BadRow):
                results.append(text)
                continue
            results.append(spec)
            to_encode.append((spec, text, spec.kind == "text"))
        for add_special in (True, False):
            group = [(spec, text) for spec, text, flag in to_encode if flag == add_special]
            if group:
                encoded = self.tokenizer([text for _, text in group], add_special_tokens=add_special)["input_ids"]
                for (spec, _), ids in zip(group, encoded):
                    spec.token_ids, spec.value = list(ids), None  # the text is not needed any more
        return [self._check(r) if isinstance(r, RowSpec) else r for r in results]

    def _render_chat(self, spec: RowSpec) -> str | BadRow:
        if not getattr(self.tokenizer, "chat_template", None):
            return BadRow.from_spec(spec, f"{spec.field}: the model's tokenizer has no chat template")
        try:
            return self.tokenizer.apply_chat_template(spec.value, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors, missing keys: the row is bad, the job goes on
            return BadRow.from_spec(spec, f"{spec.field}: chat template failed: {exc}")

    def _check(self, spec: SpecT) -> SpecT | BadRow:
        ids = spec.token_ids or []
        spec.num_prompt_tokens = len(ids)
        if not ids:
            return BadRow.from_spec(spec, f"{spec.field}: empty prompt (no tokens)")
        max_tokens = spec.sampling.max_tokens
        if len(ids) + max_tokens > self.max_context:
            return BadRow.from_spec(
                spec,
                f"{spec.field}: prompt of {len(ids)} tokens plus max_tokens {max_tokens} "
                f"exceeds the model's context of {self.max_context} tokens",
            )
        if spec.kind == "ids" and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            pos, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            return BadRow.from_spec(
                spec,
                f"{spec.field}: token id {token} at position {pos} is outside the vocabulary [0, {self.vocab_size})",
            )
        return spec


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


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text" if value else None
    if not isinstance(value, (list, tuple)) or not value:
        return None
    types = set(map(type, value))  # C speed: prompts can hold thousands of ids
    if types == {int}:
        return "ids"
    if types == {dict}:
        return "chat" if all(isinstance(m.get("role"), str) and "content" in m for m in value) else None
    return None


def _describe_bad_prompt(name: str, value: Any) -> str:
    if isinstance(value, str) and not value:
        return "empty prompt"
    if isinstance(value, (list, tuple)) and not value:
        return "empty list"
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
        return "each chat message needs a string 'role' and a 'content'"
    if name == "input_ids":
        return "must be a non-empty list of integer token ids"
    if name == "messages":
        return "must be a non-empty list of chat messages ({'role': ..., 'content': ...})"
    return "must be text, a list of chat messages or a list of token ids"
