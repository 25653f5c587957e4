"""Chat messages as OpenAI clients send them, made plain for a text model's chat template.

A message's `content` may be a string or a list of parts
(`[{"type": "text", "text": ...}, ...]`). Templates of text models expect a
string, so the text parts are joined with newlines, as vLLM does for
templates that take string content. Image, audio, video and file parts name
inputs a text-only model cannot see: they are an error naming the part, never
silently dropped. The CLI (data/prompts.py) and the Python API (cbrun.llm)
both call `flatten_messages`.
"""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = ("text", "input_text")
MEDIA_PART_TYPES = (
    "image_url",
    "image",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio",
    "video_url",
    "video",
    "file",
    "input_file",
)


class ChatContentError(ValueError):
    """A message content the text model cannot take; the message says which message and part."""


def flatten_content(content: Any, where: str = "content") -> Any:
    """A string content as it is; a list of parts as its text parts joined by newlines.

    Any other value (None for an assistant turn with tool calls) is left to the template.
    """
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        if isinstance(part, str):  # a bare string part: some clients send these
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in TEXT_PART_TYPES:
            raise ChatContentError(f"{at}: a {kind!r} part needs a string 'text'")
        elif kind in MEDIA_PART_TYPES:
            raise ChatContentError(f"{at}: {kind!r} parts are not supported: cbrun runs text-only models")
        else:
            raise ChatContentError(f"{at}: unknown content part type {kind!r} (expected 'text')")
    return "\n".join(texts)


def flatten_messages(messages: list[dict]) -> list[dict]:
    """Copies of the messages with every list content flattened to text (ChatContentError if impossible)."""
    out = []
    for index, message in enumerate(messages):
        if isinstance(message.get("content"), (list, tuple)):
            message = {**message, "content": flatten_content(message["content"], f"[{index}].content")}
        out.append(message)
    return out
