"""vLLM's prompt forms and chats -> (prompt text or None, token ids), and per-prompt sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbrun.data.chat import flatten_messages
from cbrun.data.follow_up import follow_up_text
from cbrun.engine.model_spec import Tokenizer
from cbrun.llm.params import SamplingParams, UnsupportedFieldError

PromptInput = str | dict | Sequence[int]


def as_prompt_list(prompts: Any) -> list[str | dict]:
    """One prompt or a list of them; a single prompt is a string or a dict (TextPrompt/TokensPrompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")


def encode_prompts(prompts: list[str | dict], tokenizer: Tokenizer | None) -> list[tuple[str | None, list[int]]]:
    """(text, ids) per prompt; texts are encoded in one tokenizer call, special tokens added (as vLLM)."""
    parsed: list[tuple[str | None, list[int] | None]] = [_parse(i, p) for i, p in enumerate(prompts)]
    texts = [text for text, ids in parsed if ids is None]
    if texts:
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
        encoded = iter(tokenizer(texts, add_special_tokens=True)["input_ids"])
        parsed = [(text, list(next(encoded)) if ids is None else ids) for text, ids in parsed]
    return parsed  # type: ignore[return-value]


def _parse(index: int, prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, dict):
        raise TypeError(
            f"prompt {index}: expected a string or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )
    extra = set(prompt) - {"prompt", "prompt_token_ids"}
    if extra:
        raise UnsupportedFieldError(
            f"prompt {index}: {', '.join(sorted(extra))} not supported by cbrun (text and token-id prompts only)"
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if (
            not isinstance(ids, Sequence)
            or isinstance(ids, str)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise TypeError(f"prompt {index}: prompt_token_ids must be a list of integers")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], None
    raise TypeError(f"prompt {index}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (vLLM's default, max_tokens 16, when None)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    for index, value in enumerate(params):
        if not isinstance(value, SamplingParams):
            raise TypeError(f"sampling_params[{index}] must be cbrun.SamplingParams, got {type(value).__name__}")
    return params


@dataclass(frozen=True)
class ChatOptions:
    """How `LLM.chat` renders its conversations (vLLM's arguments of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None


def render_chats(
    tokenizer: Any, messages: Any, history: Sequence[int] | Sequence[Sequence[int]] | None, options: ChatOptions
) -> list[tuple[str | None, list[int]]]:
    """(rendered text, ids) per conversation; after `history` ids, (None, history + the new turn's ids)."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    conversations = [flatten_messages(list(conversation)) for conversation in conversations]
    extra = options.chat_template_kwargs or {}
    if history is None:
        texts = [
            tokenizer.apply_chat_template(
                c,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                chat_template=options.chat_template,
                tools=options.tools,
                **extra,
            )
            for c in conversations
        ]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template holds them
        return [(text, list(ids)) for text, ids in zip(texts, encoded)]
    histories = _histories(history, len(conversations))
    texts = [
        follow_up_text(
            tokenizer,
            ids,
            c,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=options.chat_template,
            tools=options.tools,
            template_kwargs=extra,
        )
        for ids, c in zip(histories, conversations)
    ]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [(None, ids + list(new)) for ids, new in zip(histories, encoded)]


def _histories(history: Sequence[int] | Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """One id list per conversation: a flat list serves a single conversation."""
    flat = bool(history) and all(_is_id(t) for t in history)
    lists: list[list[Any]] = [list(history)] if flat else [list(h) for h in history]  # type: ignore[arg-type]
    if len(lists) != count:
        raise ValueError(f"history_token_ids: got {len(lists)} id lists for {count} conversations")
    for index, ids in enumerate(lists):
        if not ids or not all(_is_id(t) for t in ids):
            raise TypeError(f"history_token_ids[{index}] must be a non-empty list of integer token ids")
    return lists


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
