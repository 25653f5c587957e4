"""Shared-prefix (cascade) decode attention: grouping, the merged softmax, and the engine end to end."""

import pytest
import torch

import cbrun.engine.shared_prefix as shared_prefix
from cbrun.engine.cpu_kernels import load_cpu_kernels
from cbrun.engine.shared_prefix import SharedPrefix, attend_shared_prefixes, find_shared_prefixes

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def test_groups_take_common_leading_pages_that_every_row_sees(monkeypatch):
    monkeypatch.setattr(shared_prefix, "MIN_ROW_KEYS", 0)
    page = 4
    tables = torch.tensor([
        [7, 8, 9, 20],
        [7, 8, 9, 21],
        [7, 8, 30, 31],
        [7, 8, 9, 22],
        [5, 6, 40, 41],  # another first block, alone: no group
    ])
    kv_len = torch.tensor([15, 16, 13, 9, 16])
    groups, lo = find_shared_prefixes(tables, kv_len, page)
    assert len(groups) == 1
    assert groups[0].rows.tolist() == [0, 1, 2, 3]
    assert groups[0].pages.tolist() == [7, 8]  # page 9 is not in row 2; row 3 sees 9 keys = 2 whole pages
    assert lo.tolist() == [8, 8, 8, 8, 0]


def test_small_groups_are_left_to_the_kernel():
    tables = torch.tensor([[7, 8], [7, 8], [7, 8], [7, 8]])
    groups, lo = find_shared_prefixes(tables, torch.tensor([32] * 4), 16)  # 4 rows x 32 keys: too little
    assert groups == [] and lo is None


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,dim,page,pages,rows", [
    (9, 3, 64, 16, 32, 40),  # the default model's shape: 120 query rows, 7 full panels and a part
    (6, 2, 32, 8, 5, 7),  # 40 keys (not a multiple of the 6-key tile), one short panel
    (4, 4, 16, 4, 1, 3),  # one query head per KV head, a single page
    (8, 1, 40, 4, 3, 2),  # a head size that is not a multiple of the 6-column tile
])
def test_compiled_shared_prefix_equals_the_torch_path(heads, kv_heads, dim, page, pages, rows):
    torch.manual_seed(1)
    blocks, batch = 50, rows + 5
    k_pool, v_pool = torch.randn(kv_heads, blocks, page, dim), torch.randn(kv_heads, blocks, page, dim)
    q = torch.randn(batch, heads, dim)
    group = SharedPrefix(torch.randperm(batch)[:rows], torch.randperm(blocks)[:pages])
    expected = attend_shared_prefixes(q, k_pool, v_pool, [group], 0.2)
    calls = []

    def compiled(*args):
        calls.append(kernels.shared_prefix(*args))
        return calls[-1]

    got = attend_shared_prefixes(q, k_pool, v_pool, [group], 0.2, compiled)
    assert calls == [True]
    assert torch.equal(torch.isinf(got[0]), torch.isinf(expected[0]))  # rows outside the group untouched
    assert torch.allclose(got[0], expected[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[1], expected[1], atol=1e-4, rtol=1e-5)
    assert torch.allclose(got[2], expected[2], atol=1e-4, rtol=1e-5)


@needs_kernels
def test_compiled_shared_prefix_declines_bf16_and_the_torch_path_runs():
    torch.manual_seed(2)
    k_pool, v_pool = torch.randn(2, 20, 8, 16).bfloat16(), torch.randn(2, 20, 8, 16).bfloat16()
    q = torch.randn(6, 4, 16).bfloat16()
    group = SharedPrefix(torch.arange(5), torch.tensor([3, 9]))
    expected = attend_shared_prefixes(q, k_pool, v_pool, [group], 0.3)
    got = attend_shared_prefixes(q, k_pool, v_pool, [group], 0.3, kernels.shared_prefix)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("dtype,tol,compiled", [(torch.float32, 1e-5, False), (torch.float32, 1e-5, True),
                                                (torch.bfloat16, 2e-2, False)])
def test_kernel_continuing_from_the_shared_state_equals_one_pass(dtype, tol, compiled):
    torch.manual_seed(0)
    heads, kv_heads, dim, page, blocks, rows, pages = 6, 2, 32, 8, 120, 10, 9
    k_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    v_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    tables = torch.randperm(blocks)[: rows * pages].view(rows, pages).contiguous()
    tables[:7, :5] = tables[0, :5]  # rows 0-6 share 5 pages (40 keys)
    kv_len = torch.randint(45, pages * page, (rows,))
    zeros = torch.zeros(rows, dtype=torch.long)
    q = torch.randn(rows, heads, dim).to(dtype)
    expected = kernels.decode(q, k_pool, v_pool, tables, kv_len, zeros, zeros, 0.3)
    group = SharedPrefix(torch.arange(7), tables[0, :5].clone())
    lo = torch.tensor([40] * 7 + [0] * 3)
    state = attend_shared_prefixes(q, k_pool, v_pool, [group], 0.3, kernels.shared_prefix if compiled else None)
    got = kernels.decode(q, k_pool, v_pool, tables, kv_len, lo, zeros, 0.3, state)
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_kernels
def test_engine_output_is_the_same_with_shared_prefix_attention(tiny_llama_dir, monkeypatch):
    """Many greedy requests behind one long common prefix: same tokens with and without the cascade."""
    from engine_helpers import load_pair, random_prompts, run_engine

    from cbrun.engine import EngineConfig

    model, _, tokenizer = load_pair(str(tiny_llama_dir))
    prefix = random_prompts(500, [96], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(500, [3, 5, 7, 9, 4, 6], seed=4)]
    config = EngineConfig(page_size=16, max_batch_tokens=256)
    calls = []
    original = shared_prefix.attend_shared_prefixes

    def counting(*args):
        calls.append(1)
        return original(*args)

    import cbrun.engine.attention as attention
    from cbrun.engine.cpu_kernels import CpuKernels
    monkeypatch.setattr(attention, "attend_shared_prefixes", counting)
    compiled_calls = []
    original_kernel = CpuKernels.shared_prefix

    def counting_kernel(self, *args):
        compiled_calls.append(original_kernel(self, *args))
        return compiled_calls[-1]

    monkeypatch.setattr(CpuKernels, "shared_prefix", counting_kernel)  # taken by engines built from here on
    monkeypatch.setattr(shared_prefix, "MIN_ROW_KEYS", 10**9)  # off
    plain = run_engine(model, tokenizer, prompts, [24] * len(prompts), config)
    assert not calls
    monkeypatch.setattr(shared_prefix, "MIN_ROW_KEYS", 0)  # on for every group of MIN_ROWS
    cascaded = run_engine(model, tokenizer, prompts, [24] * len(prompts), config)
    assert calls  # the shared-prefix path ran
    assert compiled_calls and all(compiled_calls)  # through the compiled kernel (fp32)
    for a, b in zip(plain, cascaded):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
