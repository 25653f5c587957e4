"""OpenAI Batch API input lines and output lines."""

from __future__ import annotations

from fake_engine import FakeTokenizer

from cbrun.data.generate.openai_batch import OpenAIFormat, convert_request, looks_like_openai_batch
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow
from cbrun.engine.request import GenerationOutput
from cbrun.engine.sampling_params import SamplingParams

CHAT = {
    "custom_id": "q1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "gpt-x",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "temperature": 0.2,
        "n": 2,
        "seed": 3,
        "stop": ["\n"],
        "logprobs": True,
        "top_logprobs": 2,
    },
}
COMPLETION = {
    "custom_id": "q2",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"prompt": ["hello"], "max_tokens": 4, "logprobs": 1},
}


def test_request_lines_are_recognised_and_converted():
    assert looks_like_openai_batch(CHAT) and looks_like_openai_batch(COMPLETION)
    assert not looks_like_openai_batch({"prompt": "x", "custom_id": "a"})
    row, meta = convert_request(CHAT)
    assert row == {
        "custom_id": "q1",
        "messages": CHAT["body"]["messages"],
        "max_tokens": 5,
        "temperature": 0.2,
        "n": 2,
        "seed": 3,
        "stop": ["\n"],
        "top_logprobs": 2,
    }
    assert meta == {"endpoint": "chat", "logprobs": True, "model": "gpt-x"}
    row, meta = convert_request(COMPLETION)
    assert row == {"custom_id": "q2", "prompt": "hello", "max_tokens": 4, "top_logprobs": 1}
    assert meta["endpoint"] == "completions" and meta["logprobs"] is True


def test_bad_request_lines_give_reasons():
    assert "url: unsupported endpoint" in convert_request({**CHAT, "url": "/v1/embeddings"})
    assert "method" in convert_request({**CHAT, "method": "GET"})
    assert "body.messages: missing" in convert_request({**CHAT, "body": {"model": "m"}})
    fmt = OpenAIFormat(FakeTokenizer(), "m")
    bad = fmt.convert(RawRow(3, {"custom_id": "z", "url": "/v1/chat/completions", "body": {}}))
    assert isinstance(bad, BadRow) and bad.message == "row 3: body.messages: missing" and bad.id == "z"
    line = fmt.bad_row(bad)
    assert line["custom_id"] == "z" and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["message"] == "row 3: body.messages: missing"
    key = fmt.classify(line)
    assert key.bad_row == 3 and key.failed


def _spec(record, index=0):
    fmt = OpenAIFormat(FakeTokenizer(), "cbrun-model")
    preparer = GeneratePreparer(FakeTokenizer(), SamplingParams(), max_context=512, vocab_size=FakeTokenizer.vocab_size)
    converted = fmt.convert(RawRow(index, record))
    spec = preparer.parse(RawRow(index, record), *converted)
    return fmt, preparer.tokenize([spec])[0]


def _out(spec, sample, tokens, reason="stop", error=None, top=None):
    return GenerationOutput(
        request_id=spec.id,
        sample_index=sample,
        prompt_token_ids=spec.token_ids,
        token_ids=tokens,
        text=FakeTokenizer().decode(tokens),
        logprobs=[-0.5] * len(tokens),
        finish_reason=reason,
        error=error,
        top_logprobs=top,
    )


def test_chat_output_line_has_all_choices_usage_and_logprobs():
    fmt, spec = _spec(CHAT)
    assert spec.sampling.n == 2 and spec.sampling.top_logprobs == 2 and spec.sampling.max_tokens == 5
    a, b = FakeTokenizer().encode("ok", False), FakeTokenizer().encode("no", False)
    top = [[(t, -0.5), (t + 1, -2.0)] for t in b]
    [line] = fmt.result_rows(spec, [(1, _out(spec, 1, b, top=top)), (0, _out(spec, 0, a, "length", top=top))])
    assert line["custom_id"] == "q1" and line["error"] is None and line["id"].startswith("batch_req_")
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "gpt-x"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert body["choices"][0]["finish_reason"] == "length"
    first = body["choices"][1]["logprobs"]["content"][0]
    assert first["token"] == "n" and first["logprob"] == -0.5 and first["bytes"] == [ord("n")]
    assert [t["token"] for t in first["top_logprobs"]] == ["n", "o"]
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    assert fmt.classify(line).all and fmt.classify(line).id == "q1"


def test_completion_output_line_uses_text_completion_logprobs():
    fmt, spec = _spec(COMPLETION)
    tokens = FakeTokenizer().encode("ab", False)
    [line] = fmt.result_rows(spec, [(0, _out(spec, 0, tokens, top=[[(t, -0.5)] for t in tokens]))])
    body = line["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "cbrun-model"
    choice = body["choices"][0]
    assert choice["text"] == "ab"
    assert choice["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5}, {"b": -0.5}],
        "text_offset": [0, 1],
    }


def test_engine_failure_gives_status_500_naming_the_row():
    fmt, spec = _spec(CHAT, index=6)
    [line] = fmt.result_rows(spec, [(0, _out(spec, 0, [], "error", "boom"))])
    assert line["response"]["status_code"] == 500
    assert line["response"]["body"]["error"]["message"] == "row 6 (engine): boom"
    key = fmt.classify(line)
    assert key.all and key.failed and key.bad_row is None
