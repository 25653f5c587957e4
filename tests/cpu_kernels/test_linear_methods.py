"""The bf16 linear methods (AMX's tdpbf16ps order) and the self-check that guards every linear method at load.

linear_dpbf16.c computes each output as AMX's tdpbf16ps does (tile_order.h):
K in 16-pair blocks, per block an even and an odd fma chain from +0, then
C = C + (E + O), denormal inputs read as zero and tiny results flushed. Four
variants must give the same bits: the tiles (only where the CPU has AMX-BF16),
re-paired vdpbf16ps (AVX512-BF16), portable vector FMAs under the CPU's flush
modes, and the plain-C reference; and the reference must equal an independent
model of the order in torch float64 (tests/amx_order.py). The
self-check must reject a method that is not batch-invariant and let the next
one serve.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from amx_order import amx_order_model

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear.method_selector import choose_linear_method
from cbrun.engine.backends.cpu.linear.methods import DP_AMX, DP_ISA, DP_SCALAR, DP_TWIN, F32, LinearMethod
from cbrun.engine.backends.cpu.linear.self_check import Shape, check_method

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the compiled CPU kernels cannot be built here")
HAS_ISA = kernels is not None and kernels.dp.variant_runs("isa")
HAS_AMX = kernels is not None and kernels.dp.variant_runs("amx")
VARIANTS = [
    "twin",
    pytest.param("isa", marks=pytest.mark.skipif(not HAS_ISA, reason="this CPU lacks AVX512-BF16")),
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="this CPU (or process) has no AMX-BF16 tiles")),
]
METHOD = {"twin": DP_TWIN, "isa": DP_ISA, "amx": DP_AMX}
SHAPES = [(1, 64, 32), (5, 33, 37), (9, 576, 64), (17, 100, 1), (40, 1536, 45)]  # (M, K, N): odd K, edge blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs compared by position only (the model's NaN payloads are not the point)."""
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return a.shape == b.shape and torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _random_bits(shape, generator) -> torch.Tensor:
    """bf16 values of every kind: random bit patterns (denormals, infinities, NaNs included)."""
    return (
        torch.randint(-32768, 32768, shape, generator=generator, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )


@pytest.mark.parametrize("rows,inner,outputs", SHAPES)
def test_the_plain_c_reference_is_the_amx_order_model(rows, inner, outputs):
    generator = torch.Generator().manual_seed(inner)
    for x, w in [
        (
            torch.randn(rows, inner, generator=generator).bfloat16(),
            torch.randn(outputs, inner, generator=generator).bfloat16(),
        ),
        (
            (torch.randn(rows, inner, generator=generator) * 1e-19).bfloat16(),  # denormal partial sums
            (torch.randn(outputs, inner, generator=generator) * 1e-19).bfloat16(),
        ),
    ]:
        got = DP_SCALAR.make(kernels, [w], [None])(x, torch.float32)
        assert _same_bits(got, amx_order_model(x, w))


def test_random_bit_patterns_follow_the_amx_order_model():
    generator = torch.Generator().manual_seed(3)
    x, w = _random_bits((7, 64), generator), _random_bits((40, 64), generator)
    assert _same_bits(DP_SCALAR.make(kernels, [w], [None])(x, torch.float32), amx_order_model(x, w))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,inner,outputs", SHAPES)
def test_each_variant_gives_the_reference_bits(variant, rows, inner, outputs):
    generator = torch.Generator().manual_seed(rows * 7 + inner)
    method = METHOD[variant]
    w = torch.randn(outputs, inner, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16()
    cases = [
        torch.randn(rows, inner, generator=generator).bfloat16(),
        torch.randn(rows, inner, generator=generator),  # fp32 x: rounded to bf16 first, by every variant
        (torch.randn(rows, inner, generator=generator) * 1e-19).bfloat16(),
        _random_bits((rows, inner), generator),
    ]
    for x in cases:
        for out_dtype in (torch.float32, torch.bfloat16):
            expected = DP_SCALAR.make(kernels, [w], [bias])(x, out_dtype)
            assert _same_bits(method.make(kernels, [w], [bias])(x, out_dtype), expected)
    up, up_bias = torch.randn(outputs, inner, generator=generator).bfloat16(), None
    gated = method.make(kernels, [w, up], [bias, up_bias], gated=True)(cases[0])
    assert _same_bits(gated, DP_SCALAR.make(kernels, [w, up], [bias, up_bias], gated=True)(cases[0]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_gets_the_same_bits_alone_and_in_any_crowd(variant):
    method = METHOD[variant]
    generator = torch.Generator().manual_seed(11)
    w = torch.randn(70, 576, generator=generator).bfloat16()
    layer = method.make(kernels, [w], [None])
    crowd = torch.randn(300, 576, generator=generator).bfloat16()
    alone = torch.cat([layer(crowd[i : i + 1], torch.float32) for i in range(0, 300, 37)])
    for size in (2, 8, 9, 63, 300):
        together = layer(crowd[:size], torch.float32)
        rows = list(range(0, size, 37))
        assert _same_bits(together[rows], alone[: len(rows)])


def test_a_packed_matrix_too_small_or_of_the_wrong_kind_is_refused_before_the_kernel_runs():
    """PairDotKernels checks the packed buffer as Int8Kernels does: never read or written past its end."""
    from cbrun.engine.backends.cpu.kernels.abi import KernelError

    dp = kernels.dp
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=generator).bfloat16()
    x = torch.randn(5, 96, generator=generator).bfloat16()
    packed = dp.pack(w)
    assert torch.equal(dp.unpack(packed, 96, count=40), w)
    short = packed[: dp.padded_inner(96) * dp.block_outputs]  # one block: outputs 0 .. block - 1 only
    with pytest.raises(KernelError, match="beyond the packed matrix"):
        dp.linear(x, short, 40, 96, "scalar")
    with pytest.raises(KernelError, match="beyond the packed matrix"):
        dp.pack_into(short, 96, w)
    with pytest.raises(KernelError, match="beyond the packed matrix"):
        dp.unpack(short, 96, count=40)
    with pytest.raises(KernelError, match="beyond the packed matrix"):
        dp.unpack(packed, 96, ids=torch.tensor([0, 1000]))
    with pytest.raises(KernelError, match="negative output id"):
        dp.unpack(packed, 96, ids=torch.tensor([-1]))
    with pytest.raises(KernelError, match="beyond the packed matrix"):  # a plain matrix holds half the gated outputs
        dp.linear(x, packed, 40, 96, "scalar", gated=True)
    with pytest.raises(KernelError, match="not contiguous int16"):
        dp.linear(x, packed.view(-1, 2)[:, 0], 40, 96, "scalar")  # every other element
    with pytest.raises(KernelError):
        dp.linear(x, packed.to(torch.int32), 40, 96, "scalar")
    assert dp.linear(x, packed, 40, 96, "scalar", out_dtype=torch.float32).shape == (5, 40)  # the right one runs


def test_side_by_side_weights_equal_each_weight_alone():
    """q|k|v packed as one weight give each projection's own bits (the fused layers rely on it)."""
    generator = torch.Generator().manual_seed(5)
    q, k = torch.randn(64, 96, generator=generator).bfloat16(), torch.randn(33, 96, generator=generator).bfloat16()
    kb = torch.randn(33, generator=generator).bfloat16()
    x = torch.randn(12, 96, generator=generator).bfloat16()
    both = DP_TWIN.make(kernels, [q, k], [None, kb])(x, torch.float32)
    assert _same_bits(both[:, :64], DP_TWIN.make(kernels, [q], [None])(x, torch.float32))
    assert _same_bits(both[:, 64:], DP_TWIN.make(kernels, [k], [kb])(x, torch.float32))


class _GrowsWithTheBatch:
    """A test double: right to rounding, but a row's result depends on how many rows share the call."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.float()

    def __call__(self, x: torch.Tensor, out_dtype=None) -> torch.Tensor:
        out = x.float() @ self.weight.T * (1 + 1e-6 * (x.shape[0] > 8))
        return out.to(out_dtype or x.dtype)


class _NotInvariant(LinearMethod):
    def make(self, kernels, weights, biases, gated=False):
        return _GrowsWithTheBatch(weights[0])


def test_the_self_check_rejects_a_method_whose_rows_depend_on_the_batch_and_the_next_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    bogus = _NotInvariant("test-not-invariant", torch.bfloat16, True, "double")
    shapes = [Shape(48, 64)]
    choice = choose_linear_method(kernels, torch.bfloat16, shapes, candidates=[bogus, DP_TWIN])
    assert choice.method is DP_TWIN
    assert [c.passed for c in choice.checks] == [False, True]
    assert "not batch-invariant" in choice.checks[0].detail
    assert "skipped test-not-invariant" in choice.summary()


def test_a_variant_that_differs_from_the_reference_is_rejected(tmp_path, monkeypatch):
    """A pair-dot variant whose sums are right but not the instruction's (here: plain fp32 sums in k order,
    as the widened kernel does) is invariant yet fails the twin-equality check."""
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    widened = LinearMethod("test-widened", torch.bfloat16, True, "linear")
    wrong_twin = _Relabelled("dpbf16-wrong", torch.bfloat16, True, "dp", "twin", inner=widened)
    result = check_method(kernels, wrong_twin, [Shape(40, 576)])
    assert not result.passed and "plain-C reference" in result.detail


class _Relabelled(LinearMethod):
    """A method that claims to be a pair-dot variant but computes with another method's kernel."""

    def __init__(self, *args, inner: LinearMethod):
        super().__init__(*args)
        object.__setattr__(self, "_inner", inner)

    def make(self, kernels, weights, biases, gated=False):
        return self._inner.make(kernels, weights, biases, gated)


def test_self_check_results_are_cached_per_build_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    shapes = [Shape(32, 64)]
    first = check_method(kernels, DP_TWIN, shapes, cache_key=kernels.build_name)
    again = check_method(kernels, DP_TWIN, shapes, cache_key=kernels.build_name)
    assert first.passed and not first.cached
    assert again.passed and again.cached and again.seconds == 0.0
    assert (tmp_path / "kernels" / "self_check.json").exists()


def test_the_portable_policy_races_the_methods_of_the_one_order_that_run_here(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    choice = choose_linear_method(kernels, torch.bfloat16, [Shape(40, 96)], "portable")
    raced = [m for m in (DP_AMX, DP_ISA, DP_TWIN) if m.runs_on(kernels)]
    assert choice.method in raced
    if len(raced) > 1:  # a timed trial among the methods of the one order that run here picked the fastest
        assert len(choice.checks) == len(raced) and all(c.trial_ms > 0 for c in choice.checks if c.passed)
    assert kernels.dp.variant_runs("amx") == ({"amx_bf16", "amx_tile"} <= set(cpu_flags().split()))
    assert choose_linear_method(kernels, torch.float32, [Shape(40, 96)], "portable").method is F32
    assert kernels.dp.variant_runs("isa") == bool({"avx512_bf16"} & set(cpu_flags().split()))


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None,
    reason="the ISA source compiles with gcc on x86-64",
)
@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@pytest.mark.parametrize("march", ["x86-64-v3", "haswell", "znver3", "znver4", "sapphirerapids"])
def test_every_kernel_source_compiles_without_warnings_for_every_x86_target(march, tmp_path):
    """The vdpbf16ps code carries its own target attribute, so a typo cannot hide until a user's CPU runs it;
    and no source may warn under -Wall -Wextra (the user's build reports warnings, this test fails on them).
    Targets from AVX2 up: the kernels keep vectors in AVX registers and need at least AVX2 and FMA."""
    sources = sorted(
        (Path(__file__).resolve().parents[2] / "cbrun" / "engine" / "backends" / "cpu" / "csrc").glob("*.c")
    )
    assert sources, "no kernel source found"
    for source in sources:
        result = subprocess.run(
            [
                "gcc",
                "-O2",
                f"-march={march}",
                "-ffp-contract=fast",
                "-fopenmp",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-Wno-psabi",
                "-c",
                str(source),
                "-o",
                str(tmp_path / "k.o"),
            ],
            capture_output=True,
            text=True,
        )
        if "unrecognized" in result.stderr or "bad value" in result.stderr:
            pytest.skip(f"this gcc does not know -march={march}")
        assert result.returncode == 0, f"{source.name}: {result.stderr}"


def _near_underflow(shape, generator) -> torch.Tensor:
    """bf16 values whose products and sums cross the flush threshold: magnitudes 2^-70 .. 2^-56 (products near
    2^-126), both signs, some exact zeros of both signs."""
    exponent = torch.randint(-70, -55, shape, generator=generator).double()
    sign = torch.randint(0, 2, shape, generator=generator).double() * 2 - 1
    mantissa = 1 + torch.randint(0, 128, shape, generator=generator).double() / 128
    values = (sign * mantissa * 2.0**exponent).to(torch.bfloat16)
    zeros = torch.rand(shape, generator=generator) < 0.1
    return torch.where(zeros, torch.copysign(torch.zeros_like(values), values), values)


@pytest.mark.parametrize("variant", ["scalar", *VARIANTS])
def test_every_tail_of_1_to_15_pairs_follows_the_model(variant):
    """K = 32 b + 2 t (and odd K) for every tail of t = 1 .. 15 pairs: the padded block's zero pairs are computed
    as the tiles compute them (a -0 chain becomes +0), near-underflow values and signed zeros included."""
    method = {"scalar": DP_SCALAR, **METHOD}[variant]
    generator = torch.Generator().manual_seed(15)
    for tail in range(1, 16):
        for inner in (32 + 2 * tail, 64 + 2 * tail - 1):
            x, w = _near_underflow((3, inner), generator), _near_underflow((20, inner), generator)
            x[0] = -0.0  # a row of negative zeros: every chain -0 until the padding
            assert _same_bits(method.make(kernels, [w], [None])(x, torch.float32), amx_order_model(x, w)), inner
            typical = torch.randn(5, inner, generator=generator).bfloat16()
            got = method.make(kernels, [w * 2.0**60], [None])(typical, torch.float32)
            assert _same_bits(got, amx_order_model(typical, w * 2.0**60)), inner


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("inner", [64, 100, 4864, pytest.param(14336, marks=pytest.mark.slow)])
def test_each_variant_equals_the_reference_at_model_widths_and_many_rows(variant, inner):
    """K up to an 8B model's MLP width (chained blocks, K steps), M from 1 to 300 (row groups, chunks)."""
    generator = torch.Generator().manual_seed(inner)
    w = (torch.randn(48, inner, generator=generator) / inner**0.5).bfloat16()
    x = torch.randn(300, inner, generator=generator).bfloat16()
    x[7] = _near_underflow((inner,), generator)
    reference = DP_SCALAR.make(kernels, [w], [None])(x, torch.float32)
    layer = METHOD[variant].make(kernels, [w], [None])
    for rows in (1, 5, 16, 17, 300):
        assert _same_bits(layer(x[:rows], torch.float32), reference[:rows]), rows
