"""Memory under pressure: offload, soft reset, prefix caching, eviction, sliding windows, sizing."""

import logging
import random

import pytest
from engine_helpers import load_pair, random_prompts, reference_greedy, run_engine

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.cache.kv_cache import BlockPool, FullAttentionAllocator
from cbrun.models import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


def _vocab(model):
    return model.get_input_embeddings().weight.shape[0]


def _generate(model, tokenizer, prompts, config, max_tokens=16):
    with Engine(model, tokenizer, config) as engine:
        outputs = engine.generate_batch(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return outputs, engine.stats()


@pytest.fixture(scope="module")
def pressure_case(llama):
    model, tokenizer = llama
    rng = random.Random(11)
    prompts = random_prompts(_vocab(model), [rng.randint(8, 60) for _ in range(64)], seed=12)
    baseline, _ = _generate(model, tokenizer, prompts, EngineConfig(page_size=16, num_blocks=2000))
    return model, tokenizer, prompts, baseline


@pytest.mark.parametrize("offload_gib", [0.0, 0.00002])  # 0.00002 GiB: a 2-block swap pool
def test_tiny_cache_gives_identical_greedy_output(pressure_case, offload_gib):
    model, tokenizer, prompts, baseline = pressure_case
    config = EngineConfig(page_size=16, num_blocks=10, cpu_offload_space=offload_gib, max_batch_tokens=96)
    outputs, stats = _generate(model, tokenizer, prompts, config)
    for got, want in zip(outputs, baseline):
        assert got.error is None
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs  # bitwise: batch-invariant kernels
    assert stats.soft_resets > 0
    if offload_gib:
        assert stats.offloads > 0 and stats.restores > 0
    else:
        assert stats.offloads == 0
    assert stats.peak_blocks_used <= 10


@pytest.mark.parametrize("page", [20, 16])
def test_shared_system_prompt_is_computed_once(llama, page):
    """With the prefix on a page boundary (20 divides 300) the bound is exact; otherwise
    each request also recomputes the shared prefix's last, partial page."""
    model, tokenizer = llama
    vocab = _vocab(model)
    system = random_prompts(vocab, [300], seed=21)[0]
    suffixes = random_prompts(vocab, [random.Random(i).randint(5, 40) for i in range(64)], seed=22)
    prompts = [system + s for s in suffixes]
    config = EngineConfig(page_size=page, num_blocks=1200, max_batch_tokens=512)
    shared, stats = _generate(model, tokenizer, prompts, config, max_tokens=8)
    unshared, plain = _generate(
        model,
        tokenizer,
        prompts,
        EngineConfig(page_size=page, num_blocks=1200, max_batch_tokens=512, allow_block_sharing=False),
        max_tokens=8,
    )
    unique = sum(len(s) for s in suffixes)
    partial_page = len(system) % page
    assert stats.computed_prompt_tokens <= unique + len(system) + len(prompts) * (1 + partial_page)
    assert plain.computed_prompt_tokens == sum(len(p) for p in prompts)
    assert stats.prefix_hit_tokens > 0 and plain.prefix_hit_tokens == 0
    assert [o.token_ids for o in shared] == [o.token_ids for o in unshared]
    aligned = len(system) - partial_page
    assert sum(o.num_cached_tokens >= aligned for o in shared) >= 63  # all but the first hit the prefix


def test_evicted_prefix_is_recomputed_correctly(llama):
    model, tokenizer = llama
    vocab = _vocab(model)
    prefix_prompt = random_prompts(vocab, [200], seed=31)[0]
    fillers = random_prompts(vocab, [150] * 12, seed=32)
    config = EngineConfig(page_size=16, num_blocks=40, max_batch_tokens=256)
    expected = run_engine(model, tokenizer, [prefix_prompt], [10], EngineConfig(page_size=16, num_blocks=200))[0]
    with Engine(model, tokenizer, config) as engine:
        params = SamplingParams(max_tokens=10, temperature=0)
        first = engine.generate_batch([prefix_prompt], params)[0]
        engine.generate_batch(fillers, params)  # cycles the whole pool
        again = engine.generate_batch([prefix_prompt], params)[0]
        evictions = engine.core.cache.pool.evictions
    assert evictions > 0
    assert again.num_cached_tokens == 0, "the old prefix should have been evicted"
    assert first.token_ids == again.token_ids == expected.token_ids


def test_cached_prefix_survives_until_evicted_and_is_hit(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [100], seed=33)[0]
    with Engine(model, tokenizer, EngineConfig(page_size=16, num_blocks=100)) as engine:
        params = SamplingParams(max_tokens=5, temperature=0)
        first = engine.generate_batch([prompt], params)[0]
        assert engine.stats().blocks_cached > 0
        second = engine.generate_batch([prompt], params)[0]
    assert second.num_cached_tokens == 96  # six full pages, the last token recomputed
    assert second.token_ids == first.token_ids


def test_randomized_pool_operations_keep_reference_counts_sound():
    rng = random.Random(41)
    pool = BlockPool(64)
    allocator = FullAttentionAllocator(pool, page_size=4, share_prefixes=True)
    live: dict[int, list[int]] = {}
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(4)]
    for step in range(5000):
        if live and rng.random() < 0.4:
            key = rng.choice(list(live))
            allocator.free(key)
            del live[key]
        else:
            key = step
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 20))]
            hit = allocator.match_prefix(key, tokens)
            if allocator.allocate(key, len(tokens)):
                allocator.commit(key, tokens, len(tokens))
                live[key] = tokens
                assert hit % 4 == 0 and hit < len(tokens)
            else:
                allocator.free(key)
        pool.check_invariants()
        in_use = {b for key in live for b in allocator.table(key)}
        for block in in_use:
            assert pool.ref_count[block] > 0, "a block in use was freed"
        for key, tokens in live.items():
            assert len(allocator.table(key)) * 4 >= len(tokens)


def test_request_too_large_for_the_cache_fails_alone(llama):
    model, tokenizer = llama
    vocab = _vocab(model)
    small = random_prompts(vocab, [20, 30], seed=51)
    huge = random_prompts(vocab, [400], seed=52)[0]
    with Engine(model, tokenizer, EngineConfig(page_size=16, num_blocks=10)) as engine:
        params = SamplingParams(max_tokens=5, temperature=0)
        outputs = engine.generate_batch([small[0], huge, small[1]], params)
    assert outputs[1].finish_reason == "error" and "whole cache has 10" in outputs[1].error
    assert all(o.error is None and len(o.token_ids) == 5 for o in (outputs[0], outputs[2]))


def test_request_outgrowing_the_cache_fails_with_clear_error(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [40], seed=53)[0]
    with Engine(model, tokenizer, EngineConfig(page_size=16, num_blocks=4)) as engine:
        out = engine.generate_batch([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "error" and "whole cache has 4" in out.error


@pytest.mark.parametrize("fixture", ["tiny_mistral_sliding_dir", "tiny_gemma_hybrid_dir"])
def test_sliding_window_models_match_generate(request, fixture):
    spec = str(request.getfixturevalue(fixture))
    engine_model, ref_model, tokenizer = load_pair(spec)
    window = engine_model.config.sliding_window
    vocab = _vocab(ref_model)
    lengths = [window - 3, window + 5, 2 * window + 7, 3 * window + 1, 5]
    prompts = random_prompts(vocab, lengths, seed=61)
    max_tokens = [window + 4, 10, 3, window, 2 * window]
    refs = [reference_greedy(ref_model, p, m) for p, m in zip(prompts, max_tokens)]
    for page, budget in [(16, 24), (8, 4096)]:
        config = EngineConfig(page_size=page, max_batch_tokens=budget, num_blocks=400)
        results = run_engine(engine_model, tokenizer, prompts, max_tokens, config)
        assert [r.token_ids for r in results] == refs
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=50)) as engine:
        assert not engine.core.cache.sharing


def test_cache_is_sized_from_free_memory_when_not_given(llama, caplog):
    model, tokenizer = llama
    with (
        caplog.at_level(logging.INFO, logger="cbrun.engine"),
        Engine(model, tokenizer, EngineConfig(max_memory_percent=0.01)) as engine,
    ):
        blocks = engine.stats().blocks_total
        out = engine.generate_batch([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
    assert blocks > 16 and out.error is None
    assert any("cache sizing" in r.getMessage() for r in caplog.records)


def test_pool_reuses_cached_blocks_before_touching_new_memory():
    """Warm never-used blocks first, then the LRU cached block, and fresh memory only when nothing else is free."""
    pool = BlockPool(10)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.touched == 3
    for block in first:
        pool.register(block, bytes([block]), [block])
    pool.release(first[::-1])  # all three cached, LRU order 2, 1, 0
    assert pool.allocate(2) == [2, 1]  # evicts cached blocks instead of touching block 3
    assert pool.touched == 3 and pool.evictions == 2
    assert pool.allocate(2) == [0, 3]  # the last cached block, then new memory
    assert pool.touched == 4
    pool.release([3])  # unhashed: back on the never-used stack, warm now
    assert pool.allocate(1) == [3]


def test_prefaulted_blocks_count_as_warm(llama):
    model, tokenizer = llama
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64, prefault_blocks=20))
    try:
        assert engine.core.cache.pool.touched == 20
        outputs = engine.generate_batch([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
        assert outputs[0].ok
    finally:
        engine.destroy()
    with pytest.raises(Exception, match="prefault_blocks"):
        EngineConfig(prefault_blocks=-1)
