"""Abort, pause and partial rollouts around a weight update (issue 34, item 3), on the tiny Llama in fp32.

Every comparison of tokens and logprobs is bitwise (`==`): the compiled kernels give a request the same
bits whatever else shares its steps, so an interrupted request can be checked against uninterrupted runs.
"""

from __future__ import annotations

import time

import pytest
import torch
from engine_helpers import random_prompts

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model

PROMPT = random_prompts(400, [24], seed=21)[0]
LONG = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(page_size=16, num_blocks=200)


def _wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def new_weights(tiny_llama_dir):
    """The tiny model's weights moved a little, as a training step would."""
    model, _ = load_model(str(tiny_llama_dir), dtype="float32")
    generator = torch.Generator().manual_seed(5)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()}


def _engine(tiny_llama_dir, weights=None) -> Engine:
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    if weights is not None:
        model.load_state_dict(weights)
    return Engine(model, tokenizer, CONFIG)


def _alone(tiny_llama_dir, prompt, params, weights=None):
    """The result of `prompt` run alone, uninterrupted, on a fresh engine."""
    with _engine(tiny_llama_dir, weights) as engine:
        return engine.generate_batch([prompt], params)[0]


def test_abort_returns_the_partial_output_and_delivers_it(tiny_llama_dir):
    reference = _alone(tiny_llama_dir, PROMPT, LONG)
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, LONG, request_id="r")
        _wait_until(lambda: engine.stats().generated_tokens >= 5)
        [partial] = engine.abort(["r", "not-live"])
        assert engine.stats().blocks_used == 0
        delivered = engine.get_result("r", timeout=10)
        assert engine.abort("r") == []
    k = len(partial.token_ids)
    assert partial.finish_reason == "abort" and partial.error is None and 5 <= k < 160
    assert partial.token_ids == reference.token_ids[:k] and partial.logprobs == reference.logprobs[:k]
    assert partial.weight_versions == [0] * k and partial.text
    assert delivered.token_ids == partial.token_ids and delivered.finish_reason == "abort"


def test_pause_abort_ends_live_requests_and_holds_new_ones_until_resume(tiny_llama_dir):
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, LONG, request_id="live")
        _wait_until(lambda: engine.stats().generated_tokens >= 2)
        ended = engine.pause_generation(mode="abort")
        assert [o.request_id for o in ended] == ["live"] and ended[0].finish_reason == "abort"
        assert engine.is_paused()
        engine.add_request(PROMPT, short, request_id="later")
        time.sleep(0.2)
        assert engine.get_result("later", timeout=0.01) is None  # held: nothing steps while paused
        assert engine.stats().pending == 0  # not even queued in the core
        engine.resume_generation()
        later = engine.get_result("later", timeout=30)
        assert not engine.is_paused()
    assert later.finish_reason == "length" and len(later.token_ids) == 6


def test_pause_wait_lets_requests_finish_on_the_old_weights(tiny_llama_dir, new_weights):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = _alone(tiny_llama_dir, PROMPT, params)
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, params, request_id="r")
        _wait_until(lambda: engine.stats().generated_tokens >= 1)
        assert engine.pause_generation(mode="wait") == []
        assert engine.stats().decoding == 0  # returned once they were done
        engine.update_weights(new_weights)
        engine.resume_generation()
        finished = engine.get_result("r", timeout=10)
        assert engine.weight_version == 1
        after = engine.generate_batch([PROMPT], params)[0]
    assert finished.token_ids == reference.token_ids and finished.logprobs == reference.logprobs
    assert finished.weight_versions == [0] * 40 and finished.weight_version == 0
    assert after.weight_versions == [1] * 40 and after.token_ids != reference.token_ids


def test_keep_across_an_update_loses_and_repeats_no_token(tiny_llama_dir, new_weights):
    """Tokens before the update are the old weights' run; tokens after it are exactly what the new weights
    give for the prompt plus those tokens (recomputed, not read from stale K/V), each tagged with its version."""
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, LONG, request_id="r")
        _wait_until(lambda: engine.stats().generated_tokens >= 5)
        assert engine.pause_generation(mode="keep") == []
        held_at = engine.stats().generated_tokens
        time.sleep(0.1)
        assert engine.stats().generated_tokens == held_at  # kept: nothing steps
        engine.update_weights(new_weights)  # allowed while paused, with the request live
        engine.resume_generation()
        out = engine.get_result("r", timeout=60)
    k = out.weight_versions.count(0)
    assert len(out.token_ids) == 160 and 5 <= k < 160
    assert out.weight_versions == [0] * k + [1] * (160 - k) and out.weight_version == 1
    old = _alone(tiny_llama_dir, PROMPT, LONG)
    assert out.token_ids[:k] == old.token_ids[:k] and out.logprobs[:k] == old.logprobs[:k]
    rest = SamplingParams(max_tokens=160 - k, temperature=0.0, ignore_eos=True)
    new = _alone(tiny_llama_dir, PROMPT + out.token_ids[:k], rest, new_weights)
    assert out.token_ids[k:] == new.token_ids and out.logprobs[k:] == new.logprobs


def test_keep_without_an_update_gives_the_uninterrupted_bits(tiny_llama_dir):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    reference = _alone(tiny_llama_dir, PROMPT, params)
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, params, request_id="r")
        _wait_until(lambda: engine.stats().generated_tokens >= 3)
        engine.pause_generation(mode="keep")
        engine.sleep()  # the kept request loses its K/V with the pool: recomputed after wake-up
        with pytest.raises(RuntimeError, match="wake_up"):
            engine.resume_generation()
        engine.wake_up()
        engine.resume_generation()
        out = engine.get_result("r", timeout=60)
    assert out.token_ids == reference.token_ids and out.logprobs == reference.logprobs
    assert out.weight_versions == [0] * 200


def test_update_weights_with_a_pause_mode_pauses_updates_and_resumes(tiny_llama_dir, new_weights):
    with _engine(tiny_llama_dir) as engine:
        engine.add_request(PROMPT, LONG, request_id="r")
        _wait_until(lambda: engine.stats().generated_tokens >= 2)
        with pytest.raises(RuntimeError, match="pause"):
            engine.update_weights(new_weights)  # running requests and no pause: refused, as before
        engine.update_weights(new_weights, pause_mode="keep")
        assert not engine.is_paused()
        out = engine.get_result("r", timeout=60)
        with pytest.raises(ValueError, match="pause mode"):
            engine.pause_generation(mode="later")
    assert out.finish_reason == "length" and out.weight_versions[0] == 0 and out.weight_versions[-1] == 1


def test_stream_chunks_carry_the_weight_version_and_the_final_result(tiny_llama_dir, new_weights):
    with _engine(tiny_llama_dir) as engine:
        rid = engine.add_request(PROMPT, LONG, stream=True)
        chunks = []
        for chunk in engine.stream(rid):
            chunks.append(chunk)
            if len(chunks) == 4:
                engine.update_weights(new_weights, pause_mode="keep")
    tokens = [c for c in chunks if c.token_id is not None]
    final = chunks[-1].output
    assert final is not None and final.token_ids == [c.token_id for c in tokens]
    assert [c.weight_version for c in tokens] == final.weight_versions
    assert final.weight_versions[0] == 0 and final.weight_versions[-1] == 1
