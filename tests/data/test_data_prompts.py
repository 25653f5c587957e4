"""Row validation and prompt building: every bad row becomes a message naming row, field, reason."""

from __future__ import annotations

import pytest
from fake_engine import FakeTokenizer

from cbrun.data.generate.preparer import GeneratePreparer
from cbrun.data.reader import RawRow
from cbrun.data.rows import BadRow, ParsedRow
from cbrun.engine.sampling_params import SamplingParams


def make(base: SamplingParams | None = None, **kwargs) -> GeneratePreparer:
    options = {"max_context": 64, "vocab_size": FakeTokenizer.vocab_size}
    options.update(kwargs)
    return GeneratePreparer(FakeTokenizer(), base or SamplingParams(max_tokens=8, temperature=0.0), **options)


def prepare(preparer: GeneratePreparer, record: dict | None, index: int = 0, error: str | None = None):
    spec = preparer.parse(RawRow(index, record, error))
    if isinstance(spec, BadRow):
        return spec
    return preparer.tokenize([spec])[0]


def test_prompt_messages_and_input_ids_build_token_ids():
    p = make()
    text = prepare(p, {"prompt": "hi"})
    assert isinstance(text, ParsedRow) and text.token_ids == [1, ord("h") + 3, ord("i") + 3]
    chat = prepare(p, {"messages": [{"role": "user", "content": "hi"}]}, index=1)
    assert chat.token_ids == FakeTokenizer().encode("<user>hi<assistant>", add_special_tokens=False)
    ids = prepare(p, {"input_ids": [5, 6, 7]}, index=2)
    assert ids.token_ids == [5, 6, 7] and ids.kind == "ids"


def test_chat_flag_wraps_text_prompts_and_prompt_column_overrides():
    chat = prepare(make(chat=True), {"prompt": "hi"})
    assert chat.kind == "chat" and chat.token_ids == FakeTokenizer().encode("<user>hi<assistant>", False)
    custom = prepare(make(prompt_column="question"), {"question": "q", "prompt": "ignored"})
    assert custom.token_ids == FakeTokenizer().encode("q")
    # a "prompt" column holding chat messages (TRL style) is a chat
    trl = prepare(make(), {"prompt": [{"role": "user", "content": "x"}]})
    assert trl.kind == "chat"


def test_row_id_is_id_then_custom_id_then_row_number_as_string():
    p = make()
    assert prepare(p, {"id": 7, "prompt": "a"}, index=0).id == "7"
    assert prepare(p, {"custom_id": "c", "prompt": "a"}, index=1).id == "c"
    assert prepare(p, {"prompt": "a"}, index=2).id == "2"


def test_sampling_overrides_apply_per_row():
    spec = prepare(
        make(),
        {
            "prompt": "a",
            "max_tokens": 3.0,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "min_p": 0.1,
            "seed": 11,
            "n": 2,
            "stop": ["x", "y"],
        },
    )
    assert spec.sampling == SamplingParams(
        max_tokens=3, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=11, n=2, stop=("x", "y")
    )
    assert prepare(make(), {"prompt": "a", "stop": "x", "max_tokens": None}).sampling.stop == ("x",)


def test_min_tokens_row_override_applies_with_max_tokens_and_bad_values_name_the_field():
    held = make(base=SamplingParams(max_tokens=8, min_tokens=6, temperature=0.0))
    both = prepare(held, {"prompt": "a", "max_tokens": 4, "min_tokens": 2.0})  # lowered together: valid
    assert isinstance(both, ParsedRow) and (both.sampling.max_tokens, both.sampling.min_tokens) == (4, 2)
    assert prepare(make(), {"prompt": "a", "min_tokens": 5}).sampling.min_tokens == 5
    for index, value in enumerate([-1, 9, 1.5, "3"]):
        bad = prepare(make(), {"prompt": "a", "min_tokens": value}, index=index)
        assert isinstance(bad, BadRow) and bad.message.startswith(f"row {index}: min_tokens: must be an integer")
    below = prepare(held, {"prompt": "a", "max_tokens": 4})  # the job's min_tokens 6 over the row's max_tokens
    assert isinstance(below, BadRow) and "min_tokens" in below.message and "max_tokens (4)" in below.message


@pytest.mark.parametrize(
    "record, expected",
    [
        (None, "row 4: not valid JSON"),
        ({"text": "no prompt field"}, "row 4: no prompt"),
        ({"prompt": ""}, "row 4: prompt: empty prompt"),
        ({"prompt": 5}, "row 4: prompt: must be text"),
        ({"messages": []}, "row 4: messages: empty list"),
        ({"messages": "hello"}, "row 4: messages: must be a non-empty list of chat messages"),
        ({"messages": [{"content": "x"}]}, "row 4: messages: each chat message needs"),
        ({"messages": [{"role": "user", "content": 3}]}, "row 4: messages: chat template failed"),
        ({"input_ids": "abc"}, "row 4: input_ids: must be a non-empty list of integer token ids"),
        ({"input_ids": [1, True]}, "row 4: input_ids: must be a non-empty list"),
        ({"input_ids": [1, 9999]}, "row 4: input_ids: token id 9999 at position 1 is outside the vocabulary"),
        ({"input_ids": [-1]}, "row 4: input_ids: token id -1 at position 0"),
        (
            {"prompt": "x" * 60},
            "row 4: prompt: prompt of 61 tokens plus max_tokens 8 exceeds the model's context of 64",
        ),
        ({"prompt": "a", "max_tokens": 0}, "row 4: max_tokens: must be an integer >= 1, got 0"),
        ({"prompt": "a", "max_tokens": "ten"}, "row 4: max_tokens: must be an integer >= 1, got 'ten'"),
        ({"prompt": "a", "temperature": -1}, "row 4: temperature: must be a number >= 0"),
        ({"prompt": "a", "top_p": 2}, "row 4: top_p: must be in (0, 1]"),
        ({"prompt": "a", "top_k": 1.5}, "row 4: top_k: must be an integer >= 0"),
        ({"prompt": "a", "min_p": "x"}, "row 4: min_p: must be in [0, 1]"),
        ({"prompt": "a", "seed": "s"}, "row 4: seed: must be an integer"),
        ({"prompt": "a", "n": 0}, "row 4: n: must be an integer >= 1"),
        ({"prompt": "a", "stop": 5}, "row 4: stop: must be a string or a list of strings"),
        ({"prompt": "a", "stop": [""]}, "row 4: stop: must be non-empty strings"),
        ({"prompt": "a", "id": {"x": 1}}, "row 4: id: must be a string or an integer"),
    ],
)
def test_bad_rows_name_row_field_and_reason(record, expected):
    bad = prepare(make(), record, index=4, error="not valid JSON: oops" if record is None else None)
    assert isinstance(bad, BadRow), bad
    assert bad.message.startswith(expected), bad.message
    assert bad.index == 4


def test_duplicate_id_is_an_error_for_the_later_row():
    p = make()
    assert isinstance(prepare(p, {"id": "a", "prompt": "x"}, index=0), ParsedRow)
    dup = prepare(p, {"id": "a", "prompt": "y"}, index=1)
    assert isinstance(dup, BadRow) and dup.message == "row 1: id: duplicate id 'a' (first used by row 0)"
    assert dup.id == "a"


def test_tokenizer_without_chat_template_makes_chat_rows_bad():
    p = make()
    p.tokenizer.chat_template = None
    bad = prepare(p, {"messages": [{"role": "user", "content": "x"}]})
    assert isinstance(bad, BadRow) and "no chat template" in bad.message
    assert isinstance(prepare(p, {"prompt": "ok"}, index=1), ParsedRow)


def test_keep_columns_are_copied_even_for_bad_rows():
    p = make(keep_columns=("label", "missing"))
    good = prepare(p, {"prompt": "a", "label": 3})
    bad = prepare(p, {"prompt": "", "label": 4}, index=1)
    assert good.keep == {"label": 3, "missing": None}
    assert bad.keep == {"label": 4, "missing": None}


def test_tokenize_handles_a_window_in_order():
    p = make()
    raws = [{"prompt": "a"}, {"input_ids": [7]}, {"messages": [{"role": "user", "content": "b"}]}, {"prompt": "c"}]
    specs = [p.parse(RawRow(i, r)) for i, r in enumerate(raws)]
    out = p.tokenize(specs)
    assert [s.index for s in out] == [0, 1, 2, 3]
    assert out[3].token_ids == [1, ord("c") + 3]
