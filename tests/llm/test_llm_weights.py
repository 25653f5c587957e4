"""Weights updated in place and memory given back between rollouts (issue 27), on the tiny Llama in fp32.

Every comparison is bitwise: token ids and logprob floats with `==`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cbrun import LLM, SamplingParams
from cbrun.engine import Engine, EngineConfig
from cbrun.models import load_model

PROMPTS = [{"prompt_token_ids": [1] + list(range(40, 40 + n))} for n in (40, 21, 7)]  # 40 > two 16-token pages
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
SAMPLED = SamplingParams(n=3, temperature=1.0, max_tokens=8, logprobs=0, seed=11)


def run(llm: LLM) -> list:
    """(token ids, logprob floats) of every completion of a greedy and a seeded sampled pass."""
    results = []
    for params in (GREEDY, SAMPLED):
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in out.outputs:
                results.append((c.token_ids, [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]))
    return results


def perturbed(model_dir: Path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tiny model's weights, moved a little (as a training step would), in `dtype`."""
    model, _ = load_model(str(model_dir), dtype="float32")
    generator = torch.Generator().manual_seed(3)
    return {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator)).to(dtype) for name, t in model.state_dict().items()
    }


def saved_copy(model_dir: Path, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """A model directory like `model_dir` holding `weights` converted to fp32 (what a fresh engine loads)."""
    folder.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            os.symlink(item, folder / item.name)
    save_file({name: t.float().contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    return folder


def make_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", seed=0, num_gpu_blocks_override=64, **options)


@pytest.fixture(scope="module")
def new_weights(tiny_llama_dir):
    return perturbed(tiny_llama_dir)


@pytest.fixture(scope="module")
def updated_dir(tiny_llama_dir, new_weights, tmp_path_factory):
    return saved_copy(tiny_llama_dir, new_weights, tmp_path_factory.mktemp("updated") / "model")


@pytest.fixture(scope="module")
def fresh_after_update(updated_dir):
    """What a fresh engine loaded with the new weights gives."""
    with make_llm(updated_dir) as fresh:
        return run(fresh)


def test_update_weights_changes_outputs_and_equals_a_fresh_engine_bitwise(
    tiny_llama_dir, new_weights, fresh_after_update
):
    with make_llm(tiny_llama_dir) as llm:
        before = run(llm)
        assert llm.update_weights(new_weights) == len(new_weights)  # bf16 in, converted to the model's fp32
        after = run(llm)
    assert after != before
    assert after == fresh_after_update


def test_a_prefix_cached_before_an_update_is_never_hit_after_it(
    tiny_llama_dir, new_weights, updated_dir, fresh_after_update
):
    with make_llm(updated_dir) as fresh:  # the prompts share a page: one pass hits it once, computed in the pass
        fresh.generate(PROMPTS, GREEDY, use_tqdm=False)
        own_hits = fresh.engine.stats().prefix_hit_tokens
    with make_llm(tiny_llama_dir) as llm:
        run(llm)
        run(llm)  # the prompts' pages are cached now
        hits = llm.engine.stats().prefix_hit_tokens
        assert hits > 0 and llm.engine.stats().blocks_cached > 0
        llm.update_weights(new_weights)
        assert llm.engine.stats().blocks_cached == 0
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the same prompts again: no page of before may hit
        assert llm.engine.stats().prefix_hit_tokens - hits == own_hits
        llm.reset_prefix_cache()
        after = run(llm)
    assert after == fresh_after_update


def test_update_from_a_checkpoint_directory_a_safetensors_file_or_pairs(
    tiny_llama_dir, new_weights, tmp_path, fresh_after_update
):
    folder = saved_copy(tiny_llama_dir, new_weights, tmp_path / "ckpt")
    with make_llm(tiny_llama_dir) as llm:
        llm.update_weights(folder)
        assert run(llm) == fresh_after_update
        llm.update_weights(tiny_llama_dir / "model.safetensors")  # back to the original
        original = run(llm)
        llm.update_weights(iter(new_weights.items()))  # (name, tensor) pairs, as vLLM's load_weights takes
        assert run(llm) == fresh_after_update
    with make_llm(tiny_llama_dir) as untouched:
        assert run(untouched) == original


def test_a_bad_update_is_refused_and_changes_nothing(tiny_llama_dir, new_weights):
    with make_llm(tiny_llama_dir) as llm:
        before = run(llm)
        bad_name = {**new_weights, "model.layers.9.nothing": torch.zeros(1)}
        with pytest.raises(KeyError, match=r"model\.layers\.9\.nothing"):
            llm.update_weights(bad_name)
        name = "model.embed_tokens.weight"
        with pytest.raises(ValueError, match=name):
            llm.update_weights({**new_weights, name: torch.zeros(3, 3)})
        assert run(llm) == before


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS is read from /proc")
def test_sleep_gives_the_kv_pool_back_and_wake_up_restores_identical_outputs(tiny_llama_dir):
    blocks = 32768  # 8 KiB each for this model: a 256 MiB pool, all of it touched at start
    with make_llm(tiny_llama_dir, engine_config=EngineConfig(num_blocks=blocks, prefault_blocks=blocks)) as llm:
        pool = llm.engine.core.store.nbytes
        before = run(llm)
        resident = rss_bytes()
        llm.sleep()
        freed = resident - rss_bytes()
        assert freed >= 0.9 * pool, f"sleep freed {freed / 2**20:.0f} MiB of a {pool / 2**20:.0f} MiB pool"
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert run(llm) == before


@pytest.mark.parametrize("where", ["temp file", "named file", "dict"])
def test_sleep_level_2_parks_the_weights_and_wake_up_restores_them_bitwise(tiny_llama_dir, tmp_path, where):
    target = {"temp file": None, "named file": tmp_path / "parked.safetensors", "dict": {}}[where]
    with make_llm(tiny_llama_dir) as llm:
        before = run(llm)
        llm.sleep(level=2, weights_to=target)
        embed = llm.engine.core.model.get_input_embeddings().weight
        assert embed.numel() == 0  # the weights are out of the model
        if where == "dict":
            assert target["model.embed_tokens.weight"].shape == (512, 64)
        if where == "named file":
            assert target.stat().st_size > 0
        with pytest.raises(RuntimeError, match="wake_up"):
            llm.update_weights(tiny_llama_dir)
        llm.wake_up()
        assert run(llm) == before
        if where == "dict":
            assert target == {}  # handed back


def test_wake_weights_first_update_then_wake_the_cache(tiny_llama_dir, new_weights, fresh_after_update):
    """verl's order: wake the weights, load new ones, then give the KV cache its memory back."""
    with make_llm(tiny_llama_dir) as llm:
        run(llm)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.update_weights(new_weights)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up(tags=["kv_cache"])
        assert run(llm) == fresh_after_update


def test_reset_prefix_cache_drops_cached_pages_and_refuses_while_busy(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    with Engine(model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        prompt = PROMPTS[0]["prompt_token_ids"]
        engine.generate_batch([prompt], {"temperature": 0.0, "max_tokens": 4})
        assert engine.stats().blocks_cached > 0
        assert engine.reset_prefix_cache() is True
        assert engine.stats().blocks_cached == 0
        engine.core.cache.pool.check_invariants()
        engine.generate_batch([prompt], {"temperature": 0.0, "max_tokens": 4})
        assert engine.stats().prefix_hit_tokens == 0

        def reset_while_held() -> bool:  # on the engine's loop thread, the one that touches the core
            engine.core.cache.allocate(("held", 0), 16)  # a request holding blocks: the cache is not reset under it
            try:
                return engine.core.reset_prefix_cache()
            finally:
                engine.core.cache.free(("held", 0))

        assert engine._loop.call(reset_while_held) is False
