"""Attention at the head counts and lengths of real 1-8B models (issue 31).

The CPU kernel works per (task, KV head): a page piece is scored for all G query heads of the group while it
sits in L1, so each KV page is read once per group, not once per query head. Here: groups of 2 to 8 query heads
per KV head, head sizes 64 and 128, decode rows at 2k-8k contexts and a prefill chunk over an 8k cached context,
against the torch reference; and greedy fp32 parity with transformers for a GQA model of head size 128 and a
Qwen2 model (q/k/v biases) of head size 64 with 7 query heads per KV head.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import reference_greedy, reference_logprobs, run_engine
from helpers import make_prompts, save_tiny_model

from cbrun.engine import EngineConfig
from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows
from cbrun.engine.backends.torch_attention import TorchRows, decode as torch_decode
from cbrun.models import load_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")
PAGE = 16  # the engine's default page size
# (query heads, KV heads, head size): Qwen3-1.7B, Llama-3.1-8B, Qwen2.5-7B, Qwen2.5-1.5B, Llama-3.2-1B-like
SHAPES = [(16, 8, 128), (32, 8, 128), (28, 4, 128), (12, 2, 128), (16, 2, 64)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pools(kv_heads: int, pages: int, dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k_pool = (torch.randn(kv_heads, pages, PAGE, dim, generator=gen) * 2).to(dtype)  # scaled: a peaky softmax
    v_pool = torch.randn(kv_heads, pages, PAGE, dim, generator=gen).to(dtype)
    return k_pool, v_pool


def _reference(q, k_pool, v_pool, tables, kv_len, scale):
    """torch's decode path: q [H, R, D], one table row per query row, keys below kv_len[r] visible."""
    key_pos = torch.arange(tables.shape[1] * PAGE)[None, :]
    bias = torch.zeros(len(kv_len), key_pos.shape[1]).masked_fill_(key_pos >= kv_len[:, None], float("-inf"))
    return torch_decode(q, k_pool, v_pool, TorchRows(pages=tables.reshape(-1), bias=bias[:, None, :]), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_decode_rows_at_long_contexts_match_torch(heads, kv_heads, dim, dtype):
    lengths = torch.tensor([1, 2047, 2048, 2049, 8192])
    pages_each = 8192 // PAGE
    k_pool, v_pool = _pools(kv_heads, len(lengths) * pages_each, dim, dtype, seed=heads)
    tables = torch.randperm(len(lengths) * pages_each).view(len(lengths), pages_each)
    gen = torch.Generator().manual_seed(dim)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)  # [R, H, D]
    seqs = [SequenceRows(i, int(n) - 1, 1, t.tolist(), 0) for i, (t, n) in enumerate(zip(tables, lengths))]
    tasks = plan_tasks(seqs, PAGE, kernels.segment, windowed=False)
    zeros = torch.zeros(len(lengths), dtype=torch.long)
    paged = PagedRows(tables, torch.arange(len(lengths)), zeros, lengths, zeros)
    got = kernels.attend(q, k_pool, v_pool, paged, tasks, dim**-0.5)
    expected = _reference(q.transpose(0, 1), k_pool, v_pool, tables, lengths, dim**-0.5)
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.slow  # the torch reference scores 64 rows x 8k keys x 32 heads: seconds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_chunk_over_an_8k_cached_context_matches_torch(dtype):
    """64 new tokens at positions 8128-8191 of one sequence (Llama-3.1-8B's heads), each row causal."""
    heads, kv_heads, dim, start, count = 32, 8, 128, 8128, 64
    pages = 8192 // PAGE
    k_pool, v_pool = _pools(kv_heads, pages, dim, dtype, seed=5)
    table = torch.randperm(pages)[None, :]
    q = torch.randn(count, heads, dim, generator=torch.Generator().manual_seed(6)).to(dtype)
    tasks = plan_tasks([SequenceRows(0, start, count, table[0].tolist(), 0)], PAGE, kernels.segment, windowed=False)
    kv_len = torch.arange(start + 1, start + count + 1)
    zeros = torch.zeros(count, dtype=torch.long)
    got = kernels.attend(q, k_pool, v_pool, PagedRows(table, zeros, zeros[:1], kv_len, zeros), tasks, dim**-0.5)
    expected = _reference(q.transpose(0, 1), k_pool, v_pool, table.expand(count, -1), kv_len, dim**-0.5)
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


def _gqa_llama(tokenizer, directory):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
    )
    return save_tiny_model(config, tokenizer, directory)


def _qwen2_group_of_seven(tokenizer, directory):
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=448,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=7,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    return save_tiny_model(config, tokenizer, directory)


@pytest.mark.parametrize("build", [_gqa_llama, _qwen2_group_of_seven])
def test_greedy_fp32_parity_with_transformers_at_real_head_shapes(build, tiny_tokenizer, tmp_path):
    directory = build(tiny_tokenizer, tmp_path)
    engine_model, _ = load_model(str(directory), dtype="float32")
    reference_model, _ = load_model(str(directory), dtype="float32")
    prompts = make_prompts(tiny_tokenizer, [5, 40, 130])
    results = run_engine(
        engine_model, tiny_tokenizer, prompts, [12] * 3, EngineConfig(num_blocks=64, max_batch_tokens=64)
    )  # the 130-token prompt is prefilled in chunks beside the others' decodes
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(reference_model, prompt, 12)
        expected = reference_logprobs(reference_model, prompt, result.token_ids)
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < 1e-4
