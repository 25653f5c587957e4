"""Scheduler and allocator invariants under randomized workloads (no model, no torch)."""

import random

import pytest

from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.cache.offload import SoftResetPreemptor
from cbrun.engine.config import EngineConfig
from cbrun.engine.request import Request
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.scheduler import Scheduler


def _make(config: EngineConfig, num_blocks: int, sliding_window=None, has_full=True):
    cache = KVCacheManager(
        num_blocks,
        config.page_size,
        sliding_window=sliding_window,
        has_full_layers=has_full,
        allow_block_sharing=config.allow_block_sharing,
    )
    preemptor = SoftResetPreemptor(cache)
    return cache, preemptor, Scheduler(config, cache, preemptor)


def _simulate(
    scheduler: Scheduler, cache: KVCacheManager, config: EngineConfig, rng: random.Random, steps: int, vocab: int = 7
) -> dict:
    """Drive the scheduler like the engine does, checking invariants after every step."""
    arrivals = 0
    live: list[Request] = []
    seen = {"finished": 0, "preempted": 0, "failed": 0, "chunked": 0}
    for _ in range(steps):
        for _ in range(rng.randint(0, 3)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 150))]
            request = Request(
                f"r{arrivals}", 0, prompt, SamplingParams(max_tokens=rng.randint(1, 40)), seed=0, arrival_order=arrivals
            )
            arrivals += 1
            scheduler.add(request)
            live.append(request)
        batch = scheduler.schedule()
        assert batch.num_tokens <= config.max_batch_tokens
        assert len(batch.items) <= config.max_requests_per_batch
        assert len({id(r) for r, _ in batch.items}) == len(batch.items), "request scheduled twice"
        seen["failed"] += len(batch.failed)
        for request, _ in batch.failed:
            live.remove(request)
        for request, count in batch.items:
            assert count >= 1
            assert request.num_computed_tokens + count <= request.num_tokens
            capacity = sum(len(t) for t in cache.blocks_of(request.key).values())
            assert capacity > 0
            if count > 1 and count < request.num_uncomputed:
                seen["chunked"] += 1
        for request, count in batch.items:
            request.num_computed_tokens += count
            cache.commit(request.key, request.all_token_ids, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.all_token_ids.append(rng.randrange(vocab))
                request.mark_running()
                if request.num_generated >= request.sampling.max_tokens or rng.random() < 0.03:
                    scheduler.remove(request)
                    live.remove(request)
                    seen["finished"] += 1
        if live and rng.random() < 0.05:  # cancellation
            victim = rng.choice(live)
            scheduler.remove(victim)
            live.remove(victim)
        scheduler.check_invariants()
        seen["preempted"] = scheduler.preemptor.counters.soft_resets
    return seen


@pytest.mark.parametrize("ordering", ["fifo", "prefill-first"])
@pytest.mark.parametrize("sharing", [True, False])
def test_randomized_workload_keeps_allocator_and_budget_invariants(ordering, sharing):
    rng = random.Random(f"{ordering}-{sharing}")
    config = EngineConfig(
        page_size=16,
        max_batch_tokens=64,
        max_requests_per_batch=8,
        scheduler=ordering,
        allow_block_sharing=sharing,
        num_blocks=40,
    )
    cache, _, scheduler = _make(config, 40)
    seen = _simulate(scheduler, cache, config, rng, steps=1500)
    assert seen["finished"] > 50
    assert seen["preempted"] > 0, "the workload should have forced preemption"
    assert seen["chunked"] > 0, "the workload should have forced chunked prefill"


def test_sliding_window_allocator_keeps_invariants_and_bounded_tables():
    rng = random.Random(3)
    config = EngineConfig(page_size=8, max_batch_tokens=48, max_requests_per_batch=6, num_blocks=60)
    cache, _, scheduler = _make(config, 60, sliding_window=20, has_full=False)
    _simulate(scheduler, cache, config, rng, steps=800)
    for table in cache.allocators["sliding"].tables.values():
        assert len(table) <= 20 // 8 + 2 + 48 // 8


def test_prefill_first_finishes_prefills_before_decodes():
    config = EngineConfig(
        page_size=16, max_batch_tokens=40, max_requests_per_batch=8, scheduler="prefill-first", num_blocks=64
    )
    _cache, _, scheduler = _make(config, 64)
    decoding = Request("d", 0, [1, 2, 3], SamplingParams(), 0, 0)
    scheduler.add(decoding)
    batch = scheduler.schedule()
    decoding.num_computed_tokens = 3
    decoding.all_token_ids.append(4)
    long = Request("p", 0, list(range(100)), SamplingParams(), 0, 1)
    scheduler.add(long)
    first = scheduler.schedule()
    long.num_computed_tokens += {r.request_id: n for r, n in first.items}["p"]
    decoding.num_computed_tokens += 1
    decoding.all_token_ids.append(5)
    second = scheduler.schedule()
    order = [r.request_id for r, _ in sorted(second.items, key=lambda i: -i[1])]
    counts = {r.request_id: n for r, n in second.items}
    # the in-progress prefill is served first and takes the budget it needs
    assert counts["p"] == min(40, 100 - long.num_computed_tokens)
    assert order[0] == "p"
    assert batch.items


def test_fifo_serves_decodes_before_prefill_chunks():
    config = EngineConfig(page_size=16, max_batch_tokens=8, max_requests_per_batch=8, num_blocks=64)
    _cache, _, scheduler = _make(config, 64)
    running = Request("d", 0, [1], SamplingParams(), 0, 0)
    scheduler.add(running)
    scheduler.schedule()
    running.num_computed_tokens = 1
    running.all_token_ids.append(2)
    scheduler.add(Request("p", 0, list(range(50)), SamplingParams(), 0, 1))
    batch = scheduler.schedule()
    assert [(r.request_id, n) for r, n in batch.items] == [("d", 1), ("p", 7)]


def test_request_larger_than_whole_cache_fails_alone():
    config = EngineConfig(page_size=16, max_batch_tokens=512, num_blocks=4)
    cache, _, scheduler = _make(config, 4)
    huge = Request("big", 0, list(range(100)), SamplingParams(), 0, 0)
    scheduler.add(huge)
    batch = scheduler.schedule()
    assert [r.request_id for r, _ in batch.failed] == ["big"]
    assert "whole cache has 4" in batch.failed[0][1]
    assert cache.pool.num_free == 4
