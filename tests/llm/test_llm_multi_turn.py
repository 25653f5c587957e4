"""Multi-turn token-in, token-out (issue 34, item 4): chat's prompt ids are the template's, and a next turn
given as the previous turn's ids plus the new messages keeps every earlier id, separators included.

The tiny tokenizer's template renders a message as `<|role|>\\n{content}</s>\\n` and the generation prompt
as `<|assistant|>\\n`; its end of turn `</s>` is the model's EOS (id 2).
"""

from __future__ import annotations

import pytest

from cbrun import LLM, SamplingParams, StructuredOutputsParams
from cbrun.data.follow_up import FollowUpError, follow_up_text

Q1 = [{"role": "user", "content": "What is the capital of France?"}]
Q2 = [{"role": "user", "content": "And of Italy?"}]
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=64) as llm:
        yield llm


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _template_ids(tokenizer, messages, **options) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)


def test_chat_prompt_token_ids_are_exactly_what_the_template_renders(llm):
    out = llm.chat(Q1, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == _template_ids(llm.tokenizer, Q1, add_generation_prompt=True)
    assert out.prompt == llm.tokenizer.apply_chat_template(Q1, tokenize=False, add_generation_prompt=True)


def test_turn_one_ids_reach_turn_two_unchanged_with_the_separator_after_the_sampled_eos(llm):
    """Turn 1 ends with the EOS the model sampled (a grammar with the token makes it), so turn 2 starts with
    the template's separator "\\n" after it: neither the EOS doubled nor the separator dropped."""
    grammar = StructuredOutputsParams(grammar='start: "Paris" <[2]>')  # llguidance's Lark: token id 2, EOS
    one = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=grammar)
    first = llm.chat(Q1, one, use_tqdm=False)[0]
    completion = first.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == EOS
    history = first.prompt_token_ids + completion.token_ids
    second = llm.chat(Q2, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False, history_token_ids=history)[0]
    ids = second.prompt_token_ids
    assert ids[: len(history)] == history  # every id of turn 1, the sampled completion's included
    assert ids[len(history) :] == _ids(llm.tokenizer, "\n<|user|>\nAnd of Italy?</s>\n<|assistant|>\n")
    assert llm.tokenizer.decode(ids[len(history) : len(history) + 1]) == "\n"  # the separator, right after EOS
    assert second.prompt is None and len(second.outputs[0].token_ids) == 3


def test_a_turn_cut_by_max_tokens_gets_its_closing_whole(llm):
    first = llm.chat(Q1, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert first.outputs[0].finish_reason == "length"
    history = first.prompt_token_ids + first.outputs[0].token_ids
    [second, other] = llm.chat(
        [Q2, [{"role": "user", "content": "hello"}]],
        SamplingParams(temperature=0.0, max_tokens=2),
        use_tqdm=False,
        history_token_ids=[history, [5, 6]],
    )
    closing_and_q2 = "</s>\n<|user|>\nAnd of Italy?</s>\n<|assistant|>\n"
    assert second.prompt_token_ids == history + _ids(llm.tokenizer, closing_and_q2)
    assert other.prompt_token_ids == [5, 6] + _ids(llm.tokenizer, "</s>\n<|user|>\nhello</s>\n<|assistant|>\n")


def test_continue_final_message_and_add_generation_prompt_as_vllm(llm):
    partial = [*Q1, {"role": "assistant", "content": "It is"}]
    out = llm.chat(
        partial,
        SamplingParams(temperature=0.0, max_tokens=2),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert out.prompt_token_ids == _template_ids(
        llm.tokenizer, partial, add_generation_prompt=False, continue_final_message=True
    )
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("<|assistant|>\nIt is")  # no closing: continued
    no_prompt = llm.chat(Q1, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False)[0]
    assert llm.tokenizer.decode(no_prompt.prompt_token_ids).endswith("?</s>\n")
    with pytest.raises(ValueError, match="not compatible"):  # both at once: refused, as vLLM (transformers) does
        llm.chat(partial, SamplingParams(max_tokens=1), use_tqdm=False, continue_final_message=True)
    history = [5, 6, EOS]
    more = llm.chat(
        [*Q2, {"role": "assistant", "content": "Rome"}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
        history_token_ids=history,
    )[0]
    assert more.prompt_token_ids == history + _ids(llm.tokenizer, "\n<|user|>\nAnd of Italy?</s>\n<|assistant|>\nRome")


def test_a_template_that_rewrites_assistant_content_is_refused(tiny_tokenizer):
    hiding = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(FollowUpError, match="previous turn ends"):
        follow_up_text(tiny_tokenizer, [5, 6], Q2, chat_template=hiding)
    with pytest.raises(FollowUpError, match="empty"):
        follow_up_text(tiny_tokenizer, [], Q2)
