"""The compiled attention gives the same bits at every vector width and whatever the pages' order.

With AVX-512 the kernel scores two query heads per 16-lane register against one key broadcast into both halves,
takes the softmax's exponentials 16 lanes at a time and sums values 16 lanes at a time (bf16 values 32 dims per
load, the even and odd dims in separate registers, put back in order before the output is written); with AVX2 (or
-DCBRUN_ATTN_NARROW) all of it runs 8 lanes. Each lane computes the same chain either way, so the outputs must
be equal bit for bit: here the wide build (forced with -DCBRUN_ATTN_WIDE and -DCBRUN_VEC_WIDTH=16, so that on an
AVX2 machine it is the same C in ymm halves; the width also sets bf16's AMX-order twin: 16 keys per score vector,
32 dims per value load) against the narrow one, at real head shapes, odd groups included (the last head of a pair
beside zeros). The kernel also reads keys in runs of pages that follow each other in the pool: the same K/V laid
out in order or scattered must give the same bits. Both builds are checked against the torch reference too.
"""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import build_kernels
from cbrun.engine.backends.metadata import PagedRows
from cbrun.engine.backends.torch_attention import TorchRows, decode as torch_decode

PAGE = 16
# (query heads, KV heads, head size, dtype): Qwen2.5-1.5B, Qwen2.5-7B (7 per group), groups of 8, 3 and 1, and
# bf16 heads of 128 and 64 (AMX's order: keys in the score lanes, values 2 x VEC dims per load) and
# of 80 (not a multiple of 32: the bf16 kernel's own scores, values 16 dims per load)
SHAPES = [
    (12, 2, 128, torch.bfloat16),
    (9, 3, 64, torch.bfloat16),
    (12, 2, 128, torch.float32),
    (28, 4, 128, torch.float32),
    (16, 2, 64, torch.float32),
    (9, 3, 64, torch.float32),
    (4, 4, 64, torch.float32),
    (10, 2, 80, torch.bfloat16),
    (7, 1, 80, torch.bfloat16),
]


@pytest.fixture(scope="module")
def builds():
    try:
        return {
            name: build_kernels(defines)
            for name, defines in (
                ("wide", ("CBRUN_ATTN_WIDE", "CBRUN_VEC_WIDTH=16")),
                ("narrow", ("CBRUN_ATTN_NARROW", "CBRUN_VEC_WIDTH=8")),
            )
        }
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _case(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, scattered: bool):
    """A step of decode rows at several lengths and a 150-token prefill chunk over 170 cached tokens, on pages
    laid out in order or at random places (the same K/V either way); returns the kernel's arguments."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    decode_lengths = [1, 3, 17, 129, 700]
    start, count = 170, 150
    lengths = [*decode_lengths, start + count]
    pages_each = [(n + PAGE - 1) // PAGE for n in lengths]
    total = sum(pages_each)
    k_logical = (torch.randn(kv_heads, total, PAGE, dim, generator=gen) * 2).to(dtype)  # scaled: a peaky softmax
    v_logical = torch.randn(kv_heads, total, PAGE, dim, generator=gen).to(dtype)
    q = torch.randn(len(decode_lengths) + count, heads, dim, generator=gen).to(dtype)
    place = torch.randperm(total, generator=gen) if scattered else torch.arange(total)
    k_pool, v_pool = torch.empty_like(k_logical), torch.empty_like(v_logical)
    k_pool[:, place], v_pool[:, place] = k_logical, v_logical
    width = max(pages_each)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    first = 0
    for s, pages in enumerate(pages_each):
        tables[s, :pages] = place[first : first + pages]
        first += pages
    seqs = [
        SequenceRows(s, n - 1, 1, tables[s, :p].tolist(), 0) for s, (n, p) in enumerate(zip(decode_lengths, pages_each))
    ]
    last = len(lengths) - 1
    seqs.append(SequenceRows(len(decode_lengths), start, count, tables[last, : pages_each[last]].tolist(), 0))
    rows = len(decode_lengths) + count
    row_seq = torch.tensor([*range(len(decode_lengths)), *[last] * count])
    kv_len = torch.tensor([*decode_lengths, *range(start + 1, start + count + 1)])
    zeros = torch.zeros(rows, dtype=torch.long)
    paged = PagedRows(tables, row_seq, torch.zeros(len(lengths), dtype=torch.long), kv_len, zeros)
    return q, k_pool, v_pool, paged, seqs


def _attend(kernels, q, k_pool, v_pool, paged, seqs, dim):
    tasks = plan_tasks(seqs, PAGE, kernels.segment, windowed=False)
    return kernels.attend(q, k_pool, v_pool, paged, tasks, dim**-0.5)


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", SHAPES)
def test_wide_and_narrow_builds_give_the_same_bits_in_order_or_scattered(builds, heads, kv_heads, dim, dtype):
    outs = {}
    for scattered in (False, True):
        q, k_pool, v_pool, paged, seqs = _case(heads, kv_heads, dim, dtype, scattered)
        for name, kernels in builds.items():
            outs[name, scattered] = _attend(kernels, q, k_pool, v_pool, paged, seqs, dim)
    reference = outs["narrow", True]
    for key, out in outs.items():
        assert torch.equal(_bits(out), _bits(reference)), key
    q, k_pool, v_pool, paged, _ = _case(heads, kv_heads, dim, dtype, True)
    key_pos = torch.arange(paged.tables.shape[1] * PAGE)[None, :]
    bias = torch.zeros(len(paged.kv_len), key_pos.shape[1]).masked_fill_(
        key_pos >= paged.kv_len[:, None], float("-inf")
    )
    pages = paged.tables[paged.row_seq].reshape(-1)
    expected = torch_decode(q.transpose(0, 1), k_pool, v_pool, TorchRows(pages=pages, bias=bias[:, None, :]), dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(reference.float(), expected.float(), atol=tol, rtol=tol)
