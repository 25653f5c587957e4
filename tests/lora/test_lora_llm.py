"""LoRA through vLLM's API: LLM(enable_lora=True), LoRARequest(name, id, path), lora_request= per call or per
prompt, add/remove/list_loras, update_lora from tensors, AsyncLLM."""

from __future__ import annotations

import asyncio

import pytest
from lora_helpers import random_pairs, save, state_dict

from cbrun import LLM, LoRARequest, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.llm import AsyncLLM
from cbrun.lora.peft_files import AdapterError
from cbrun.lora.request import LoRARequest as RequestFromItsModule
from cbrun.models import load_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")
PROMPTS = [{"prompt_token_ids": [1, *range(30, 30 + n)]} for n in (33, 12, 20)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Two PEFT adapter directories for the tiny Llama, and the pairs of a third."""
    model, _ = load_model(str(tiny_llama_dir))
    root = tmp_path_factory.mktemp("adapters")
    return save(root / "a", random_pairs(model, 1)), save(root / "b", random_pairs(model, 2)), random_pairs(model, 3)


def _completions(outputs):
    return [(c.token_ids, [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]) for o in outputs for c in o.outputs]


def test_lora_request_has_vllms_names_and_checks_them():
    request = LoRARequest("sql", 3, "/adapters/sql")
    assert RequestFromItsModule is LoRARequest
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("sql", 3, "/adapters/sql")
    assert (request.name, request.adapter_id, request.path) == ("sql", 3, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("sql", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


def test_llm_runs_adapters_per_call_and_per_prompt_as_each_alone(tiny_llama_dir, adapters):
    a_dir, b_dir, _ = adapters
    a, b = LoRARequest("a", 1, str(a_dir)), LoRARequest("b", 2, str(b_dir))
    with LLM(str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, max_loras=4) as llm:
        mixed = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[a, None, b])
        assert [o.lora_request for o in mixed] == [a, None, b]
        assert mixed[0].outputs[0].lora_request == a
        alone = [
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=a)[0],
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0],
            llm.generate(PROMPTS[2], GREEDY, use_tqdm=False, lora_request=b)[0],
        ]
        assert _completions(mixed) == _completions(alone)
        assert _completions(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) != _completions(alone[:1])
        assert llm.list_loras() == {1, 2}
        with pytest.raises(ValueError, match="loaded with id 1, not 5"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 5, str(a_dir)))
        with pytest.raises(ValueError, match="has no lora_path"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 3))
        with pytest.raises(ValueError, match="2 given for 3 prompts"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[a, b])
        assert llm.remove_lora(2) and llm.list_loras() == {1}
        assert not llm.remove_lora(2)


def test_prompt_logprobs_and_raw_rescoring_run_the_prompts_adapter(tiny_llama_dir, adapters):
    a = LoRARequest("a", 1, str(adapters[0]))
    params = SamplingParams(temperature=0.7, max_tokens=5, logprobs=1, prompt_logprobs=1, seed=4)
    with LLM(str(tiny_llama_dir), enable_lora=True) as llm:
        adapted = llm.generate(PROMPTS[1], params, use_tqdm=False, lora_request=a)[0]
        plain = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
        assert adapted.prompt_logprobs[1:] != plain.prompt_logprobs[1:]
        completion = adapted.outputs[0]
        ids = PROMPTS[1]["prompt_token_ids"] + completion.token_ids
        scored = llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False, lora_request=a
        )[0]
        tail = scored.prompt_logprobs[len(PROMPTS[1]["prompt_token_ids"]) :]
        assert [next(iter(p.values())).logprob for p in tail] == [
            p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)
        ]  # raw logprobs at temperature 0.7 are the adapter's, as a teacher-forced pass under it gives them


def test_update_lora_from_tensors_equals_loading_them_from_a_directory(tiny_llama_dir, adapters, tmp_path):
    a_dir, _, third = adapters
    with LLM(str(tiny_llama_dir), enable_lora=True) as llm:
        llm.add_lora(LoRARequest("a", 1, str(a_dir)))
        before = _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1)))
        llm.update_lora("a", state_dict(third))
        after = _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1)))
        llm.update_lora("fresh", state_dict(third), config={"lora_alpha": 16}, lora_int_id=9)
        added = _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("fresh", 9)))
        with pytest.raises(ValueError, match="pass config="):
            llm.update_lora("other", state_dict(third))
    with LLM(str(tiny_llama_dir), enable_lora=True) as llm:
        request = LoRARequest("c", 1, str(save(tmp_path / "c", third)))
        want = _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request))
    assert after == want == added and before != after


def test_without_enable_lora_a_lora_request_is_refused(tiny_llama_dir, adapters):
    with LLM(str(tiny_llama_dir)) as llm, pytest.raises(AdapterError, match="enable_lora"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters[0])))


def test_async_llm_streams_an_adapted_request(tiny_llama_dir, adapters):
    a = LoRARequest("a", 1, str(adapters[0]))
    with LLM(str(tiny_llama_dir), enable_lora=True) as llm:
        want = _completions(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=a))
        engine = AsyncLLM.from_llm(llm)

        async def last():
            final = None
            async for out in engine.generate(PROMPTS[0], GREEDY, "r1", lora_request=a):
                final = out
            return final

        assert _completions([asyncio.run(last())]) == want
