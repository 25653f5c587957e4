"""A conversation's next turn as text to append to the token ids it already has: nothing re-tokenized.

In a multi-turn rollout the earlier turns exist as token ids: the prompt the
template rendered and the completion the model sampled. Rendering the whole
conversation again and tokenizing it can give other ids (the completion's
tokens merged or split another way, a separator the model never produced
dropped), and the trainer would then score tokens that were never sampled.
Here only what follows the previous assistant turn is rendered, in the
template's own context, and tokenized alone, to be appended to the ids:

    previous ids   <|user|>\\nQ1</s>\\n<|assistant|>\\n  A1 </s>          (prompt, sampled completion)
    rendered       ... <|assistant|>\\n MARK </s>\\n<|user|>\\nQ2</s>\\n<|assistant|>\\n
    after MARK                           </s>\\n<|user|>\\nQ2</s>\\n<|assistant|>\\n
    appended                                  \\n<|user|>\\nQ2</s>\\n<|assistant|>\\n   (</s> was sampled)

The previous assistant message is rendered with a marker as its content; what
the template puts after it (that turn's closing, the new messages, the
generation prompt) is the new text. When the ids already end with the
closing's first tokens (the end-of-turn token the model sampled) they are not
added twice; when the completion was cut short (max_tokens), the closing is
added whole. The CLI (data/prompts.py: rows with `prompt_token_ids` and
`messages`) and the Python API (`LLM.chat(..., history_token_ids=...)`) both
call `follow_up_text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MARKER = "\u2063cbrun previous turn\u2063"  # text no template changes: it finds where the previous turn ended
_CONTEXT = ({"role": "user", "content": "\u2063"}, {"role": "assistant", "content": MARKER})


class FollowUpError(ValueError):
    """The new turn cannot be rendered after these ids (the template hides or rewrites the marker)."""


def follow_up_text(
    tokenizer: Any,
    history_ids: Sequence[int],
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The text that follows `history_ids` (ending with an assistant turn) when `messages` come next.

    Tokenize it without special tokens (the template wrote them) and append its ids to `history_ids`.
    """
    if not history_ids:
        raise FollowUpError("the previous turns' token ids are empty")
    text = tokenizer.apply_chat_template(
        [*_CONTEXT, *messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        chat_template=chat_template,
        **(template_kwargs or {}),
    )
    if text.count(MARKER) != 1:
        raise FollowUpError(
            "the chat template does not render an assistant message's content as given, "
            "so where the previous turn ends cannot be found"
        )
    tail = text[text.index(MARKER) + len(MARKER) :]
    return tail[len(_sampled_closing(tokenizer, history_ids, tail)) :]


def _sampled_closing(tokenizer: Any, history_ids: Sequence[int], tail: str) -> str:
    """The text of the special tokens the ids end with (an end-of-turn token the model sampled), when the
    template's closing starts with it; else "" (a completion cut short gets the closing whole)."""
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    count = 0
    while count < len(history_ids) and history_ids[-1 - count] in special:
        count += 1
    for n in range(count, 0, -1):
        text = tokenizer.decode(list(history_ids[-n:]), skip_special_tokens=False)
        if tail.startswith(text):
            return text
    return ""
