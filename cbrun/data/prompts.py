"""What every command does with a row's prompt: find it, render a chat, tokenize, check its length.

`PromptPreparer` is the base of the commands' preparers (generate's in
data/generate/preparer.py, score's in data/score/preparer.py); each adds
`parse`, which reads the rest of its rows. Validation happens here so that
every bad row becomes an error row whose message names the row, the field
and the reason (`row 3: top_p: must be in (0, 1], got 2`). The engine checks
again (it fails a bad request alone), but its messages cannot name input rows.

Preparation is split in two steps so that `--resume` can skip finished rows
before paying for tokenization: `parse()` (id, sampling, which prompt) and
`tokenize()` (token ids, context and vocabulary checks), done per window so
the tokenizer encodes many texts in one call.

A row's prompt is its `prompt_token_ids` (vLLM's name) when it has them; with
`messages` beside them, the ids are the conversation so far (a previous
output's prompt and completion ids) and the messages the next turn, rendered
after them and appended without re-tokenizing the ids (data/follow_up.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cbrun.data.chat import ChatContentError, flatten_messages
from cbrun.data.follow_up import follow_up_text
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow, ParsedRow, RowT
from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer

PROMPT_FIELDS = ("prompt", "messages", "input_ids", "prompt_token_ids")
TOKEN_IDS_FIELD = "prompt_token_ids"  # the prompt as ids (read first); with `messages`, the turns before them


class PromptPreparer:
    """Validates rows and builds prompt token ids; a command's preparer adds `parse`.

    tokenizer: a transformers tokenizer (chat template for `messages` rows).
    base: the job's sampling values; rows may override some fields (generate).
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

    def parse(self, raw: RawRow, record: dict | None = None, meta: dict | None = None) -> ParsedRow | BadRow:
        """Step 1: validate what the row asks, everything but tokenization (each command's own rows).

        record/meta: a converted record (OpenAI batch input) to use instead of raw.record.
        """
        raise NotImplementedError

    def _prompt_source(self, record: dict) -> tuple[str, str, Any] | str:
        """(kind, field, value) of the row's prompt, or an error message."""
        if self.prompt_column is not None:
            names: tuple[str, ...] = (self.prompt_column,)
            if self.prompt_column not in record:
                return f"{self.prompt_column}: no such column in this row"
        else:
            names = PROMPT_FIELDS
            if record.get(TOKEN_IDS_FIELD) is not None:
                return self._token_ids_source(record)
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
        return "no prompt: expected a 'prompt', 'messages', 'input_ids' or 'prompt_token_ids' field"

    def _token_ids_source(self, record: dict) -> tuple[str, str, Any] | str:
        """`prompt_token_ids` alone ("ids"), or with `messages`: a next turn after those ids ("turn")."""
        ids = record[TOKEN_IDS_FIELD]
        if _prompt_kind(ids) != "ids":
            return f"{TOKEN_IDS_FIELD}: must be a non-empty list of integer token ids"
        messages = record.get("messages")
        if messages is None:
            return "ids", TOKEN_IDS_FIELD, ids
        if _prompt_kind(messages) != "chat":
            return f"messages: {_describe_bad_prompt('messages', messages)}"
        try:
            return "turn", "messages", (list(ids), flatten_messages(messages))
        except ChatContentError as exc:
            return f"messages{exc}"

    # --- step 2: token ids ----------------------------------------------------

    def tokenize(self, rows: Sequence[RowT]) -> list[RowT | BadRow]:
        """Fill in `token_ids` for each row (texts encoded in few tokenizer calls).

        Text prompts are encoded as the tokenizer does by default (special tokens
        added); rendered chats already hold their special tokens.
        """
        results: list[RowT | BadRow] = []
        to_encode: list[tuple[RowT, str, bool, list[int]]] = []  # (row, text, add_special_tokens, ids before it)
        for row in rows:
            if row.kind == "ids":
                row.token_ids = row.value if isinstance(row.value, list) else list(row.value)
                row.value = None
                results.append(row)
                continue
            before: list[int] = row.value[0] if row.kind == "turn" else []
            text = row.value if row.kind == "text" else self._render_chat(row)
            if isinstance(text, BadRow):
                results.append(text)
                continue
            results.append(row)
            to_encode.append((row, text, row.kind == "text", before))
        for add_special in (True, False):
            group = [(row, text, before) for row, text, flag, before in to_encode if flag == add_special]
            if group:
                encoded = self.tokenizer([text for _, text, _ in group], add_special_tokens=add_special)["input_ids"]
                for (row, _, before), ids in zip(group, encoded):
                    row.token_ids, row.value = before + list(ids), None  # the text is not needed any more
        return [self._check(r) if isinstance(r, ParsedRow) else r for r in results]

    def _render_chat(self, row: ParsedRow) -> str | BadRow:
        """A chat row's prompt text; a "turn" row's text after its ids (its messages only)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return BadRow.from_row(row, f"{row.field}: the model's tokenizer has no chat template")
        try:
            if row.kind == "turn":
                return follow_up_text(self.tokenizer, row.value[0], row.value[1])
            return self.tokenizer.apply_chat_template(row.value, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors, missing keys: the row is bad, the job goes on
            return BadRow.from_row(row, f"{row.field}: chat template failed: {exc}")

    def _check(self, row: RowT) -> RowT | BadRow:
        ids = row.token_ids or []
        row.num_prompt_tokens = len(ids)
        if not ids:
            return BadRow.from_row(row, f"{row.field}: empty prompt (no tokens)")
        max_tokens = row.sampling.max_tokens
        if len(ids) + max_tokens > self.max_context:
            return BadRow.from_row(
                row,
                f"{row.field}: prompt of {len(ids)} tokens plus max_tokens {max_tokens} "
                f"exceeds the model's context of {self.max_context} tokens",
            )
        if row.kind in ("ids", "turn") and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            pos, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            return BadRow.from_row(
                row,
                f"{row.field}: token id {token} at position {pos} is outside the vocabulary [0, {self.vocab_size})",
            )
        return row


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
