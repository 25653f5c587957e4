"""The compiled CPU decode kernel computes what the torch path computes."""

import pytest
import torch

from cbrun.engine.attention import _decode
from cbrun.engine.batch import DecodeLayout
from cbrun.engine.cpu_kernels import load_decode_kernel

kernel = load_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler here: the torch path is used")


def _layout(tables, kv_len, kv_lo, first_page, page):
    max_pages = tables.shape[1]
    key_pos = first_page[:, None] * page + torch.arange(max_pages * page)[None, :]
    valid = (key_pos < kv_len[:, None]) & (key_pos >= kv_lo[:, None])
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, :]
    return DecodeLayout(tables, kv_len, kv_lo, first_page, int((kv_len - kv_lo).max()),
                        pages=tables.reshape(-1), bias=bias)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_torch_decode(dtype, tol, window):
    torch.manual_seed(0)
    heads, kv_heads, dim, page, blocks = 6, 2, 32, 8, 40
    k_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    v_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    kv_len = torch.tensor([1, 9, 30, 17])
    first_page = torch.tensor([0, 0, 2, 1]) if window else torch.zeros(4, dtype=torch.long)
    kv_lo = (kv_len - window).clamp(min=0) if window else torch.zeros(4, dtype=torch.long)
    tables = torch.randperm(blocks)[:16].view(4, 4)
    layout = _layout(tables, kv_len, kv_lo, first_page, page)
    q = torch.randn(heads, 4, dim).to(dtype)  # [H, B, D]
    expected = _decode(q, k_pool, v_pool, layout, 0.3)
    got = kernel(q.transpose(0, 1).contiguous(), k_pool, v_pool, tables, kv_len, kv_lo, first_page,
                 layout.max_len, 0.3)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
