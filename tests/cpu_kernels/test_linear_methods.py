"""The bf16 pair-dot linear methods and the self-check that guards every linear method at load.

linear_dpbf16.c computes each output as AVX512-BF16's vdpbf16ps would: a chain
over k-pairs, per pair t = fma(x[2p+1], w[2p+1], acc), acc = fma(x[2p], w[2p], t),
denormal inputs read as zero and denormal results flushed. Three variants must
give the same bits: the instruction itself (only where the CPU has it), its
portable twin (vector FMAs under the CPU's flush modes) and the plain-C
reference; and the reference must equal an independent model of the
instruction written here in torch float64 (exact for bf16 products, see
`_instruction_model`). The self-check must reject a method that is not
batch-invariant and let the next one serve.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cbrun.engine.backends.cpu.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.kernel_loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear_methods import DP_ISA, DP_SCALAR, DP_TWIN, F32, LinearMethod
from cbrun.engine.backends.cpu.method_selector import choose_linear_method
from cbrun.engine.backends.cpu.self_check import Shape, check_method

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the compiled CPU kernels cannot be built here")
HAS_ISA = kernels is not None and kernels.dp.variant_runs("isa")
VARIANTS = ["twin", pytest.param("isa", marks=pytest.mark.skipif(not HAS_ISA, reason="this CPU lacks AVX512-BF16"))]
SHAPES = [(1, 64, 32), (5, 33, 37), (9, 576, 64), (17, 100, 1), (40, 1536, 45)]  # (M, K, N): odd K, edge blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs compared by position only (the model's NaN payloads are not the point)."""
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return a.shape == b.shape and torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _instruction_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps's chain in torch: bf16 x [M, K], w [N, K] -> fp32 [M, N].

    fma(a, b, c) for bf16 a, b and fp32 c is computed in float64 and rounded
    once to fp32: a * b is exact in float64 (16 significant bits), and where the
    float64 sum is inexact the smaller term is below 2^-29 of the larger, which
    lies on the fp32 grid, so the second rounding cannot cross an fp32 midpoint.
    """

    def read(t):  # denormal inputs read as zero (bf16 shares fp32's exponent range)
        t = t.double()
        return torch.where(t.abs() < 2.0**-126, torch.zeros_like(t) * torch.sign(t), t)

    def flush(t):
        return torch.where(t.abs() < 2.0**-126, torch.copysign(torch.zeros_like(t), t), t)

    if x.shape[1] % 2:
        x, w = torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    xs, ws = read(x), read(w)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for p in range(x.shape[1] // 2):
        t = flush((xs[:, 2 * p + 1, None] * ws[None, :, 2 * p + 1] + acc.double()).float())
        acc = flush((xs[:, 2 * p, None] * ws[None, :, 2 * p] + t.double()).float())
    return acc


def _random_bits(shape, generator) -> torch.Tensor:
    """bf16 values of every kind: random bit patterns (denormals, infinities, NaNs included)."""
    return (
        torch.randint(-32768, 32768, shape, generator=generator, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )


@pytest.mark.parametrize("rows,inner,outputs", SHAPES)
def test_the_plain_c_reference_is_the_instruction_model(rows, inner, outputs):
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
        assert _same_bits(got, _instruction_model(x, w))


def test_random_bit_patterns_follow_the_instruction_model():
    generator = torch.Generator().manual_seed(3)
    x, w = _random_bits((7, 64), generator), _random_bits((40, 64), generator)
    assert _same_bits(DP_SCALAR.make(kernels, [w], [None])(x, torch.float32), _instruction_model(x, w))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,inner,outputs", SHAPES)
def test_each_variant_gives_the_reference_bits(variant, rows, inner, outputs):
    generator = torch.Generator().manual_seed(rows * 7 + inner)
    method = {"twin": DP_TWIN, "isa": DP_ISA}[variant]
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
    method = {"twin": DP_TWIN, "isa": DP_ISA}[variant]
    generator = torch.Generator().manual_seed(11)
    w = torch.randn(70, 576, generator=generator).bfloat16()
    layer = method.make(kernels, [w], [None])
    crowd = torch.randn(300, 576, generator=generator).bfloat16()
    alone = torch.cat([layer(crowd[i : i + 1], torch.float32) for i in range(0, 300, 37)])
    for size in (2, 8, 9, 63, 300):
        together = layer(crowd[:size], torch.float32)
        rows = list(range(0, size, 37))
        assert _same_bits(together[rows], alone[: len(rows)])


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


def test_the_portable_policy_picks_the_instruction_where_the_cpu_has_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    choice = choose_linear_method(kernels, torch.bfloat16, [Shape(40, 96)], "portable")
    assert choice.method is (DP_ISA if HAS_ISA else DP_TWIN)
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
