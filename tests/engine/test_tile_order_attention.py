"""bf16 attention in AMX's order at the engine level: a request alone and in a crowd gets the same bits.

The tiny models of the other engine tests have heads of 16 (the bf16 chains) or 32; these have heads of 64 and
128, so bf16 attention computes AMX's order (attention_tile.h) with several blocks per score, in fused Llama, Qwen2
and Qwen3 layers: prefill chunks, decode rows, shared prefixes. Contexts of about 300 keys here (cut into
segments and 32-key blocks in every way a chunk can cut them), and of 8k in the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts, run_requests

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")
MODELS = ["tiny_llama_head64_dir", "tiny_qwen2_head128_dir", "tiny_qwen3_head128_dir"]


def _load(request, fixture):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype="bfloat16")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim in (64, 128) and kernels.tile_order(torch.bfloat16, head_dim)
    return model, tokenizer


def _crowd(vocab, target, lengths, seed):
    prompts = random_prompts(vocab, lengths, seed=seed)
    prompts[1] = target[: len(target) // 2] + prompts[1]  # shares the target's first pages
    return [(f"c{i}", p, SamplingParams(max_tokens=6 + i % 5, temperature=0.8, seed=i)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("fixture", MODELS)
def test_a_request_alone_and_in_a_crowd_is_bitwise_identical(request, fixture):
    model, tokenizer = _load(request, fixture)
    vocab = model.config.vocab_size
    target = random_prompts(vocab, [300], seed=21)[0]
    sampling = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2)
    alone = run_requests(model, tokenizer, [("t", target, sampling)], EngineConfig(max_batch_tokens=512, num_blocks=64))
    crowd = _crowd(vocab, target, [7 + 37 * i % 200 for i in range(10)], seed=22)
    for config in (
        EngineConfig(max_batch_tokens=72, num_blocks=256),  # chunks of every length over cached keys
        EngineConfig(max_batch_tokens=45, max_requests_per_batch=4, num_blocks=256, scheduler="prefill-first"),
    ):
        crowded = run_requests(model, tokenizer, crowd[:5] + [("t", target, sampling)] + crowd[5:], config)
        assert crowded["t"] == alone["t"], config


@pytest.mark.slow  # two 8k-token prefills per model (the long contexts of the invariance test)
@pytest.mark.parametrize("fixture", ["tiny_llama_head64_dir", "tiny_qwen3_head128_dir"])
def test_an_8k_context_gives_the_same_bits_alone_and_in_a_crowd(request, fixture):
    model, tokenizer = _load(request, fixture)
    vocab = model.config.vocab_size
    target = random_prompts(vocab, [8100], seed=31)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    alone = run_requests(model, tokenizer, [("t", target, greedy)], EngineConfig(max_batch_tokens=4096, num_blocks=560))
    crowd = _crowd(vocab, target, [300, 200, 90], seed=32)
    config = EngineConfig(max_batch_tokens=700, num_blocks=1100)
    crowded = run_requests(model, tokenizer, [crowd[0], ("t", target, greedy), *crowd[1:]], config)
    assert crowded["t"] == alone["t"]


@pytest.mark.parametrize("fixture,takes_the_order", [("tiny_qwen3_dir", True), ("tiny_llama_dir", False)])
def test_the_run_summary_names_attentions_order_where_it_serves(request, fixture, takes_the_order):
    """Heads of 32 (tiny Qwen3) take AMX's order, heads of 16 (tiny Llama) the bf16 chains: the summary says which."""
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype="bfloat16")
    with Engine(model, tokenizer, EngineConfig(num_blocks=16)) as engine:
        brief = engine.linear_kernels()
    expected = f"attention AMX's order on {kernels.attend_dp_variant} (same bits on every CPU)"
    assert (expected in brief) == takes_the_order, brief
