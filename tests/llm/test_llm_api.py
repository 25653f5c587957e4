"""`from cbrun import LLM, SamplingParams`: vLLM's offline API over the engine (issue 27), on the tiny Llama."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from engine_helpers import reference_logprobs

from cbrun import (
    LLM,
    CompletionOutput,
    GuidedDecodingParams,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)
from cbrun.cli.app import main
from cbrun.llm.engine_args import UNSUPPORTED as UNSUPPORTED_OPTIONS
from cbrun.llm.params import UNSUPPORTED as UNSUPPORTED_FIELDS, UnsupportedFieldError
from cbrun.models import load_model

# A script as a vLLM user writes it; only its import line is changed to cbrun.
VLLM_SCRIPT = """
from cbrun import LLM, SamplingParams

llm = LLM(model=MODEL, dtype="float32", seed=0, enable_prefix_caching=True, max_num_seqs=64,
          num_gpu_blocks_override=256)
greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1)
sampled = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=6, logprobs=0, seed=7)
outputs = llm.generate(["the quick brown fox", {"prompt_token_ids": [1, 40, 41, 42, 43]}, "the quick brown fox"],
                       [greedy, greedy, sampled])
chats = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0.0, max_tokens=8))
"""


@pytest.fixture(scope="module")
def script(tiny_llama_dir):
    scope = {"MODEL": str(tiny_llama_dir)}
    exec(VLLM_SCRIPT, scope)
    yield scope
    scope["llm"].close()


@pytest.fixture(scope="module")
def llm(script):
    return script["llm"]


def cli_greedy_tokens(model_dir, rows, folder) -> dict[str, list[int]]:
    source, target = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert (
        main(
            [
                "generate",
                str(source),
                str(target),
                "-m",
                str(model_dir),
                "--max-tokens",
                "8",
                "--temperature",
                "0",
                "--num-blocks",
                "256",
                "--dtype",
                "float32",
                "-q",
            ]
        )
        == 0
    )
    return {r["id"]: r["completion_token_ids"] for r in map(json.loads, target.read_text().splitlines())}


def test_vllm_script_with_only_the_import_changed_gives_cbrun_generates_greedy_tokens(script, tiny_llama_dir, tmp_path):
    cli = cli_greedy_tokens(
        tiny_llama_dir,
        [
            {"id": "fox", "prompt": "the quick brown fox"},
            {"id": "ids", "input_ids": [1, 40, 41, 42, 43]},
            {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        ],
        tmp_path,
    )
    outputs, chats = script["outputs"], script["chats"]
    assert [o.request_id for o in outputs] == ["0", "1", "2"]  # input order
    assert outputs[0].outputs[0].token_ids == cli["fox"]
    assert outputs[1].outputs[0].token_ids == cli["ids"]
    assert chats[0].outputs[0].token_ids == cli["chat"]
    assert [c.index for c in outputs[2].outputs] == [0, 1, 2, 3]  # n = 4, each a sample of its own
    assert len({tuple(c.token_ids) for c in outputs[2].outputs}) > 1
    assert outputs[0].prompt == "the quick brown fox" and outputs[1].prompt is None
    assert chats[0].prompt.endswith("<|assistant|>\n")


def _check_type(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is typing.Any:
        return True
    if origin in (typing.Union, __import__("types").UnionType):
        return any(_check_type(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_check_type(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation)
        return isinstance(value, dict) and all(_check_type(k, key) and _check_type(v, item) for k, v in value.items())
    if isinstance(annotation, (typing.ForwardRef, str)):
        return True
    return isinstance(value, annotation)


def test_every_listed_field_is_present_with_vllms_type(script):
    out = script["outputs"][0]
    assert isinstance(out, RequestOutput)
    for name, kind in {"request_id": str, "prompt": str, "prompt_token_ids": list, "outputs": list}.items():
        assert isinstance(getattr(out, name), kind), name
    completion = out.outputs[0]
    assert isinstance(completion, CompletionOutput)
    assert isinstance(completion.index, int) and isinstance(completion.text, str)
    assert all(isinstance(t, int) for t in completion.token_ids)
    assert isinstance(completion.cumulative_logprob, float)
    assert completion.finish_reason in ("stop", "length") and completion.finished()
    assert completion.stop_reason is None or isinstance(completion.stop_reason, (int, str))
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert next(iter(position)) == token  # the sampled token first, then the top 2
        assert len(position) in (2, 3)
        for token_id, entry in position.items():
            assert isinstance(token_id, int) and isinstance(entry, Logprob)
            assert isinstance(entry.logprob, float) and isinstance(entry.decoded_token, str)
            assert entry.rank is None or isinstance(entry.rank, int)
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    hints = typing.get_type_hints(CompletionOutput)
    for field in dataclasses.fields(CompletionOutput):
        assert _check_type(getattr(completion, field.name), hints[field.name]), field.name


def test_greedy_ranks_are_one_and_logprobs_match_a_plain_forward(script, tiny_llama_dir):
    out = script["outputs"][0]
    reference, _ = load_model(str(tiny_llama_dir), dtype="float32")
    completion = out.outputs[0]
    expected = reference_logprobs(reference, out.prompt_token_ids, completion.token_ids)
    got = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)]
    assert got == pytest.approx(expected, abs=1e-4)
    assert all(p[t].rank == 1 for t, p in zip(completion.token_ids, completion.logprobs))
    prompt = out.prompt_token_ids
    expected_prompt = reference_logprobs(reference, prompt[:1], prompt[1:])
    got_prompt = [p[t].logprob for t, p in zip(prompt[1:], out.prompt_logprobs[1:])]
    assert got_prompt == pytest.approx(expected_prompt, abs=1e-4)


def test_logprobs_at_another_temperature_are_raw_like_vllms(llm, tiny_llama_dir):
    prompt = [1, 40, 41, 42, 43]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.6, max_tokens=6, logprobs=1, seed=1), use_tqdm=False
    )[0].outputs[0]
    reference, _ = load_model(str(tiny_llama_dir), dtype="float32")
    expected = reference_logprobs(reference, prompt, out.token_ids)  # temperature 1: vLLM's raw logprobs
    assert [p[t].logprob for t, p in zip(out.token_ids, out.logprobs)] == pytest.approx(expected, abs=1e-4)


def test_a_seeded_llm_gives_the_same_samples_on_every_run(tiny_llama_dir, llm):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6)
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=128) as a:
        first = [c.token_ids for c in a.generate("hello world", params, use_tqdm=False)[0].outputs]
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=128) as b:
        again = [c.token_ids for c in b.generate("hello world", params, use_tqdm=False)[0].outputs]
    assert first == again


def test_stop_reason_names_the_stop_token_or_string(llm):
    free = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    by_id = llm.generate(
        "the quick brown fox", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[2]]), use_tqdm=False
    )
    completion = by_id[0].outputs[0]
    assert completion.token_ids == tokens[:3] and completion.finish_reason == "stop"
    assert completion.stop_reason == tokens[2]
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 :][:2]
    by_text = llm.generate(
        "the quick brown fox", SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert by_text.stop_reason == stop and by_text.text == text[: text.find(stop)]
    kept = llm.generate(
        "the quick brown fox",
        SamplingParams(temperature=0, max_tokens=8, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_max_model_len_caps_the_completion_as_vllm_does(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=10, num_gpu_blocks_override=64) as small:
        out = small.generate(
            {"prompt_token_ids": [1, 40, 41, 42, 43, 44]}, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False
        )[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with pytest.raises(ValueError, match="max_model_len"):
            small.generate({"prompt_token_ids": list(range(3, 13))}, use_tqdm=False)


def _not_neutral(neutral):
    """A value of the field's kind that differs from its neutral one (bool, int and float keys of one dict would
    collide: True == 1.0, 0 == 0.0)."""
    if neutral is None:
        return [1]
    if isinstance(neutral, bool):
        return not neutral
    if isinstance(neutral, (int, float)):
        return neutral + (3 if isinstance(neutral, int) else 0.5)
    return "x"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_sampling_fields_raise_naming_the_field(name):
    neutral, _ = UNSUPPORTED_FIELDS[name]
    value = _not_neutral(neutral)
    with pytest.raises(UnsupportedFieldError, match=rf"SamplingParams\.{name}\b"):
        SamplingParams(**{name: value})
    SamplingParams(**{name: neutral})  # the neutral value is accepted


def test_min_tokens_holds_back_a_stop_id_through_the_vllm_api(llm):
    prompt = {"prompt_token_ids": [1, 40, 41, 42, 43]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[1]  # declared a stop id: without min_tokens it ends the completion early
    early = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[stop], ignore_eos=True)
    ended, kept = (out.outputs[0] for out in llm.generate([prompt, prompt], [early, held], use_tqdm=False))
    assert len(ended.token_ids) <= 2 and ended.finish_reason == "stop"
    assert len(kept.token_ids) >= 6 and stop not in kept.token_ids[:6]
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens"):
        SamplingParams(min_tokens=-1)
    assert SamplingParams(max_tokens=None, min_tokens=50).to_engine(8, vocab_size=10).min_tokens == 8  # context cap


def test_unknown_or_unsupported_llm_options_raise_before_loading(tiny_llama_dir):
    for name in ("tensor_parallel_size", "quantization", "trust_remote_code"):
        value = {"tensor_parallel_size": 2, "quantization": "awq", "trust_remote_code": True}[name]
        assert name in UNSUPPORTED_OPTIONS
        with pytest.raises(UnsupportedFieldError, match=name):
            LLM(str(tiny_llama_dir), **{name: value})
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(tiny_llama_dir), no_such_option=1)
    with pytest.raises(TypeError):
        SamplingParams(no_such_field=1)


def test_bad_prompts_and_per_prompt_params_are_clear_errors(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(UnsupportedFieldError, match="multi_modal_data"):
        llm.generate({"prompt": "a", "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: token id 9999"):
        llm.generate({"prompt_token_ids": [1, 9999]}, use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("a", lora_request=object(), use_tqdm=False)


def test_use_tqdm_accepts_a_tqdm_like_class(llm):
    seen = []

    class Bar:
        def __init__(self, total, desc):
            seen.append(("open", total, desc))

        def update(self, count):
            seen.append(("update", count))

        def close(self):
            seen.append(("close",))

    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert seen == [("open", 2, "Processed prompts"), ("update", 1), ("update", 1), ("close",)]


def test_skip_special_tokens_false_keeps_special_tokens_but_not_the_stop_token(llm):
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [1, 40, 41]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    special = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, skip_special_tokens=False), use_tqdm=False
    )[0].outputs[0]
    assert special.token_ids == plain.token_ids
    ids = plain.token_ids[:-1] if plain.finish_reason == "stop" else plain.token_ids
    assert special.text == tokenizer.decode(ids, skip_special_tokens=False)


def test_structured_outputs_constrain_the_completion_as_vllms_params_ask(llm):
    choice = SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    regex = SamplingParams(temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(regex="[0-9]{3}"))
    as_dict = SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": ["yes", "no"]})
    picked, digits, again = llm.generate(["pick one", "a number", "pick one"], [choice, regex, as_dict], use_tqdm=False)
    assert picked.outputs[0].text in ("yes", "no") and again.outputs[0].text == picked.outputs[0].text
    assert len(digits.outputs[0].text) == 3 and digits.outputs[0].text.isdigit()
    with pytest.raises(UnsupportedFieldError, match=r"StructuredOutputsParams\.backend"):
        StructuredOutputsParams(regex="a", backend="xgrammar")
