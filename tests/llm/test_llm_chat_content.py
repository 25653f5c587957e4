"""Chat content as OpenAI sends it (a list of parts) is flattened to text in the CLI and the API (issue 27)."""

from __future__ import annotations

import json

import pytest

from cbrun import LLM, SamplingParams
from cbrun.cli.app import main
from cbrun.data.chat import ChatContentError, flatten_content, flatten_messages

PARTS = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
JOINED = "What is the capital\nof France?"  # vLLM joins text parts with newlines


def test_text_parts_are_joined_and_strings_kept():
    assert flatten_content(PARTS) == JOINED
    assert flatten_content("plain") == "plain" and flatten_content(None) is None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PARTS}]
    flat = flatten_messages(messages)
    assert flat == [{"role": "system", "content": "be brief"}, {"role": "user", "content": JOINED}]
    assert messages[1]["content"] is PARTS  # the caller's messages are not changed


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, r"\[1\]\.content\[1\]: 'image_url' parts"),
        ({"type": "input_audio", "input_audio": {}}, r"'input_audio' parts are not supported"),
        ({"type": "hologram"}, r"unknown content part type 'hologram'"),
        ({"type": "text"}, r"needs a string 'text'"),
    ],
)
def test_parts_a_text_model_cannot_take_are_errors_naming_them(part, message):
    with pytest.raises(ChatContentError, match=message):
        flatten_messages([{"role": "system", "content": "x"}, {"role": "user", "content": [PARTS[0], part]}])


def test_cli_flattens_parts_and_gives_an_error_row_for_an_image(tiny_llama_dir, tmp_path):
    rows = [
        {"id": "string", "messages": [{"role": "user", "content": JOINED}]},
        {"id": "parts", "messages": [{"role": "user", "content": PARTS}]},
        {
            "id": "image",
            "messages": [{"role": "user", "content": [PARTS[0], {"type": "image_url", "image_url": {"url": "x"}}]}],
        },
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(
        [
            "generate",
            str(source),
            str(target),
            "-m",
            str(tiny_llama_dir),
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--num-blocks",
            "64",
            "--dtype",
            "float32",
            "-q",
        ]
    )
    assert code == 1  # the job ran every row; exit 1 says some rows failed
    out = {r["id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert out["parts"]["completion_token_ids"] == out["string"]["completion_token_ids"]
    assert out["parts"]["error"] is None
    assert "messages[0].content[1]: 'image_url' parts are not supported" in out["image"]["error"]


def test_llm_chat_flattens_parts_like_a_string_content(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6)
    with LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64) as llm:
        parts, plain = llm.chat(
            [[{"role": "user", "content": PARTS}], [{"role": "user", "content": JOINED}]], params, use_tqdm=False
        )
        assert parts.prompt_token_ids == plain.prompt_token_ids
        assert parts.outputs[0].token_ids == plain.outputs[0].token_ids
        with pytest.raises(ChatContentError, match="image_url"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
