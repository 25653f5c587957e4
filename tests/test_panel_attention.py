"""The compiled causal prefill attention: equal to SDPA, and what the engine runs for plain causal chunks."""

import pytest
import torch
import torch.nn.functional as F

from cbrun.engine.cpu_kernels import CpuKernels, load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def _sdpa(q, keys, values, start, scale):
    """Reference: q [T, H, D] at positions start.. over keys/values [H_kv, L, D] -> [T, H, D]."""
    tokens, length = q.shape[0], keys.shape[1]
    mask = torch.arange(length)[None, :] <= (start + torch.arange(tokens))[:, None]  # [T, L]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [
    (37, 9, 3, 64),  # the default model's heads; panels that split a token's query heads
    (16, 4, 4, 32),  # one query head per KV head: exactly one panel
    (3, 8, 2, 40),  # a short chunk; a head size that is not a multiple of the 6-column tile
])
def test_new_keys_of_a_first_chunk(tokens, heads, kv_heads, dim):
    """Keys and values read in place from a fused q|k|v buffer (strided), as the fused layers pass them."""
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    per_head = qkv.view(tokens, heads + 2 * kv_heads, dim).transpose(0, 1)  # [heads, T, D], strided
    q = per_head[:heads].transpose(0, 1).contiguous()
    key, value = per_head[heads: heads + kv_heads], per_head[heads + kv_heads:]
    got = kernels.prefill_attention(q, key, value, 0.2, 0)
    assert got is not None
    assert torch.allclose(got, _sdpa(q, key, value, 0, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,start,page", [(50, 77, 16), (1, 30, 8), (20, 0, 4)])
def test_chunk_over_cached_pages(tokens, start, page):
    """A later chunk: its queries at positions start.. over the sequence's pages, causal on the diagonal."""
    torch.manual_seed(1)
    heads, kv_heads, dim, blocks = 6, 2, 32, 40
    k_pool, v_pool = torch.randn(kv_heads, blocks, page, dim), torch.randn(kv_heads, blocks, page, dim)
    length = start + tokens
    pages = torch.randperm(blocks)[: -(-length // page)]
    keys = k_pool.index_select(1, pages).view(kv_heads, -1, dim)[:, :length]
    values = v_pool.index_select(1, pages).view(kv_heads, -1, dim)[:, :length]
    q = torch.randn(tokens, heads, dim)
    got = kernels.prefill_attention(q, k_pool, v_pool, 0.3, start, pages)
    assert torch.allclose(got, _sdpa(q, keys, values, start, 0.3), atol=1e-5, rtol=1e-5)


def test_declines_what_it_does_not_take():
    q = torch.randn(4, 2, 16)
    key = torch.randn(1, 4, 16)
    assert kernels.prefill_attention(q.bfloat16(), key.bfloat16(), key.bfloat16(), 1.0, 0) is None
    assert kernels.prefill_attention(q, key, key.transpose(1, 2).contiguous().transpose(1, 2), 1.0, 0) is None
    assert kernels.prefill_attention(q, key, key, 1.0, 3) is None  # later chunks need the pages


def test_engine_runs_plain_causal_chunks_through_the_kernel(tiny_llama_dir, monkeypatch):
    """Chunked prefill (first chunks and chunks over cached pages): same greedy tokens and logprobs as SDPA."""
    from engine_helpers import load_pair, random_prompts, run_engine

    from cbrun.engine import EngineConfig

    model, _, tokenizer = load_pair(str(tiny_llama_dir))
    prompts = random_prompts(500, [90, 7, 300, 33], seed=5)
    # chunks of at most 100 tokens; later chunks over 64 (ROW_CHUNK) take the prefill path
    config = EngineConfig(page_size=8, max_batch_tokens=100)
    calls = []
    original = CpuKernels.prefill_attention

    def counting(self, q, key, value, scale, start, pages=None):
        out = original(self, q, key, value, scale, start, pages)
        calls.append((start, out is not None))
        return out

    monkeypatch.setattr(CpuKernels, "prefill_attention", lambda self, *args, **kw: None)  # declines: SDPA
    reference = run_engine(model, tokenizer, prompts, [12] * len(prompts), config)
    monkeypatch.setattr(CpuKernels, "prefill_attention", counting)
    compiled = run_engine(model, tokenizer, prompts, [12] * len(prompts), config)
    assert any(start == 0 and ran for start, ran in calls)  # first chunks, from their new keys
    assert any(start > 0 and ran for start, ran in calls)  # later chunks, over the cached pages
    for a, b in zip(reference, compiled):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
