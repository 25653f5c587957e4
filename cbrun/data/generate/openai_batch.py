"""OpenAI Batch API files: request lines in, response lines out.

Input lines look like
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "n": 2, "logprobs": true}}
and are recognised from the first row. Output is one line per request with all
its samples as `choices`, as the Batch API writes it:
    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "req_...", "body": {chat.completion}},
     "error": null}
`body.response_format` (json_object, json_schema) constrains the output;
a choice cut short by max_tokens has finish_reason "length".
A bad request gets status 400 and `body.error.message` naming the row; a
request the engine failed gets status 500.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from cbrun.data.constraints import response_format_fields
from cbrun.data.output_rows import RowKey, bad_row_number, engine_error, is_killed
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow, ParsedRow
from cbrun.engine.request import GenerationOutput

if TYPE_CHECKING:
    from cbrun.engine.model_spec import Tokenizer

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
PASSED_THROUGH = ("min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop")


def looks_like_openai_batch(record: dict | None) -> bool:
    """True for a Batch API request line (custom_id, body and url or method)."""
    return (
        isinstance(record, dict)
        and "custom_id" in record
        and isinstance(record.get("body"), dict)
        and ("url" in record or "method" in record)
    )


def convert_request(record: dict) -> tuple[dict, dict] | str:
    """A request line as a cbrun row plus its meta, or the reason it is not usable."""
    if not looks_like_openai_batch(record):
        return "not an OpenAI batch request (needs custom_id, url and a body object)"
    method = record.get("method", "POST")
    if str(method).upper() != "POST":
        return f"method: only POST is supported, got {method!r}"
    url = record.get("url", "/v1/chat/completions")
    endpoint = ENDPOINTS.get(url)
    if endpoint is None:
        return f"url: unsupported endpoint {url!r} (use {' or '.join(ENDPOINTS)})"
    body = record["body"]
    row: dict[str, Any] = {"custom_id": record["custom_id"]}
    if endpoint == "chat":
        if body.get("messages") is None:
            return "body.messages: missing"
        row["messages"] = body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if prompt is None:
            return "body.prompt: missing"
        row["input_ids" if isinstance(prompt, list) else "prompt"] = prompt
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        row["max_tokens"] = max_tokens
    for name in PASSED_THROUGH:
        if body.get(name) is not None:
            row[name] = body[name]
    if body.get("response_format") is not None:
        fields = response_format_fields(body["response_format"])
        if isinstance(fields, str):
            return f"body.{fields}"
        row.update(fields)
    if endpoint == "chat":
        want_logprobs = bool(body.get("logprobs"))
        top = (body.get("top_logprobs") or 0) if want_logprobs else 0
    else:
        want_logprobs = body.get("logprobs") is not None
        top = body.get("logprobs") or 0
    row["top_logprobs"] = top
    return row, {"endpoint": endpoint, "logprobs": want_logprobs, "model": body.get("model")}


def _short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class OpenAIFormat:
    """Writes Batch API output lines; all samples of a request go in one line."""

    per_row = True

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def convert(self, raw: RawRow) -> tuple[dict, dict] | BadRow:
        """The request line as a row for GeneratePreparer.parse, or a bad row."""
        if raw.record is None:
            return BadRow(raw.index, str(raw.index), f"{raw.where}: {raw.error}")
        converted = convert_request(raw.record)
        if isinstance(converted, str):
            custom_id = raw.record.get("custom_id")
            row_id = str(custom_id) if isinstance(custom_id, (str, int)) else str(raw.index)
            return BadRow(raw.index, row_id, f"{raw.where}: {converted}", meta={"endpoint": "chat"})
        return converted

    def result_rows(self, parsed: ParsedRow, results: list[tuple[int, GenerationOutput]]) -> list[dict]:
        results = sorted(results, key=lambda r: r[0])
        failed = [out for _, out in results if out.finish_reason == "error"]
        if failed:
            return [self._line(parsed.id, 500, _error_body(engine_error(parsed, failed[0]), "server_error"))]
        meta = parsed.meta or {}
        chat = meta.get("endpoint", "chat") == "chat"
        completion_tokens = sum(len(out.token_ids) for _, out in results)
        prompt_tokens = parsed.num_prompt_tokens
        body = {
            "id": ("chatcmpl-" if chat else "cmpl-") + _short_hash(parsed.id),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": meta.get("model") or self.model_name,
            "choices": [self._choice(sample, out, chat, meta.get("logprobs", False)) for sample, out in results],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": max(out.num_cached_tokens for _, out in results)},
            },
        }
        return [self._line(parsed.id, 200, body)]

    def bad_row(self, bad: BadRow) -> dict:
        return self._line(bad.id, 400, _error_body(bad.message, "invalid_request_error"))

    @staticmethod
    def classify(line: dict) -> RowKey:
        """Resume key of one output line; raises ValueError if it is not a Batch API output line."""
        if not isinstance(line, dict) or "custom_id" not in line or not isinstance(line.get("response"), dict):
            raise ValueError("not an OpenAI batch output line (needs custom_id and response)")
        response = line["response"]
        row_id = str(line["custom_id"])
        if response.get("status_code") == 200:
            return RowKey(row_id, all=True)
        message = ((response.get("body") or {}).get("error") or {}).get("message")
        if is_killed("error", message):
            return RowKey(row_id, killed=True)
        bad = bad_row_number(message)
        if bad is not None:
            return RowKey(row_id, bad_row=bad, failed=True)
        return RowKey(row_id, all=True, failed=True)

    def _line(self, custom_id: str, status: int, body: dict) -> dict:
        digest = _short_hash(custom_id)
        return {
            "id": f"batch_req_{digest}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{digest}", "body": body},
            "error": None,
        }

    def _choice(self, index: int, out: GenerationOutput, chat: bool, want_logprobs: bool) -> dict:
        logprobs = None
        if want_logprobs:
            logprobs = self._chat_logprobs(out) if chat else self._completion_logprobs(out)
        if chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
            }
        return {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, out: GenerationOutput) -> dict:
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        content = []
        for token_id, logprob, alternatives in zip(out.token_ids, out.logprobs, tops):
            text = self._token(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": (alt := self._token(t)), "logprob": lp, "bytes": list(alt.encode())}
                        for t, lp in alternatives
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, out: GenerationOutput) -> dict:
        tokens = [self._token(t) for t in out.token_ids]
        offsets, position = [], 0
        for text in tokens:
            offsets.append(position)
            position += len(text)
        top = None
        if out.top_logprobs is not None:
            top = [{self._token(t): lp for t, lp in alternatives} for alternatives in out.top_logprobs]
        return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": top, "text_offset": offsets}


def _error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
