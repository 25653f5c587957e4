"""The engine in int8 (EngineConfig(quantization="int8")): W8A8 linears, the head in the model's dtype.

A request's tokens and logprobs are the same bits alone and in a crowd (the
int8 sums are exact and the activation scales are per row), through chunked
prefill, prefix hits and preemption; the int8 path is really taken (the head
and embeddings excepted) and generates close to the model's own dtype; new
weights, sleep and a second engine give the same int8 weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import random_prompts, run_requests

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.base import BackendUnavailable
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear.int8 import Int8Linear
from cbrun.engine.config import ConfigError
from cbrun.models import load_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable (no C compiler)")
INT8 = {"quantization": "int8"}


@pytest.mark.parametrize("fixture,dtype", [("tiny_llama_dir", "float32"), ("tiny_qwen3_dir", "bfloat16")])
def test_an_int8_request_is_bitwise_identical_alone_and_in_a_crowd(request, fixture, dtype):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype=dtype)
    vocab = model.config.vocab_size
    target = random_prompts(vocab, [90], seed=11)[0]
    others = random_prompts(vocab, [5 + 13 * i % 120 for i in range(20)], seed=12)
    others[3] = target[:60] + others[3]  # shares the target's first pages
    sampling = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=2)
    crowd = [(f"c{i}", p, SamplingParams(max_tokens=10 + i % 7, temperature=0.8, seed=i)) for i, p in enumerate(others)]
    requests = crowd[:8] + [("t", target, sampling)] + crowd[8:]
    alone = run_requests(
        model, tokenizer, [("t", target, sampling)], EngineConfig(max_batch_tokens=512, num_blocks=64, **INT8)
    )
    for config, preempts in [
        (EngineConfig(max_batch_tokens=64, num_blocks=256, **INT8), None),  # chunked prefill, crowded steps
        (EngineConfig(max_batch_tokens=37, max_requests_per_batch=5, num_blocks=256, **INT8), None),
        (EngineConfig(max_batch_tokens=96, num_blocks=12, cpu_offload_space=0, **INT8), "soft_resets"),
    ]:
        assert run_requests(model, tokenizer, requests, config, preempts)["t"] == alone["t"], config


def test_int8_runs_every_linear_but_the_head_and_generates_near_the_model_dtype(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="bfloat16")
    prompts = random_prompts(model.config.vocab_size, [12, 30, 7], seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    requests = [(f"p{i}", p, greedy) for i, p in enumerate(prompts)]
    dense = run_requests(model, tokenizer, requests, EngineConfig(num_blocks=64))
    with Engine(model, tokenizer, EngineConfig(num_blocks=64, **INT8)) as engine:
        backend = engine.core.backend
        int8 = {m for m, layer in backend.linears.items() if isinstance(getattr(layer, "method", layer), Int8Linear)}
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        assert set(linears) - int8 == {head}  # the head alone keeps the model's dtype
        assert "int8 W8A8" in engine.linear_kernels() and backend.fused_layers
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
        for request_id, prompt, sampling in requests:
            engine.add_request(prompt, sampling, request_id=request_id)
        quantized = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in requests)}
    for request_id, ((tokens, logprobs),) in dense.items():
        got = quantized[request_id]
        assert len(got.token_ids) == 12 and got.finish_reason == "length"
        first = got.logprobs[0]
        assert got.token_ids[0] == tokens[0] and abs(first - logprobs[0]) < 0.05  # a random tiny model: small logits
    assert any(quantized[i].logprobs != dense[i][0][1] for i in dense)  # int8 is not the dense arithmetic


def test_int8_weights_survive_sleep_a_second_engine_and_new_weights(tiny_qwen3_dir):
    model, tokenizer = load_model(str(tiny_qwen3_dir), dtype="bfloat16")
    original = copy.deepcopy(model.state_dict())
    prompt = random_prompts(model.config.vocab_size, [20], seed=5)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = run_requests(model, tokenizer, [("a", prompt, greedy)], EngineConfig(num_blocks=32, **INT8))
    again = run_requests(model, tokenizer, [("a", prompt, greedy)], EngineConfig(num_blocks=32, **INT8))
    assert again == first  # the model came back carrying its int8 form
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, **INT8)) as engine:
        engine.sleep(level=2)
        engine.wake_up()
        engine.add_request(prompt, greedy, request_id="a")
        woken = engine.get_result(timeout=600)
        assert (list(woken.token_ids), list(woken.logprobs)) == first["a"][0]
        engine.update_weights({name: value * 1.5 for name, value in original.items() if "mlp" in name})
        engine.add_request(prompt, greedy, request_id="b")
        changed = engine.get_result(timeout=600)
        engine.update_weights({name: value for name, value in original.items() if "mlp" in name})
        engine.add_request(prompt, greedy, request_id="c")
        back = engine.get_result(timeout=600)
    assert list(changed.logprobs) != first["a"][0][1]
    assert (list(back.token_ids), list(back.logprobs)) == first["a"][0]  # the same weights: the same int8 form


def test_int8_is_refused_where_it_cannot_run(tiny_llama_dir):
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="fp8")  # type: ignore[arg-type]
    model, tokenizer = load_model(str(tiny_llama_dir))
    with pytest.raises(BackendUnavailable, match="CPU kernels only"):
        Engine(model, tokenizer, EngineConfig(num_blocks=16, backend="torch", **INT8))
