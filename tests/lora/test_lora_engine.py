"""LoRA in the engine: adapters applied row by row, several in one step, each request as it runs alone.

The adapter's work (scaling * B(A(x)) on the rows that run it, fp32, through
the compiled fp32 linear) is checked four ways: bitwise against the same
request alone, whatever other adapters and base rows share its steps, through
the fused decoder layers (Llama) and through forward hooks (Gemma's layers,
which are not fused); bitwise against merged weights at the layer, where the
merge is exact; within tolerance of merged weights for the whole model
(fp32, bf16); bitwise equal to the base model with a zero B (PEFT's initial
adapter). The prefix cache keeps adapters apart.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts
from lora_helpers import merged_weights, random_pairs, save, state_dict

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.lora.adapters import AdapterLinear, LoRAAdapters
from cbrun.lora.peft_files import AdapterError
from cbrun.models import load_model

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")
DTYPES = ["float32", "bfloat16"]
CONFIG = {"lora_alpha": 16}


def _engine(model_dir, dtype="float32", **config):
    model, tokenizer = load_model(str(model_dir), dtype=dtype)
    engine = Engine(model, tokenizer, EngineConfig(enable_lora=True, num_blocks=256, **config))
    return engine, model


def _run(engine, items, params):
    """items: (prompt ids, adapter name or None); results in order."""
    ids = engine.add_requests([p for p, _ in items], params, loras=[lora for _, lora in items])
    found = {}
    for _ in ids:
        out = engine.get_result(timeout=300)
        found[out.request_id] = out
    return [found[i] for i in ids]


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.error is None and b.error is None


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_gemma_hybrid_dir"])
def test_each_request_of_a_multi_adapter_batch_is_bitwise_as_alone(request, model_fixture, dtype):
    engine, model = _engine(request.getfixturevalue(model_fixture), dtype)
    with engine:
        for seed, name in enumerate(("a", "b", "c"), start=1):
            engine.loras.add(name, state_dict(random_pairs(model, seed)), config=CONFIG)
        prompts = random_prompts(engine.vocab_size, [9, 23, 40, 5, 31, 17], seed=3)
        items = list(zip(prompts, ["a", "b", None, "a", "c", "b"]))
        for params in (
            SamplingParams(max_tokens=10, temperature=0.0, top_logprobs=2),
            SamplingParams(max_tokens=10, temperature=1.0, seed=7, top_logprobs=2),
        ):
            together = _run(engine, items, params)
            for item, crowd in zip(items, together):
                [alone] = _run(engine, [item], params)
                assert _same(crowd, alone), (item[1], crowd.token_ids, alone.token_ids)
                assert crowd.lora == item[1]
            adapted, base = together[0], _run(engine, [(items[0][0], None)], params)[0]
            assert adapted.logprobs != base.logprobs  # the adapter changes what the model computes


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_adapter_with_zero_b_gives_the_base_models_bits(tiny_llama_dir, dtype):
    engine, model = _engine(tiny_llama_dir, dtype)
    with engine:
        engine.loras.add("zero", state_dict(random_pairs(model, 1, zero_b=True)), config=CONFIG)
        prompts = random_prompts(engine.vocab_size, [12, 30], seed=5)
        params = SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=1)
        adapted = _run(engine, [(p, "zero") for p in prompts], params)
        base = _run(engine, [(p, None) for p in prompts], params)
        assert all(_same(a, b) for a, b in zip(adapted, base))


@needs_kernels
def test_the_adapted_layer_equals_merged_weights_bitwise_where_the_merge_is_exact():
    """Small integers scaled by powers of two: every product and sum is exact in fp32, in any order."""
    gen = torch.Generator().manual_seed(0)

    def dyadic(*shape, low=-4, high=5, scale=0.25):
        return torch.randint(low, high, shape, generator=gen).float() * scale

    x, weight = dyadic(37, 64), dyadic(48, 64)
    a, b = dyadic(8, 64), dyadic(48, 8)
    scaling = 2.0  # lora_alpha 16 / r 8
    scaled = scaling * b
    bt = scaled.t().contiguous()
    adapted = AdapterLinear(a, scaled, lambda v: kernels.linear(v, a), lambda v: kernels.linear(v, scaled), bt)
    merged = weight + scaling * (b @ a)
    got = kernels.linear(x, weight) + adapted.delta(x)
    assert torch.equal(got, kernels.linear(x, merged))
    assert not torch.equal(got, kernels.linear(x, weight))
    grouped = kernels.linear(x, weight)  # the grouped call (lora.c) on every row, in place
    kernels.lora.apply(x, [(torch.arange(len(x)), [(a, bt)])], [grouped])
    assert torch.equal(grouped, kernels.linear(x, merged))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_adapted_request_matches_the_model_with_the_adapter_merged(tiny_llama_dir, dtype):
    """The reference merges in fp32 (bf16 weights cannot hold a small B @ A: rounding them moves the logprobs by
    about as much as the adapter does); a bf16 run is then as close to it as the bf16 base is to the fp32 base."""
    engine, model = _engine(tiny_llama_dir, dtype)
    pairs = random_pairs(model, 4)
    prompts = random_prompts(engine.vocab_size, [14, 33], seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with engine:
        engine.loras.add("x", state_dict(pairs), config=CONFIG)
        adapted = _run(engine, [(p, "x") for p in prompts], params)
    reference, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    with Engine(reference, tokenizer, EngineConfig(num_blocks=256)) as plain:
        plain.update_weights(merged_weights(reference, pairs))
        scored = plain.score_batch(prompts, [[out.token_ids] for out in adapted])
    tolerance = 1e-4 if dtype == "float32" else 0.02
    for out, ref in zip(adapted, scored):
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref.logprobs)) < tolerance
        if dtype == "float32":
            assert ref.is_greedy  # the merged model picks the same tokens


@needs_kernels
def test_score_runs_the_adapter_and_gives_generates_logprobs_bitwise(tiny_llama_dir):
    engine, model = _engine(tiny_llama_dir)
    with engine:
        engine.loras.add("x", state_dict(random_pairs(model, 2)), config=CONFIG)
        [prompt] = random_prompts(engine.vocab_size, [20], seed=1)
        [out] = _run(engine, [(prompt, "x")], SamplingParams(max_tokens=10, temperature=1.0, seed=3))
        rid = engine.add_score_request(prompt, [out.token_ids], lora="x")
        scored = engine.get_result(rid, timeout=300)
        assert scored.logprobs == out.logprobs and scored.lora == "x"
        rid = engine.add_score_request(prompt, [out.token_ids])
        assert engine.get_result(rid, timeout=300).logprobs != out.logprobs


@needs_kernels
def test_the_prefix_cache_keeps_adapters_apart(tiny_llama_dir):
    engine, model = _engine(tiny_llama_dir)
    with engine:
        engine.loras.add("x", state_dict(random_pairs(model, 2)), config=CONFIG)
        [prompt] = random_prompts(engine.vocab_size, [70], seed=2)
        params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=1)
        [base] = _run(engine, [(prompt, None)], params)
        [first] = _run(engine, [(prompt, "x")], params)
        [again] = _run(engine, [(prompt, "x")], params)
        assert first.num_cached_tokens == 0  # the base model's pages are not the adapter's
        assert again.num_cached_tokens > 0 and _same(first, again)
        assert not _same(first, base)
    fresh, _ = _engine(tiny_llama_dir)
    with fresh:
        fresh.loras.add("x", state_dict(random_pairs(model, 2)), config=CONFIG)
        assert _same(_run(fresh, [(prompt, "x")], params)[0], first)


@needs_kernels
def test_update_lora_replaces_an_adapter_in_place_and_its_cached_prefixes_stop_matching(tiny_llama_dir, tmp_path):
    engine, model = _engine(tiny_llama_dir)
    old, new = random_pairs(model, 5), random_pairs(model, 6)
    [prompt] = random_prompts(engine.vocab_size, [50], seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=1)
    with engine:
        engine.loras.add("x", save(tmp_path / "old", old))
        _run(engine, [(prompt, "x")], params)
        engine.loras.update("x", state_dict(new))
        [updated] = _run(engine, [(prompt, "x")], params)
        assert updated.num_cached_tokens == 0  # pages of the old adapter never match again
        assert engine.loras.list() == {"x": 1}
    fresh, _ = _engine(tiny_llama_dir)
    with fresh:
        fresh.loras.add("x", save(tmp_path / "new", new))
        assert _same(_run(fresh, [(prompt, "x")], params)[0], updated)


@needs_kernels
def test_bad_adapters_and_requests_are_refused_with_the_reason(tiny_llama_dir, tmp_path):
    engine, model = _engine(tiny_llama_dir, max_lora_rank=8)
    with engine:
        with pytest.raises(AdapterError, match="rank 16, over max_lora_rank 8"):
            engine.loras.add("big", state_dict(random_pairs(model, 1, rank=16)), config=CONFIG)
        with pytest.raises(AdapterError, match="output head"):
            engine.loras.add("head", state_dict(random_pairs(model, 1, targets=("lm_head",))), config=CONFIG)
        with pytest.raises(AdapterError, match="only linear layers"):
            pairs = {"model.norm": (torch.zeros(2, 4), torch.zeros(4, 2))}
            engine.loras.add("norm", state_dict(pairs), config=CONFIG)
        with pytest.raises(AdapterError, match="no module"):
            engine.loras.add(
                "ghost", state_dict({"model.nowhere": (torch.zeros(2, 4), torch.zeros(4, 2))}), config=CONFIG
            )
        with pytest.raises(AdapterError, match="need config"):
            engine.loras.add("x", state_dict(random_pairs(model, 1)))
        with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
            engine.loras.add("x", tmp_path)
        wrong = {"model.layers.0.self_attn.q_proj": (torch.zeros(8, 3), torch.zeros(5, 8))}
        with pytest.raises(AdapterError, match=r"is \[.*\] but the adapter has"):
            engine.loras.add("x", state_dict(wrong), config=CONFIG)
        with pytest.raises(AdapterError, match="DoRA"):
            engine.loras.add("x", state_dict(random_pairs(model, 1)), config={**CONFIG, "use_dora": True})
        with pytest.raises(AdapterError, match="not a LoRA A or B weight"):
            engine.loras.add("x", {"base_model.model.model.norm.weight": torch.zeros(4)}, config=CONFIG)
        assert engine.loras.list() == {}
        [out] = _run(engine, [([5, 6, 7], "missing")], SamplingParams(max_tokens=2))
        assert out.finish_reason == "error" and "unknown LoRA adapter 'missing'" in out.error
    plain_model, tokenizer = load_model(str(tiny_llama_dir))
    with Engine(plain_model, tokenizer, EngineConfig(num_blocks=64)) as plain:
        [out] = _run(plain, [([5, 6, 7], "x")], SamplingParams(max_tokens=2))
        assert "LoRA is not enabled" in out.error
        with pytest.raises(AdapterError, match="not enabled"):
            plain.loras.add("x", state_dict(random_pairs(plain_model, 1)), config=CONFIG)


@needs_kernels
def test_an_adapter_in_use_is_not_replaced_or_removed(tiny_llama_dir):
    engine, model = _engine(tiny_llama_dir)
    with engine:
        engine.loras.add("x", state_dict(random_pairs(model, 1)), config=CONFIG)
        engine.pause_generation("keep")
        rid = engine.add_request([4, 5, 6], SamplingParams(max_tokens=4), lora="x")
        engine.resume_generation()
        engine.get_result(rid, timeout=300)
        assert engine.loras.remove("x") and engine.loras.list() == {}
        assert not engine.loras.remove("x")


def test_lora_adapters_take_hooks_off_the_model_when_closed(tiny_llama_dir):
    model, _ = load_model(str(tiny_llama_dir))
    adapters = LoRAAdapters(model, max_rank=8)
    from cbrun.lora.peft_files import AdapterConfig, AdapterWeights

    adapters.load("x", AdapterWeights(AdapterConfig(16.0), random_pairs(model, 1)))
    hooked = [m for m in model.modules() if m._forward_hooks]
    assert len(hooked) == 14  # 7 linears in each of 2 layers
    adapters.close()
    assert not any(m._forward_hooks for m in model.modules())


@needs_kernels
def test_adapters_survive_sleep_and_wake_and_run_over_int8_weights(tiny_llama_dir):
    prompts = random_prompts(512, [18, 7], seed=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=1)
    engine, model = _engine(tiny_llama_dir)
    with engine:
        engine.loras.add("x", state_dict(random_pairs(model, 2)), config=CONFIG)
        before = _run(engine, [(prompts[0], "x"), (prompts[1], None)], params)
        engine.sleep(level=2)
        engine.wake_up()
        after = _run(engine, [(prompts[0], "x"), (prompts[1], None)], params)
        assert all(_same(a, b) for a, b in zip(before, after))
    engine, model = _engine(tiny_llama_dir, "bfloat16", quantization="int8")
    with engine:
        engine.loras.add("x", state_dict(random_pairs(model, 2)), config=CONFIG)
        engine.loras.add("y", state_dict(random_pairs(model, 3)), config=CONFIG)
        items = [(prompts[0], "x"), (prompts[1], "y"), (prompts[0], None)]
        together = _run(engine, items, params)
        assert all(_same(crowd, _run(engine, [item], params)[0]) for item, crowd in zip(items, together))
        assert together[0].logprobs != together[2].logprobs
