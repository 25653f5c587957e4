"""The compiled CPU kernels compute what the torch paths compute."""

import pytest
import torch

from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows
from cbrun.engine.backends.torch_attention import TorchRows, decode as torch_decode

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def _layout(tables, kv_len, kv_lo, first_page, page):
    max_pages = tables.shape[1]
    key_pos = first_page[:, None] * page + torch.arange(max_pages * page)[None, :]
    valid = (key_pos < kv_len[:, None]) & (key_pos >= kv_lo[:, None])
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, :]
    return TorchRows(pages=tables.reshape(-1), bias=bias)


def _attend_decodes(q, k_pool, v_pool, tables, kv_len, kv_lo, first_page, scale):
    """The kernel over one decode row per sequence (q [B, H, D]), tasks planned as the engine does."""
    seqs = [
        SequenceRows(i, int(n) - 1, 1, t.tolist(), int(f))
        for i, (t, n, f) in enumerate(zip(tables, kv_len, first_page))
    ]
    tasks = plan_tasks(seqs, k_pool.shape[2], kernels.segment, windowed=bool(kv_lo.any()))
    rows = torch.arange(len(seqs))
    return kernels.attend(q, k_pool, v_pool, PagedRows(tables, rows, first_page, kv_len, kv_lo), tasks, scale)


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
    expected = torch_decode(q, k_pool, v_pool, layout, 0.3)
    got = _attend_decodes(q.transpose(0, 1).contiguous(), k_pool, v_pool, tables, kv_len, kv_lo, first_page, 0.3)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page", [(9, 3, 64, 16), (4, 1, 128, 128), (6, 6, 80, 64), (16, 2, 64, 256)]
)
def test_kernel_long_contexts_cross_pages_and_segments(dtype, tol, heads, kv_heads, dim, page):
    """Contexts of many pages and segments (the online softmax rescales), every head size path."""
    torch.manual_seed(1)
    lengths = torch.tensor([1, 63, 64, 65, 300, 1000])
    max_pages = int((lengths.max() + page - 1) // page)
    blocks = len(lengths) * max_pages + 3
    k_pool = (torch.randn(kv_heads, blocks, page, dim) * 2).to(dtype)  # scaled: peaky softmax
    v_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    tables = torch.randperm(blocks)[: len(lengths) * max_pages].view(len(lengths), max_pages)
    zeros = torch.zeros(len(lengths), dtype=torch.long)
    layout = _layout(tables, lengths, zeros, zeros, page)
    q = torch.randn(heads, len(lengths), dim).to(dtype)
    expected = torch_decode(q, k_pool, v_pool, layout, dim**-0.5)
    got = _attend_decodes(q.transpose(0, 1).contiguous(), k_pool, v_pool, tables, lengths, zeros, zeros, dim**-0.5)
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_query_rows_in_place_from_the_fused_qkv_columns(dtype):
    """q as the step makes it, [R, H, D] heads of one row side by side but rows (H + 2 H_kv) D apart (a view of
    q|k|v), is read in place and gives the bits of a contiguous copy; a layout it cannot read is copied first."""
    torch.manual_seed(3)
    heads, kv_heads, dim, page, blocks = 6, 2, 64, 16, 30
    k_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    v_pool = torch.randn(kv_heads, blocks, page, dim).to(dtype)
    kv_len = torch.tensor([5, 40, 130])
    tables = torch.randperm(blocks)[:27].view(3, 9)
    zeros = torch.zeros(3, dtype=torch.long)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim).to(dtype)  # [R, (H + 2 H_kv) D]
    view = qkv.view(3, heads + 2 * kv_heads, dim)[:, :heads]  # [R, H, D] rows (H + 2 H_kv) D apart
    assert view.stride(0) == (heads + 2 * kv_heads) * dim and not view.is_contiguous()
    want = _attend_decodes(view.contiguous(), k_pool, v_pool, tables, kv_len, zeros, zeros, 0.125)
    got = _attend_decodes(view, k_pool, v_pool, tables, kv_len, zeros, zeros, 0.125)
    assert torch.equal(got, want) and got.is_contiguous()
    one = torch.randn(heads, 1, dim).to(dtype).transpose(0, 1)  # [1, H, D], "contiguous" with a row stride of D
    assert one.is_contiguous() and one.stride(0) < heads * dim
    first = (tables[:1], kv_len[:1], zeros[:1], zeros[:1], 0.125)
    want = _attend_decodes(view[:1].contiguous(), k_pool, v_pool, *first)
    assert torch.equal(_attend_decodes(one.copy_(view[:1]), k_pool, v_pool, *first), want)
    by_head = torch.randn(heads, 3, dim).to(dtype)  # [H, R, D]: heads R * D apart, which the kernel cannot read
    want = _attend_decodes(by_head.transpose(0, 1).contiguous(), k_pool, v_pool, tables, kv_len, zeros, zeros, 0.125)
    got = _attend_decodes(by_head.transpose(0, 1), k_pool, v_pool, tables, kv_len, zeros, zeros, 0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype):
    torch.manual_seed(2)
    kv_heads, blocks, page, dim, tokens = 3, 10, 16, 64, 37
    pool = torch.zeros(kv_heads, blocks, page, dim, dtype=dtype)
    expected = pool.clone()
    new = torch.randn(1, tokens, kv_heads, dim).to(dtype).transpose(1, 2)[0]  # [H_kv, T, D], as the model makes it
    slots = torch.randperm(blocks * page)[:tokens]
    kernels.write_kv(pool, new, slots)
    expected.view(kv_heads, blocks * page, dim).index_copy_(1, slots, new)
    assert torch.equal(pool, expected)


def test_sampler_kernel_greedy_rows_and_normalizer():
    torch.manual_seed(3)
    logits = torch.randn(5, 1001) * 4
    inv_temp = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0 / 0.7])
    token, normalizer = kernels.sample(logits, inv_temp, torch.full((5,), -1.0, dtype=torch.float64))
    assert torch.equal(token, logits.argmax(dim=-1))
    assert torch.allclose(normalizer, torch.logsumexp(logits * inv_temp[:, None], dim=-1), atol=1e-5, rtol=1e-6)


def test_sampler_kernel_inverts_the_cdf():
    """Sampled rows pick the first token whose cumulative probability exceeds the uniform."""
    torch.manual_seed(4)
    logits = torch.randn(64, 3001) * 3
    inv_temp = torch.rand(64) + 0.5
    uniform = torch.rand(64, dtype=torch.float64)
    token, _ = kernels.sample(logits, inv_temp, uniform)
    cdf = torch.softmax(logits.double() * inv_temp.double()[:, None], dim=-1).cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)[:, 0]
    assert torch.equal(token, expected)


def test_sampler_kernel_draws_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]]).repeat(4000, 1)
    uniform = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000  # evenly spread draws
    token, _ = kernels.sample(logits, torch.ones(4000), uniform)
    freq = torch.bincount(token, minlength=4).double() / 4000
    probs = torch.softmax(logits[0].double(), dim=-1)
    assert torch.allclose(freq, probs, atol=1e-3)
    assert freq[3] == 0  # a token with ~1e-14 probability is never drawn from 4000 evenly spread numbers


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (5, 13), (6, 576), (13, 40), (192, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_kernel_matches_f_linear(rows, out_features, in_features, with_bias):
    """Every tile remainder (rows % 2, features % 6), a K tail (K % 8), bias, and a strided input."""
    torch.manual_seed(5)
    wide = torch.randn(rows, in_features + 3)
    x = wide[:, :in_features]  # row stride != K
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    got = kernels.linear(x, weight, bias)
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_kernel_linears_install_and_uninstall():
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights
    from cbrun.engine.backends.cpu.linear.install import install_linear_methods
    from cbrun.engine.backends.cpu.linear.methods import F32

    torch.manual_seed(6)
    decoder = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8, bias=False))
    small, large = torch.randn(1, 5, 16), torch.randn(1, 300, 16)
    with torch.no_grad():
        expected_small, expected_large = decoder(small), decoder(large)
        held = HeldWeights(decoder)
        patched = list(install_linear_methods(decoder, kernels, {torch.float32: F32}, held))
        assert len(patched) == 2 and all("forward" in m.__dict__ for m in patched)
        assert torch.allclose(decoder(small), expected_small, atol=1e-5)
        assert torch.allclose(decoder(large), expected_large, atol=1e-5)
        assert torch.equal(decoder(large)[:, :5], decoder(large[:, :5]))  # rows alone = rows in a crowd
        held.restore()
    assert not any("forward" in m.__dict__ for m in patched)


def test_token_masks_kernel_sets_what_torch_sets():
    """Structured outputs and min_tokens: the compiled mask pass gives the logits torch's masked_fill gives."""
    from cbrun.engine.sample.token_masks import apply_masks

    torch.manual_seed(9)
    vocab = 1000 + 13  # a partial last word
    words = (vocab + 31) // 32
    masks = [torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32) for _ in range(5)]
    masks[0][:] = -1  # everything allowed
    masks[1][:] = 0
    masks[1][3] = 1 << 31 >> 31  # one word all ones (sign bit set), the rest banned
    logits = torch.randn(8, vocab)
    rows = [6, 0, 3, 1, 7]
    expected, got = logits.clone(), logits.clone()
    apply_masks(expected, rows, masks)
    apply_masks(got, rows, masks, kernels)
    assert torch.equal(expected.view(torch.int32), got.view(torch.int32))
    assert torch.equal(got[[2, 4, 5]], logits[[2, 4, 5]])  # other rows untouched
