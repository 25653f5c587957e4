"""Input rows with `prompt_token_ids` (vLLM's name), alone or beside `messages` for a next turn (issue 34,
item 4): the ids are used as they are and the new messages are rendered after them and appended."""

from __future__ import annotations

import json

import pytest

from cbrun.cli.app import main
from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow
from cbrun.engine.sampling_params import SamplingParams

Q1 = [{"role": "user", "content": "What is the capital of France?"}]
Q2 = [{"role": "user", "content": "And of Italy?"}]
NEXT = "<|user|>\nAnd of Italy?</s>\n<|assistant|>\n"  # the tiny template's rendering of Q2 and the prompt
EOS = 2


def _prepare(tokenizer, record: dict):
    preparer = GeneratePreparer(tokenizer, SamplingParams(max_tokens=4), max_context=256, vocab_size=512)
    row = preparer.parse(RawRow(3, record, None))
    return row if isinstance(row, BadRow) else preparer.tokenize([row])[0]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_token_ids_alone_are_the_prompt_and_win_over_a_text_prompt(tiny_tokenizer):
    row = _prepare(tiny_tokenizer, {"prompt_token_ids": [5, 6, 7], "prompt": "ignored"})
    assert row.token_ids == [5, 6, 7] and row.kind == "ids"


def test_prompt_token_ids_with_messages_append_the_next_turn_without_touching_the_ids(tiny_tokenizer):
    ended = _prepare(tiny_tokenizer, {"prompt_token_ids": [9, 8, 7, EOS], "messages": Q2})
    assert ended.token_ids == [9, 8, 7, EOS] + _ids(tiny_tokenizer, "\n" + NEXT)  # EOS sampled: the separator
    cut = _prepare(tiny_tokenizer, {"prompt_token_ids": [9, 8, 7], "messages": Q2})
    assert cut.token_ids == [9, 8, 7] + _ids(tiny_tokenizer, "</s>\n" + NEXT)  # cut short: the whole closing


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt_token_ids": "1 2 3"}, "row 3: prompt_token_ids: must be a non-empty list of integer token ids"),
        ({"prompt_token_ids": [], "messages": Q2}, "row 3: prompt_token_ids: must be a non-empty list"),
        ({"prompt_token_ids": [5, 600]}, "token id 600 at position 1 is outside the vocabulary"),
        ({"prompt_token_ids": [5, 600], "messages": Q2}, "token id 600 at position 1 is outside the vocabulary"),
        ({"prompt_token_ids": [5], "messages": "hi"}, "row 3: messages: must be a non-empty list of chat messages"),
    ],
)
def test_bad_token_id_rows_name_the_field(tiny_tokenizer, record, message):
    row = _prepare(tiny_tokenizer, record)
    assert isinstance(row, BadRow) and message in row.message


def _generate(source, target, model_dir):
    code = main(
        [
            "generate",
            str(source),
            str(target),
            "-m",
            str(model_dir),
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--num-blocks",
            "64",
            "--dtype",
            "float32",
            "--prompt-token-ids",
            "-q",
        ]
    )
    assert code == 0
    return {r["id"]: r for r in map(json.loads, target.read_text().splitlines())}


def test_cli_second_turn_rows_keep_every_id_of_the_first(tiny_llama_dir, tiny_tokenizer, tmp_path):
    first_in, first_out = tmp_path / "turn1.jsonl", tmp_path / "out1.jsonl"
    first_in.write_text(json.dumps({"id": "a", "messages": Q1}) + "\n")
    first = _generate(first_in, first_out, tiny_llama_dir)["a"]
    history = first["prompt_token_ids"] + first["completion_token_ids"]
    second_in, second_out = tmp_path / "turn2.jsonl", tmp_path / "out2.jsonl"
    second_in.write_text(json.dumps({"id": "a", "prompt_token_ids": history, "messages": Q2}) + "\n")
    second = _generate(second_in, second_out, tiny_llama_dir)["a"]
    closing = "\n" if history[-1] == EOS else "</s>\n"
    assert second["prompt_token_ids"] == history + _ids(tiny_tokenizer, closing + NEXT)
