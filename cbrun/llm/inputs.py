"""vLLM's prompt forms -> (prompt text or None, token ids), and per-prompt sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
