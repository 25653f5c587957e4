"""The Python API: cancel, hard stop, drain, streaming, failing requests, stats."""

import threading
import time

import pytest
from engine_helpers import random_prompts, run_engine

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


def _vocab(model):
    return model.get_input_embeddings().weight.shape[0]


LONG = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)


def _wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_cancel_frees_blocks_at_once(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [100], seed=1)[0]
    with Engine(model, tokenizer, EngineConfig(page_size=16, num_blocks=200)) as engine:
        engine.add_request(prompt, LONG, request_id="victim")
        _wait_until(lambda: engine.stats().blocks_used >= 8)
        assert engine.cancel_request("victim")
        assert engine.stats().blocks_used == 0
        result = engine.get_result("victim", timeout=10)
    assert result.finish_reason == "cancelled"
    assert not engine.cancel_request("unknown")


def test_hard_stop_fails_queued_and_active_requests(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [40] * 6, seed=2)
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=200, max_requests_per_batch=2))
    ids = [engine.add_request(p, LONG) for p in prompts]
    _wait_until(lambda: engine.stats().generated_tokens > 0)
    engine.stop(hard=True)
    results = [engine.get_result(i, timeout=10) for i in ids]
    assert all(r.finish_reason == "error" and "engine stopped" in r.error for r in results)
    with pytest.raises(RuntimeError):
        engine.add_request(prompts[0])
    engine.destroy()


def test_drain_stop_finishes_everything(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [30] * 5, seed=3)
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=200))
    ids = engine.add_requests(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.stop()
    results = [engine.get_result(i, timeout=10) for i in ids]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in results)
    engine.destroy()


def test_stream_yields_each_token_once_in_order(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [20], seed=4)[0]
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    with Engine(model, tokenizer, EngineConfig(num_blocks=100)) as engine:
        engine.add_request(random_prompts(_vocab(model), [50], seed=9)[0], params)  # company
        rid = engine.add_request(prompt, params, stream=True)
        chunks = list(engine.stream(rid))
        reference = engine.generate_batch([prompt], params)[0]
    tokens = [c.token_id for c in chunks if c.token_id is not None]
    assert tokens == reference.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].token_id is None
    assert "".join(c.text for c in chunks) == reference.text
    assert [c.logprob for c in chunks[:-1]] == pytest.approx(reference.logprobs, abs=1e-5)


def test_failing_requests_leave_the_others_unchanged(llama):
    model, tokenizer = llama
    vocab = _vocab(model)
    good = random_prompts(vocab, [10, 60, 25], seed=5)
    config = EngineConfig(num_blocks=128)
    alone = run_engine(model, tokenizer, good, [12] * 3, config)
    bad = {
        "empty": ([], {}),
        "vocab": ([1, 2, vocab + 5], {}),
        "context": ([1] * 10, {"max_tokens": engine_context(model) + 1}),
        "sampling": ([1, 2, 3], {"top_p": 0.0}),
    }
    with Engine(model, tokenizer, config) as engine:
        for name, (prompt, extra) in bad.items():
            engine.add_request(prompt, {"max_tokens": 5, **extra}, request_id=name)
        for i, p in enumerate(good):
            engine.add_request(p, SamplingParams(max_tokens=12, temperature=0), request_id=f"g{i}")
        failed = {name: engine.get_result(name, timeout=60) for name in bad}
        mixed = [engine.get_result(f"g{i}", timeout=60) for i in range(3)]
    assert "empty prompt" in failed["empty"].error
    assert "outside the vocabulary" in failed["vocab"].error
    assert "context" in failed["context"].error
    assert "top_p" in failed["sampling"].error
    assert all(f.finish_reason == "error" for f in failed.values())
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]


def engine_context(model):
    return model.config.max_position_embeddings


def test_duplicate_active_id_fails_the_newcomer(llama):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [20], seed=6)[0]
    with Engine(model, tokenizer, EngineConfig(num_blocks=100)) as engine:
        engine.add_request(prompt, LONG, request_id="same")
        engine.add_request(prompt, LONG, request_id="same")
        first = engine.get_result("same", timeout=30)
        assert first.finish_reason == "error" and "duplicate" in first.error
        engine.cancel_request("same")


def test_iteration_and_stats(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [8, 16, 32, 64], seed=7)
    with Engine(model, tokenizer, EngineConfig(page_size=16, num_blocks=100)) as engine:
        engine.add_requests(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2))
        outputs = list(engine)
        stats = engine.stats()
    assert len(outputs) == 8
    assert stats.steps > 0 and stats.generated_tokens == 32 and stats.finished == 8
    assert stats.blocks_used + stats.blocks_free + stats.blocks_cached == stats.blocks_total
    assert stats.output_tokens_per_s > 0


def test_every_way_a_request_ends_sets_its_finish_time_and_counts_it(llama, monkeypatch):
    """Length, stop, refused at submission, a failed forward, a failed step, cancel and hard stop: each
    result has a finish time, and the stats count each end once, by how it ended."""
    model, tokenizer = llama
    vocab = _vocab(model)
    prompt = random_prompts(vocab, [12], seed=11)[0]
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ends = {}
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=100))
    try:
        ends["length"] = ("length", engine.generate_batch([prompt], greedy)[0])
        first = ends["length"][1].token_ids[0]
        stop = SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[first])
        ends["stop"] = ("stop", engine.generate_batch([prompt], stop)[0])
        ends["refused"] = ("error", engine.generate_batch([[1, 2, vocab + 5]], greedy)[0])
        with monkeypatch.context() as patch:
            patch.setattr(engine.core.runner, "forward", lambda batch: 1 / 0)
            ends["forward"] = ("error", engine.generate_batch([prompt], greedy)[0])
        with monkeypatch.context() as patch:
            patch.setattr(engine.core.scheduler, "schedule", lambda: 1 / 0)
            ends["step"] = ("error", engine.generate_batch([prompt], greedy)[0])
        engine.add_request(prompt, LONG, request_id="cancelled")
        _wait_until(lambda: engine.stats().decoding == 1)
        assert engine.cancel_request("cancelled")
        ends["cancel"] = ("cancelled", engine.get_result("cancelled", timeout=10))
        engine.add_request(prompt, LONG, request_id="stopped")
        _wait_until(lambda: engine.stats().decoding == 1)
        engine.stop(hard=True)
        ends["hard stop"] = ("error", engine.get_result("stopped", timeout=10))
        stats = engine.stats()
    finally:
        engine.destroy()
    for path, (reason, out) in ends.items():
        assert out.finish_reason == reason, (path, out.finish_reason, out.error)
        assert out.finish_time is not None and out.finish_time >= out.arrival_time, path
    assert "forward failed" in ends["forward"][1].error and "engine step failed" in ends["step"][1].error
    assert (stats.finished, stats.failed, stats.cancelled) == (2, 4, 1)


def test_add_requests_from_threads(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [12] * 8, seed=8)
    with Engine(model, tokenizer, EngineConfig(num_blocks=100)) as engine:
        threads = [
            threading.Thread(target=engine.add_request, args=(p, {"max_tokens": 3}, f"t{i}"))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = sorted(engine.get_result(timeout=30).request_id for _ in prompts)
    assert got == sorted(f"t{i}" for i in range(8))


def test_add_requests_takes_one_sampling_per_prompt(llama):
    model, tokenizer = llama
    prompts = random_prompts(_vocab(model), [8, 16, 24], seed=9)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 5, 9)]
    with Engine(model, tokenizer, EngineConfig(num_blocks=100)) as engine:
        ids = engine.add_requests(prompts, params, request_ids=["a", "b", "c"])
        lengths = {rid: len(engine.get_result(rid, timeout=30).token_ids) for rid in ids}
    assert lengths == {"a": 2, "b": 5, "c": 9}


def test_a_failing_step_fails_live_requests_and_the_engine_goes_on(llama, monkeypatch):
    model, tokenizer = llama
    prompt = random_prompts(_vocab(model), [10], seed=10)[0]
    with Engine(model, tokenizer, EngineConfig(num_blocks=100)) as engine:
        original = engine.core.scheduler.schedule
        calls = {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("scheduler exploded")
            return original()

        monkeypatch.setattr(engine.core.scheduler, "schedule", flaky)
        broken = engine.generate_batch([prompt], SamplingParams(max_tokens=3))[0]
        fine = engine.generate_batch([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert broken.finish_reason == "error" and "scheduler exploded" in broken.error
    assert fine.error is None and len(fine.token_ids) == 3


def test_engine_start_releases_the_callers_openmp_pool(llama, monkeypatch):
    """The loop thread's OpenMP pool must be the only one (engine/backends/openmp.py): Engine frees the caller's."""
    from cbrun.engine.backends import openmp

    callers = []
    monkeypatch.setattr(openmp, "release_caller_threads", lambda: callers.append(threading.get_ident()))
    model, tokenizer = llama
    with Engine(model, tokenizer, EngineConfig(num_blocks=64)):
        pass
    assert callers == [threading.get_ident()]


def test_release_caller_threads_ends_this_threads_openmp_workers():
    import os

    import torch

    from cbrun.engine.backends.openmp import release_caller_threads

    if not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2:
        pytest.skip("needs Linux and at least two OpenMP threads")
    x = torch.randn(1 << 22)
    x + x  # a parallel region: this thread now owns a pool of workers
    before = len(os.listdir("/proc/self/task"))
    assert release_caller_threads()
    _wait_until(lambda: len(os.listdir("/proc/self/task")) < before, timeout=5)
