"""Sampling behaviour: seeds independent of the batch, top-k 1, stop conditions, n samples."""

import pytest
from engine_helpers import random_prompts, run_engine

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.sample.sampler import uniform_for
from cbrun.models import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


def _vocab(model):
    return model.get_input_embeddings().weight.shape[0]


def test_seeded_request_is_identical_alone_and_in_a_crowd(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [20 + 7 * i for i in range(32)], seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    with Engine(model, tokenizer, EngineConfig(max_batch_tokens=4096, num_blocks=256)) as engine:
        alone = engine.generate_batch([prompts[0]], params)[0]
    crowd_params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in range(31)]
    with Engine(model, tokenizer, EngineConfig(max_batch_tokens=37, page_size=16, num_blocks=512)) as engine:
        for i, p in enumerate(prompts[1:]):
            engine.add_request(p, crowd_params[i], request_id=f"other{i}")
        engine.add_request(prompts[0], params, request_id="target")
        crowd = engine.get_result("target", timeout=300)
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_different_seeds_give_different_samples(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [12], seed=2)[0]
    with Engine(model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        outs = engine.generate_batch([prompt], SamplingParams(max_tokens=16, seed=7, n=4, ignore_eos=True))
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_top_k_one_equals_greedy(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [5, 50, 120], seed=3)
    config = EngineConfig(num_blocks=128)
    greedy = run_engine(model, tokenizer, prompts, [20] * 3, config)
    top1 = run_engine(model, tokenizer, prompts, [20] * 3, config, temperature=1.3, top_k=1, seed=9)
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_max_tokens_and_ignore_eos_end_with_length(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [10, 30], seed=4)
    results = run_engine(model, tokenizer, prompts, [7, 13], EngineConfig(num_blocks=64), ignore_eos=True)
    assert [len(r.token_ids) for r in results] == [7, 13]
    assert all(r.finish_reason == "length" for r in results)


def test_eos_stops_unless_ignored(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [16], seed=6)[0]
    free_run = run_engine(model, tokenizer, [prompt], [12], EngineConfig(num_blocks=64), ignore_eos=True)[0]
    eos = free_run.token_ids[4]  # pretend the 5th greedy token is the end of sequence
    model.generation_config.eos_token_id = eos
    try:
        stopped = run_engine(model, tokenizer, [prompt], [12], EngineConfig(num_blocks=64))[0]
        ignored = run_engine(model, tokenizer, [prompt], [12], EngineConfig(num_blocks=64), ignore_eos=True)[0]
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    first = free_run.token_ids.index(eos)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"


def test_stop_token_ids_end_with_stop(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [16], seed=8)[0]
    free_run = run_engine(model, tokenizer, [prompt], [12], EngineConfig(num_blocks=64), ignore_eos=True)[0]
    stop_token = free_run.token_ids[3]
    result = run_engine(
        model, tokenizer, [prompt], [12], EngineConfig(num_blocks=64), ignore_eos=True, stop_token_ids=(stop_token,)
    )[0]
    first = free_run.token_ids.index(stop_token)
    assert result.token_ids == free_run.token_ids[: first + 1]
    assert result.finish_reason == "stop"


def test_stop_string_cuts_text_and_ends_with_stop(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [16], seed=10)[0]
    free_run = run_engine(model, tokenizer, [prompt], [24], EngineConfig(num_blocks=64), ignore_eos=True)[0]
    text = free_run.text
    assert len(text) > 6, "the tiny model should produce some text"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = run_engine(model, tokenizer, [prompt], [24], EngineConfig(num_blocks=64), ignore_eos=True, stop=(stop,))[0]
    assert result.finish_reason == "stop"
    assert result.text == text[: text.find(stop)]
    assert len(result.token_ids) < len(free_run.token_ids) or text.endswith(stop)


def test_uniform_stream_depends_only_on_seed_sample_and_position():
    assert uniform_for(1, 0, 5) == uniform_for(1, 0, 5)
    values = {uniform_for(1, s, p) for s in range(4) for p in range(50)}
    assert len(values) == 200
    assert all(0.0 <= v < 1.0 for v in values)
