"""bf16 attention in AMX's order: every variant gives the reference's bits, and the reference is the tiles' order.

attention.c computes bf16 attention (head sizes of whole 32-element blocks) as AMX's tdpbf16ps would: each score
one chain of 16-pair blocks over the head (an even and an odd fma chain per block, then C + (E + O)), each output
dim one chain of 32-key blocks over the keys at absolute positions, with the softmax weights rounded to bf16.
The plain-C reference is checked against the torch model of the order (tests/amx_order.py); the portable twin and
the AMX tiles (where this CPU has them) against the reference, bitwise, at head sizes 32-256, every count of keys
1-128 (the tails of every length) and values at the flush threshold; the load check keeps a variant that differs
out; and whole attention calls through each variant agree bitwise and stay within bf16 tolerance of fp32 attention.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from amx_order import amx_order_model

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.isa_variants import (
    ATTENTION_VARIANTS,
    choose_attention_dp_variant,
    probe_scores,
    probe_values,
)
from cbrun.engine.backends.cpu.kernels.loader import build_kernels, load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")
FLT_MIN = 2.0**-126


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _edge_values(shape, generator) -> torch.Tensor:
    """bf16 values around the flush threshold: normals just above 2^-126, denormals, signed zeros, and ordinary
    values, so products and partial sums land on both sides of it."""
    pool = torch.tensor([FLT_MIN, -FLT_MIN, FLT_MIN * 1.5, 2.0**-127, -(2.0**-130), 0.0, -0.0, 1.0, -1.5, 2.0**-63])
    picks = torch.randint(0, len(pool), shape, generator=generator)
    return (pool[picks] * (1 + torch.rand(shape, generator=generator))).to(torch.bfloat16)


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_the_reference_is_the_amx_order(dim):
    """Scores: the model of q [G, D] x keys [n, D], then the scale (flushed); values: the model of the weights
    rounded to bf16 [G, n] x values^T [D, n], keys in blocks of 32 from position 0."""
    generator = torch.Generator().manual_seed(dim)
    cases = [
        (torch.randn(3, dim, generator=generator), torch.randn(21, dim, generator=generator)),
        (torch.randn(2, dim, generator=generator) * 1e-19, torch.randn(9, dim, generator=generator) * 1e-19),
        (torch.randn(3, dim, generator=generator) * 1e-39, torch.randn(5, dim, generator=generator)),
    ]
    for q, keys in cases:
        q, keys = q.to(torch.bfloat16), keys.to(torch.bfloat16)
        expected = amx_order_model(q, keys) * torch.tensor(0.3)
        expected = torch.where(expected.abs() < FLT_MIN, expected * 0, expected)
        assert torch.equal(_bits(kernels.attend_dp_scores("scalar", q, keys, 0.3)), _bits(expected))
    for count in (1, 31, 33, 128):
        weights = torch.rand(4, count, generator=generator)
        values = torch.randn(count, dim, generator=generator).to(torch.bfloat16)
        got = kernels.attend_dp_values("scalar", weights, values)
        assert torch.equal(_bits(got), _bits(amx_order_model(weights.to(torch.bfloat16), values.t())))
    edge = _edge_values((6, 64), generator)
    got = kernels.attend_dp_values("scalar", edge.float().abs(), _edge_values((64, dim), generator))
    assert torch.isfinite(got).all()


RUNS = [variant for variant in ATTENTION_VARIANTS if kernels is not None and kernels.dp_attention_runs(variant)]


WHY_NOT = {
    "amx": "no AMX-BF16 here (or Linux did not grant the tile state): the tiles' check waits for such a CPU",
    "isa": "no AVX512-BF16 here: vdpbf16ps waits for such a CPU (its re-pairing is checked in an emulating build)",
}


@pytest.mark.parametrize("variant", ["twin", "isa", "amx"])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_each_variant_gives_the_references_bits(variant, dim):
    if variant not in RUNS:
        pytest.skip(WHY_NOT[variant])
    generator = torch.Generator().manual_seed(dim + 1)
    q = torch.randn(7, dim, generator=generator).to(torch.bfloat16)
    keys = torch.randn(128, dim, generator=generator).to(torch.bfloat16)
    weights = torch.rand(7, 128, generator=generator)
    values = torch.randn(128, dim, generator=generator).to(torch.bfloat16)
    cases = [
        (q, keys, weights, values),
        (
            _edge_values((7, dim), generator),
            _edge_values((128, dim), generator),
            _edge_values((7, 128), generator).float().abs(),
            _edge_values((128, dim), generator),
        ),
    ]
    for q, keys, weights, values in cases:
        for count in [*range(1, 34), 45, 64, 100, 127, 128]:  # every tail of the lanes and of a 32-key block
            for heads in (1, 2, 3, 7):
                expected = kernels.attend_dp_scores("scalar", q[:heads], keys[:count], 0.125)
                assert torch.equal(
                    _bits(kernels.attend_dp_scores("twin", q[:heads], keys[:count], 0.125)), _bits(expected)
                ), (count, heads)
                expected = kernels.attend_dp_values("scalar", weights[:heads, :count], values[:count])
                assert torch.equal(
                    _bits(kernels.attend_dp_values("twin", weights[:heads, :count], values[:count])), _bits(expected)
                ), (count, heads)
    for probe in probe_scores(seed=3):
        assert torch.equal(
            _bits(kernels.attend_dp_scores("twin", *probe, 0.125)),
            _bits(kernels.attend_dp_scores("scalar", *probe, 0.125)),
        )
    for probe in probe_values(seed=3):
        assert torch.equal(
            _bits(kernels.attend_dp_values("twin", *probe)), _bits(kernels.attend_dp_values("scalar", *probe))
        )


@pytest.mark.parametrize("variant", ["twin", "isa", "amx"])
def test_a_padded_tail_turns_a_negative_zero_sum_positive(variant):
    """The one place a key-less pair shows: block 0 leaves C = 1.5 x 2^-126, block 1 adds -2^-125 and flushes C to
    -0, block 2 holds two keys whose products flush to -0, so E = O = -0; its 14 padded pairs make E and O +0, as the
    tiles' zero padding does, and C = -0 + (+0 + +0) = +0 (without them, -0)."""
    if variant not in RUNS:
        pytest.skip(WHY_NOT[variant])
    weights = torch.ones(1, 66)
    weights[0, 64:] = 0.5
    values = torch.zeros(66, 64)
    values[0], values[32], values[64:] = 1.5 * FLT_MIN, -2 * FLT_MIN, -FLT_MIN
    values = values.to(torch.bfloat16)
    expected = amx_order_model(weights.to(torch.bfloat16), values.t())
    assert torch.equal(_bits(expected), torch.zeros(1, 64, dtype=torch.int32))  # +0, not -0
    assert torch.equal(_bits(kernels.attend_dp_values("scalar", weights, values)), _bits(expected))
    assert torch.equal(_bits(kernels.attend_dp_values(variant, weights, values)), _bits(expected))


class _Disagreeing:
    """Kernels whose twin is off by one bit in one score or one value sum: the load check must not keep it."""

    def __init__(self, real, part):
        self.real, self.part = real, part

    def dp_attention_runs(self, variant: str) -> bool:
        return variant == "twin"  # the one candidate, whatever this CPU has

    def attend_dp_scores(self, variant, q, keys, scale):
        out = self.real.attend_dp_scores(variant, q, keys, scale)
        if variant == "twin" and self.part == "scores":
            out.view(torch.int32)[0, 0] ^= 1
        return out

    def attend_dp_values(self, variant, weights, values):
        out = self.real.attend_dp_values(variant, weights, values)
        if variant == "twin" and self.part == "values":
            out.view(torch.int32)[-1, -1] ^= 1
        return out


@pytest.mark.parametrize("part", ["scores", "values"])
def test_the_load_check_skips_a_twin_that_differs_and_the_reference_serves(part):
    assert choose_attention_dp_variant(_Disagreeing(kernels, part)) == "scalar"
    assert choose_attention_dp_variant(_Disagreeing(kernels, "neither")) == "twin"
    if platform.machine() in ("x86_64", "AMD64"):  # vector FMAs under MXCSR FTZ|DAZ: the twin equals the reference
        assert kernels.attend_dp_variant in RUNS and kernels.attend_dp_variant != "scalar"


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


PAIRED_RUNS = [variant for variant in RUNS if variant != "amx"]  # the tiles read key rows


def _paired(kernels_, k_pool: torch.Tensor) -> torch.Tensor:
    """k_pool's keys written as an engine's pool of paired keys holds them (write_kv(paired=True)): pair p of the
    key in slot x at word p * P + x of its page, checked against torch's permutation of the rows."""
    heads, blocks, page, dim = k_pool.shape
    paired = torch.full_like(k_pool, float("nan"))
    kernels_.write_kv(paired, k_pool.view(heads, blocks * page, dim), torch.arange(blocks * page), paired=True)
    expected = k_pool.view(heads, blocks, page, dim // 2, 2).transpose(2, 3).contiguous()
    assert torch.equal(paired.view(torch.int16).view(expected.shape), expected.view(torch.int16))
    return paired


def attention_through(variant: str) -> list[torch.Tensor]:
    """Every case's attention output through one variant (used by the AVX2-build subprocess too)."""
    kernels.attend_dp_variant = variant
    try:
        return [kernels.attend(*_attention_case(*case)[1]) for case in CASES]
    finally:
        kernels.attend_dp_variant = choose_attention_dp_variant(kernels)


def paired_attention_through(variant: str) -> list[torch.Tensor]:
    """attention_through over paired keys (an engine's pools where a vector variant serves)."""
    kernels.attend_dp_variant = variant
    try:
        outs = []
        for case in CASES:
            args = _attention_case(*case)[1]
            outs.append(kernels.attend(args[0], _paired(kernels, args[1]), *args[2:], paired_keys=True))
        return outs
    finally:
        kernels.attend_dp_variant = choose_attention_dp_variant(kernels)


@pytest.mark.parametrize("case", CASES)
def test_attention_through_every_variant_is_one_result(case):
    """Whole attention calls give the same bits through each variant that runs here, within bf16 tolerance of
    fp32 attention."""
    heads, kv_heads, dim, page = case
    lengths, args = _attention_case(*case)
    results = {}
    for variant in RUNS:
        results[variant] = attention_through(variant)[CASES.index(case)]
    for variant, out in results.items():
        assert torch.equal(out, results["scalar"]), variant
    q, k_pool, v_pool, paged = args[:4]
    paired = (q, _paired(kernels, k_pool), *args[2:])
    for variant in PAIRED_RUNS:  # the engine's pools of paired keys: the same bits
        kernels.attend_dp_variant = variant
        try:
            assert torch.equal(kernels.attend(*paired, paired_keys=True), results["scalar"]), variant
        finally:
            kernels.attend_dp_variant = choose_attention_dp_variant(kernels)
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


def _window_case(scale: float, page: int = 16) -> tuple:
    """Decode rows of 1-257 keys whose sliding windows start and end anywhere in a 32-key value block (pairs before
    the first key, a pair with only its odd key); values scaled by `scale` (1e-37: products and sums through the
    flush threshold, signed zeros). Returns attend's arguments but the tasks and the scale."""
    torch.manual_seed(11)
    heads, kv_heads, dim = 6, 2, 64
    lengths = list(range(1, 80, 3)) + [200, 257]
    max_pages = (max(lengths) + page - 1) // page
    blocks = len(lengths) * max_pages
    k_pool = torch.randn(kv_heads, blocks, page, dim).bfloat16()
    v_pool = (torch.randn(kv_heads, blocks, page, dim) * scale).bfloat16()
    tables = torch.randperm(blocks).view(len(lengths), max_pages)
    seqs = [SequenceRows(i, n - 1, 1, t.tolist(), 0) for i, (t, n) in enumerate(zip(tables, lengths))]
    kv_len = torch.tensor(lengths)
    kv_lo = (kv_len - torch.tensor([1 + 7 * i % 45 for i in range(len(lengths))])).clamp(min=0)
    rows = torch.arange(len(lengths))
    paged = PagedRows(tables, rows, torch.zeros(len(lengths), dtype=torch.long), kv_len, kv_lo)
    return (torch.randn(len(lengths), heads, dim).bfloat16(), k_pool, v_pool, paged), seqs, page, dim


def _through(kernels_, variants, scale, paired: bool = False) -> dict:
    """The window case's attention through each variant of `kernels_` (its served variant restored after), over
    key rows or (paired) paired keys."""
    args, seqs, page, dim = _window_case(scale)
    if paired:
        args = (args[0], _paired(kernels_, args[1]), *args[2:])
    tasks = plan_tasks(seqs, page, kernels_.segment, windowed=True)
    served, outs = kernels_.attend_dp_variant, {}
    try:
        for variant in variants:
            kernels_.attend_dp_variant = variant
            outs[variant] = kernels_.attend(*args, tasks, dim**-0.5, paired_keys=paired)
    finally:
        kernels_.attend_dp_variant = served
    return outs


@pytest.mark.parametrize("scale", [1.0, 1e-37])
def test_sliding_windows_give_every_variant_the_references_bits(scale):
    outs = _through(kernels, RUNS, scale)
    for variant, out in outs.items():
        assert torch.equal(out.view(torch.int16), outs["scalar"].view(torch.int16)), variant
    for variant, out in _through(kernels, PAIRED_RUNS, scale, paired=True).items():
        assert torch.equal(out.view(torch.int16), outs["scalar"].view(torch.int16)), ("paired", variant)


@pytest.fixture(scope="module")
def emulating():
    """Kernels built with -DCBRUN_TA_ISA_EMULATE at 8 and 16 lanes: the isa variant's re-pairing, with vdpbf16ps
    computed by its definition (the pair's high products first) in portable FMAs, so it runs on any CPU."""
    try:
        return {width: build_kernels(("CBRUN_TA_ISA_EMULATE", f"CBRUN_VEC_WIDTH={width}")) for width in (8, 16)}
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")


@pytest.mark.parametrize("width", [8, 16])
def test_the_isa_variants_re_pairing_gives_the_references_bits(emulating, width):
    """What a CPU with AVX512-BF16 runs, but for the instruction itself (which the load check compares there)."""
    built = emulating[width]
    assert built.dp_attention_runs("isa")
    generator = torch.Generator().manual_seed(width)
    for dim in (32, 64, 128, 256):
        typical = (
            torch.randn(7, dim, generator=generator).bfloat16(),
            torch.randn(70, dim, generator=generator).bfloat16(),
        )
        for q, keys in [typical, (_edge_values((7, dim), generator), _edge_values((70, dim), generator))]:
            for count in (1, 7, 8, 9, 16, 17, 70):
                for heads in (1, 2, 3, 7):
                    expected = built.attend_dp_scores("scalar", q[:heads], keys[:count], 0.125)
                    got = built.attend_dp_scores("isa", q[:heads], keys[:count], 0.125)
                    assert torch.equal(_bits(got), _bits(expected)), (dim, count, heads)
    for scale in (1.0, 1e-37):
        outs = _through(built, ("scalar", "isa"), scale)
        assert torch.equal(outs["isa"].view(torch.int16), outs["scalar"].view(torch.int16))
        paired = _through(built, ("isa",), scale, paired=True)["isa"]
        assert torch.equal(paired.view(torch.int16), outs["scalar"].view(torch.int16))
        assert torch.equal(
            outs["scalar"].view(torch.int16), _through(kernels, ["scalar"], scale)["scalar"].view(torch.int16)
        )


_AVX2_RUN = """
import sys, torch
sys.path[:0] = [{here!r}, {tests!r}]  # this file, and the helpers in tests/
import test_attention_dp as t
torch.save(t.attention_through("twin") + t.paired_attention_through("twin"), {out!r})
"""


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.skipif("avx512f" not in cpu_flags().split(), reason="this CPU runs the AVX2 build: the tests above")
def test_an_avx2_builds_twin_gives_this_builds_bits(tmp_path, avx2_kernel_cache):
    """The kernels built for AVX2 (8-lane twin vectors) compute the attention of the native build's twin bit for
    bit: what an AVX2-only machine computes, checked on this one."""
    out = tmp_path / "avx2.pt"
    env = dict(os.environ, CBRUN_KERNEL_MARCH="x86-64-v3", CBRUN_CACHE=str(avx2_kernel_cache))
    script = _AVX2_RUN.format(here=str(Path(__file__).parent), tests=str(Path(__file__).parents[1]), out=str(out))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    served = kernels.attend_dp_variant
    native = attention_through(served) + paired_attention_through(served if served != "amx" else "twin")
    for got, expected in zip(torch.load(out), native, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dim", [64, 48])  # 64: AMX's order; 48 (not a multiple of 32): the bf16 chains
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
    # dim 48 takes the bf16 chains whatever the AMX-order variant: one pass
    variants = list(RUNS) if dim % 32 == 0 else [None]
    try:
        for variant in variants:
            kernels.attend_dp_variant = variant or kernels.attend_dp_variant
            out = kernels.attend(*args, tasks, dim**-0.5)  # [1, heads, dim]
            assert torch.equal(out[0].view(torch.int16), expected.expand(heads, dim).view(torch.int16)), variant
    finally:
        kernels.attend_dp_variant = choose_attention_dp_variant(kernels)
