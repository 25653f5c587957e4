"""Partial rollouts through vLLM's API (issue 34, item 3): LLM.abort, pauses around update_weights while
another thread is in generate, and AsyncLLM's streams, on the tiny Llama in fp32.

The engine-level contract (no token lost or repeated across an update, bitwise against uninterrupted runs)
is tests/engine/test_engine_pause.py's; these check that the API carries it through.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from cbrun import LLM, AsyncLLM, SamplingParams
from cbrun.models import load_model

PROMPT = {"prompt_token_ids": [1] + list(range(40, 70))}
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=0)


def _wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def new_weights(tiny_llama_dir):
    model, _ = load_model(str(tiny_llama_dir), dtype="float32")
    generator = torch.Generator().manual_seed(7)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()}


class _Generating:
    """llm.generate in a thread of its own, as a rollout worker would run it."""

    def __init__(self, llm: LLM, prompts, params) -> None:
        self.result: list = []
        self.thread = threading.Thread(target=lambda: self.result.extend(llm.generate(prompts, params, use_tqdm=False)))
        self.thread.start()

    def join(self) -> list:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        return self.result


def test_abort_returns_partial_outputs_to_the_caller_and_to_generate(llm):
    first = llm.generate(PROMPT, LONG, use_tqdm=False)[0]
    reference = first.outputs[0]
    before = llm.engine.stats().generated_tokens
    running = _Generating(llm, PROMPT, LONG)
    _wait_until(lambda: llm.engine.stats().generated_tokens >= before + 3)
    rid = str(int(first.request_id) + 1)  # vLLM's LLM numbers its requests in order: the next call's
    [aborted] = llm.abort([rid])
    [returned] = running.join()
    partial = aborted.outputs[0]
    k = len(partial.token_ids)
    assert aborted.request_id == returned.request_id == rid
    assert partial.finish_reason == "abort" and returned.outputs[0].finish_reason == "abort" and 3 <= k < 120
    assert returned.outputs[0].token_ids == partial.token_ids == reference.token_ids[:k]
    assert [p[t].logprob for t, p in zip(partial.token_ids, partial.logprobs)] == [
        p[t].logprob for t, p in zip(reference.token_ids[:k], reference.logprobs[:k])
    ]
    assert partial.weight_versions == [llm.weight_version] * k


def test_keep_across_an_update_inside_generate_tags_every_token_with_its_version(tiny_llama_dir, new_weights):
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=120, ignore_eos=True, logprobs=0)
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=64) as llm:
        running = _Generating(llm, PROMPT, params)
        _wait_until(lambda: llm.engine.stats().generated_tokens >= 6)
        llm.update_weights(new_weights, pause_mode="keep")
        [out] = running.join()
        assert llm.weight_version == 1 and not llm.is_paused()
    for completion in out.outputs:
        k = completion.weight_versions.count(0)
        assert completion.finish_reason == "length" and len(completion.token_ids) == 120
        assert 0 < k < 120 and completion.weight_versions == [0] * k + [1] * (120 - k)
        assert completion.weight_version == 1 and len(completion.logprobs) == 120


def test_pause_abort_returns_partial_rollouts_then_update_and_resume(tiny_llama_dir, new_weights):
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=64) as llm:
        running = _Generating(llm, [PROMPT, PROMPT], LONG)
        _wait_until(lambda: llm.engine.stats().generated_tokens >= 4)
        llm.pause_generation(mode="abort")
        partial = running.join()
        assert llm.is_paused()
        llm.update_weights(new_weights)
        llm.resume_generation()
        after = llm.generate(PROMPT, LONG, use_tqdm=False)[0].outputs[0]
    assert all(o.outputs[0].finish_reason == "abort" and len(o.outputs[0].token_ids) < 120 for o in partial)
    assert all(set(o.outputs[0].weight_versions) <= {0} for o in partial)
    assert after.weight_versions == [1] * 120 and after.finish_reason == "length"


async def _collect(engine: AsyncLLM, prompt, params, request_id, stop_after=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
        if stop_after is not None and len(outs) == stop_after:
            break
    return outs


def test_async_generate_streams_cumulative_outputs_ending_as_llm_generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    outs = asyncio.run(_collect(AsyncLLM.from_llm(llm), PROMPT, params, "stream-1"))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[:12] == [expected.token_ids[: i + 1] for i in range(12)]  # one more token each time
    final = outs[-1].outputs[0]
    assert final.token_ids == expected.token_ids and final.text == expected.text
    assert final.logprobs == expected.logprobs and final.finish_reason == "length"
    assert outs[11].outputs[0].logprobs == expected.logprobs  # the streamed positions, alternatives included
    assert outs[-1].request_id == "stream-1" and outs[-1].prompt_token_ids == PROMPT["prompt_token_ids"]


def test_async_abort_by_id_ends_the_stream_with_abort(llm):
    engine = AsyncLLM.from_llm(llm)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def scenario():
        seen = []

        async def consume():
            async for out in engine.generate(PROMPT, params, "to-abort"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        [returned] = await engine.abort("to-abort")
        await asyncio.wait_for(task, 30)
        return seen, returned

    seen, returned = asyncio.run(scenario())
    last = seen[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert last.outputs[0].token_ids == returned.outputs[0].token_ids and len(last.outputs[0].token_ids) < 300


def test_async_closing_the_stream_aborts_the_request_and_ids_must_be_unique(llm):
    engine = AsyncLLM.from_llm(llm)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def scenario():
        outs = await _collect(engine, PROMPT, params, "closed", stop_after=2)  # break: the generator is closed
        running = engine.generate(PROMPT, params, "twice")
        await running.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await engine.generate(PROMPT, params, "twice").__anext__()
        await running.aclose()
        return outs

    assert len(asyncio.run(scenario())) == 2
    _wait_until(lambda: llm.engine.stats().blocks_used == 0)
    assert llm.engine.num_unfinished() == 0


def test_async_samples_stream_across_a_keep_pause_and_an_update(tiny_llama_dir, new_weights):
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=60, ignore_eos=True, logprobs=0)
    with LLM(str(tiny_llama_dir), dtype="float32", seed=0, num_gpu_blocks_override=64) as llm:
        expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
        engine = AsyncLLM.from_llm(llm)

        async def scenario():
            outs, updated = [], False
            async for out in engine.generate(PROMPT, params, "pair"):
                outs.append(out)
                if not updated and sum(len(c.token_ids) for c in out.outputs) >= 6:
                    await engine.pause_generation(mode="keep")
                    assert await engine.is_paused()
                    await engine.update_weights(new_weights)
                    await engine.resume_generation()
                    updated = True
            return outs

        outs = asyncio.run(scenario())
    final = outs[-1].outputs
    assert outs[-1].finished and [c.index for c in final] == [0, 1]
    for completion, before in zip(final, expected):
        k = completion.weight_versions.count(0)
        assert len(completion.token_ids) == 60 and completion.weight_versions == [0] * k + [1] * (60 - k)
        assert completion.token_ids[:k] == before.token_ids[:k]  # the old weights' samples, up to the update
    assert any(0 < c.weight_versions.count(0) < 60 for c in final)
