"""bf16 attention scores on dot-product pairs: every variant gives the instruction's bits.

attention.c computes a bf16 score as AVX512-BF16's vdpbf16ps does (16 lanes of pair chains with
flushing, then one fixed tree). The plain-C reference is checked against a model of that arithmetic
written here; the portable twin and the instruction (where this CPU has it) against the reference,
bitwise; the load check keeps a variant that differs out; and whole attention calls through each
variant agree bitwise and stay within bf16 tolerance of the torch reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.isa_variants import choose_attention_dp_variant, probe_scores
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")
FLT_MIN = 2.0**-126


def _flush(x: torch.Tensor) -> torch.Tensor:
    """fp32 values below the normal range -> zero of the same sign (denormals flushed or read as zero)."""
    return torch.where(x.abs() < FLT_MIN, torch.zeros_like(x) * x.sign(), x)


def _model_scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The instruction's arithmetic, written from its documented semantics: per lane i and chunk c,
    t = fma(q[32c+2i+1], k[32c+2i+1], acc), acc = fma(q[32c+2i], k[32c+2i], t), inputs read with
    denormals as zero, results flushed; bf16 products are exact in float64, so a float64 sum rounded
    once to fp32 is the fused multiply-add. Then the lane tree and the scale, in fp32."""
    qf, kf = _flush(q.float()).double(), _flush(keys.float()).double()
    heads, dim = q.shape
    acc = torch.zeros(heads, keys.shape[0], 16, dtype=torch.float32)
    for c in range(dim // 32):
        for element in (1, 0):  # the pair's second element first
            cols = torch.arange(16) * 2 + 32 * c + element
            product = qf[:, None, cols] * kf[None, :, cols]  # [G, n, 16], exact
            acc = _flush((product + acc.double()).float())
    v = acc[..., :8] + acc[..., 8:]
    w = v[..., :4] + v[..., 4:]
    return ((w[..., 0] + w[..., 2]) + (w[..., 1] + w[..., 3])) * torch.tensor(scale, dtype=torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_the_reference_is_the_instructions_arithmetic(dim):
    torch.manual_seed(dim)
    cases = [
        (torch.randn(3, dim), torch.randn(21, dim)),
        (torch.randn(2, dim) * 1e-19, torch.randn(9, dim) * 1e-19),  # products in the denormal range
        (torch.randn(3, dim) * 1e-39, torch.randn(5, dim)),  # denormal bf16 inputs
    ]
    for q, keys in cases:
        q, keys = q.to(torch.bfloat16), keys.to(torch.bfloat16)
        got = kernels.attend_dp_scores("scalar", q, keys, 0.3)
        assert torch.equal(_bits(got), _bits(_model_scores(q, keys, 0.3)))


@pytest.mark.parametrize("variant", ["twin", "isa"])
def test_each_variant_gives_the_references_bits(variant):
    if not kernels.dp_attention_runs(variant):
        pytest.skip(f"this CPU has no AVX512-BF16: the {variant} variant cannot run here")
    probes = probe_scores(seed=3) + [(torch.randn(7, 128).bfloat16(), torch.randn(128, 128).bfloat16())]
    for q, keys in probes:
        for count in (1, 3, 4, 5, keys.shape[0]):  # whole 4-key blocks and the 1-3 keys left over
            expected = kernels.attend_dp_scores("scalar", q, keys[:count], 0.125)
            assert torch.equal(_bits(kernels.attend_dp_scores(variant, q, keys[:count], 0.125)), _bits(expected))


class _Disagreeing:
    """Kernels whose instruction variant is off by one bit in one score: the load check must not keep it."""

    def __init__(self, real):
        self.real = real

    def dp_attention_runs(self, variant: str) -> bool:
        return True

    def attend_dp_scores(self, variant, q, keys, scale):
        out = self.real.attend_dp_scores("scalar" if variant == "isa" else variant, q, keys, scale)
        if variant == "isa":
            out.view(torch.int32)[0, 0] ^= 1
        return out


def test_the_load_check_skips_a_variant_that_differs_and_the_next_serves():
    assert choose_attention_dp_variant(_Disagreeing(kernels)) == "twin"
    assert kernels.attend_dp_variant in ("isa", "twin", "scalar")
    if kernels.dp_attention_runs("isa"):
        assert kernels.attend_dp_variant == "isa"


CASES = [(9, 3, 64, 16), (4, 1, 128, 32), (6, 2, 32, 8)]


def _attention_case(heads, kv_heads, dim, page):
    """Decodes of many pages and segments, rows 3 and 4 sharing 256 leading keys: (inputs, kernel args)."""
    torch.manual_seed(heads)
    lengths = [1, 31, 200, 300, 300]
    max_pages = (max(lengths) + page - 1) // page
    blocks = len(lengths) * max_pages + 2
    k_pool = torch.randn(kv_heads, blocks, page, dim).bfloat16()
    v_pool = torch.randn(kv_heads, blocks, page, dim).bfloat16()
    tables = torch.randperm(blocks)[: len(lengths) * max_pages].view(len(lengths), max_pages)
    tables[4, : 256 // page] = tables[3, : 256 // page]
    seqs = [SequenceRows(i, n - 1, 1, t.tolist(), 0) for i, (t, n) in enumerate(zip(tables, lengths))]
    tasks = plan_tasks(seqs, page, kernels.segment, windowed=False)
    q = torch.randn(len(lengths), heads, dim).bfloat16()
    kv_len, zeros, rows = torch.tensor(lengths), torch.zeros(len(lengths), dtype=torch.long), torch.arange(len(lengths))
    return lengths, (q, k_pool, v_pool, PagedRows(tables, rows, zeros, kv_len, zeros), tasks, dim**-0.5)


def attention_through(variant: str) -> list[torch.Tensor]:
    """Every case's attention output through one variant (used by the AVX2-build subprocess too)."""
    kernels.attend_dp_variant = variant
    try:
        return [kernels.attend(*_attention_case(*case)[1]) for case in CASES]
    finally:
        kernels.attend_dp_variant = choose_attention_dp_variant(kernels)


@pytest.mark.parametrize("case", CASES)
def test_attention_through_every_variant_is_one_result(case):
    """Whole attention calls give the same bits through each variant that runs here, within bf16 tolerance of
    fp32 attention."""
    heads, kv_heads, dim, page = case
    lengths, args = _attention_case(*case)
    results = {}
    for variant in ("scalar", "twin", "isa"):
        if kernels.dp_attention_runs(variant):
            results[variant] = attention_through(variant)[CASES.index(case)]
    for variant, out in results.items():
        assert torch.equal(out, results["scalar"]), variant
    q, k_pool, v_pool, paged = args[:4]
    tables = paged.tables
    group = heads // kv_heads
    for r, n in enumerate(lengths):
        positions = torch.arange(n)
        slots = tables[r, positions // page] * page + positions % page
        keys = k_pool.view(kv_heads, -1, dim)[:, slots].float().repeat_interleave(group, 0)  # [H, n, D]
        values = v_pool.view(kv_heads, -1, dim)[:, slots].float().repeat_interleave(group, 0)
        weights = torch.softmax(q[r].float()[:, None, :] @ keys.transpose(1, 2) * dim**-0.5, dim=-1)
        expected = (weights @ values)[:, 0]
        assert torch.allclose(results["scalar"][r].float(), expected, atol=2e-2, rtol=2e-2)


_AVX2_RUN = """
import sys, torch
sys.path[:0] = [{here!r}, {tests!r}]  # this file, and the helpers in tests/
import test_attention_dp as t
torch.save(t.attention_through("twin"), {out!r})
"""


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.skipif("avx512f" not in cpu_flags().split(), reason="this CPU runs the AVX2 build: the tests above")
def test_an_avx2_builds_twin_gives_this_builds_bits(tmp_path, avx2_kernel_cache):
    """The kernels built for AVX2 (8-lane twin vectors) compute the attention of the native build's twin and
    instruction bit for bit: what an AVX2-only machine computes, checked on this one."""
    out = tmp_path / "avx2.pt"
    env = dict(os.environ, CBRUN_KERNEL_MARCH="x86-64-v3", CBRUN_CACHE=str(avx2_kernel_cache))
    script = _AVX2_RUN.format(here=str(Path(__file__).parent), tests=str(Path(__file__).parents[1]), out=str(out))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    native = attention_through(kernels.attend_dp_variant)
    for got, expected in zip(torch.load(out), native, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dim", [64, 48])  # 64: the pair-dot variants; 48 (not a multiple of 32): the bf16 chains
def test_each_output_is_rounded_once_to_the_nearest_bf16_ties_to_even(dim):
    """Two equal keys weigh 1/2 each, so every output is exactly the mean of two values, which is an fp32 value
    halfway between two bf16 values for an odd step: the kernel's output store must round it to even, lane by
    lane, as torch's conversion does (a truncating or half-up store fails here)."""
    torch.manual_seed(dim)
    heads, page = 3, 16
    first = torch.randn(dim).bfloat16()
    steps = (torch.arange(dim) % 3 + 1).to(torch.int16)  # 1 or 3 ulps apart: ties; 2: an exact bf16 mean
    second = (first.view(torch.int16) + steps).view(torch.bfloat16)
    mean = (first.float() + second.float()) / 2  # exact in fp32
    expected = mean.bfloat16()
    ties = mean != expected.float()
    assert ties.sum() >= dim // 2 and (expected.float().abs() < mean.abs()).any()  # ties rounded down too
    key = torch.randn(dim).bfloat16()
    k_pool = torch.zeros(1, 1, page, dim, dtype=torch.bfloat16)
    v_pool = torch.zeros(1, 1, page, dim, dtype=torch.bfloat16)
    k_pool[0, 0, :2] = key
    v_pool[0, 0, 0], v_pool[0, 0, 1] = first, second
    tables, zero, rows = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.arange(1)
    tasks = plan_tasks([SequenceRows(0, 1, 1, [0], 0)], page, kernels.segment, windowed=False)
    paged = PagedRows(tables, rows, zero, torch.tensor([2]), zero)
    args = (torch.randn(1, heads, dim).bfloat16(), k_pool, v_pool, paged)
    # dim 48 takes the bf16 chains whatever the pair-dot variant: one pass
    variants = [v for v in ("scalar", "twin", "isa") if kernels.dp_attention_runs(v)] if dim % 32 == 0 else [None]
    try:
        for variant in variants:
            kernels.attend_dp_variant = variant or kernels.attend_dp_variant
            out = kernels.attend(*args, tasks, dim**-0.5)  # [1, heads, dim]
            assert torch.equal(out[0].view(torch.int16), expected.expand(heads, dim).view(torch.int16)), variant
    finally:
        kernels.attend_dp_variant = choose_attention_dp_variant(kernels)
