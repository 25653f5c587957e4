"""The int8 (W8A8) linear kernel and its methods: exact integer sums, one arithmetic around them.

linear_int8.c quantizes each row of x on its own (amax / 127, round half to
even), sums int8 products in int32, and scales each sum with one fma. Here the
plain-C reference is checked against torch models of each step (the int32
sums against int64 matrix products, the quantization and the epilogue against
their formulas), and every ISA variant (AVX2, AVX512-VNNI, AMX-INT8, where this
CPU has it) against the reference, bitwise; the overflow bound is checked at
its edge, where VNNI's offset arithmetic wraps. The layer method is checked
for its members, weight read-back, reloads and the self-check's verdicts.
"""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.backends.cpu.kernels.abi import KernelError
from cbrun.engine.backends.cpu.kernels.int8 import dequantize_weight, quantize_weight
from cbrun.engine.backends.cpu.kernels.loader import build_kernels, load_cpu_kernels
from cbrun.engine.backends.cpu.linear.int8 import (
    INT8_AVX2,
    INT8_METHODS,
    INT8_SCALAR,
    PREQUANTIZED,
    Int8Method,
    int8_form,
)
from cbrun.engine.backends.cpu.linear.method_selector import choose_linear_method
from cbrun.engine.backends.cpu.linear.self_check import Shape, check_method

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the compiled CPU kernels cannot be built here")
i8 = kernels.int8 if kernels is not None else None
ISA = ["avx2", "vnni", "amx"]
VARIANTS = [
    pytest.param(v, marks=pytest.mark.skipif(i8 is None or not i8.variant_runs(v), reason=f"this CPU cannot run {v}"))
    for v in ISA
]
MAX_K = 132104  # the largest K with K * 127 * 128 < 2^31


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _packed(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    packed = i8.packed(q.shape[0], q.shape[1])
    i8.pack_into(packed, q.shape[1], q, scale)
    return packed


def _problem(rows: int, inner: int, outputs: int, seed: int, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, inner, generator=generator) * 3).to(dtype)
    x[0, inner // 2] = 40.0  # an outlier: the row's scale follows it
    weight = (torch.randn(outputs, inner, generator=generator) / inner**0.5).to(dtype)
    bias = torch.randn(outputs, generator=generator)
    return x, weight, bias


def _quantize_model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The header's activation arithmetic in torch: fp32 amax / 127, x * (127 / amax) rounded half to even."""
    wide = x.float()
    amax = wide.abs().amax(dim=1)  # [M]
    usable = (amax >= 2.0**-100) & amax.isfinite()
    inv = torch.where(usable, torch.tensor(127.0) / torch.where(usable, amax, torch.ones_like(amax)), 0.0)
    q = torch.round((wide * inv[:, None]).clamp(-127, 127)).to(torch.int8)
    return q, torch.where(usable, amax / 127.0, 0.0)


# -- the reference against torch models -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_by_the_documented_arithmetic(dtype):
    x, _, _ = _problem(37, 300, 1, seed=1, dtype=dtype)
    x[3] = 0.0  # a zero row
    x[4] = 1e-35  # below 2^-100: a zero row, whatever the flush modes
    x[5, :7] = torch.tensor([0.5, -0.5, 1.5, -2.5, 127.0, -127.0, 63.5]).to(dtype)  # ties round to even
    x[5, 7:] = 0.0
    q, scale = i8.quantize_rows(x)
    q_model, scale_model = _quantize_model(x)
    assert torch.equal(q, q_model)
    assert torch.equal(_bits(scale), _bits(scale_model))
    assert scale[3] == 0 and scale[4] == 0 and not q[3:5].any()
    assert q[5, :7].tolist() == [0, -0, 2, -2, 127, -127, 64]  # 127 / 127 = 1: x itself, rounded half to even


@pytest.mark.parametrize("rows,inner,outputs", [(1, 64, 32), (5, 100, 37), (17, 896, 70), (40, 1000, 96)])
def test_the_reference_sums_exactly_and_scales_with_one_fma(rows, inner, outputs):
    x, weight, bias = _problem(rows, inner, outputs, seed=inner)
    q, scale = quantize_weight(weight)
    packed = _packed(q, scale)
    sums = i8.linear(x, packed, outputs, inner, "scalar", mode="int")
    qx, sx = i8.quantize_rows(x)
    exact = qx.long() @ q.long().T  # [M, N] int64
    assert torch.equal(sums.long(), exact)
    y = i8.linear(x, packed, outputs, inner, "scalar", bias=bias, out_dtype=torch.float32)
    # fma(acc, s, b): acc * s is exact in float64 (24 + 24 bits), then one rounding to fp32 after the add
    # (float64 then fp32 rounds twice; the sums here stay clear of the rare double-rounding cases)
    product_scale = (sx[:, None] * scale[None, :]).double()  # fp32 products, rounded once
    model = (exact.double() * product_scale + bias.double()).float()
    assert torch.equal(_bits(y), _bits(model))
    # a bf16 output is the fp32 one rounded once to nearest even (whole 16-lane pieces and the tail alike)
    y_bf16 = i8.linear(x, packed, outputs, inner, "scalar", bias=bias, out_dtype=torch.bfloat16)
    assert torch.equal(_bits(y_bf16), _bits(y.bfloat16()))
    no_bias = i8.linear(x, packed, outputs, inner, "scalar", out_dtype=torch.float32)
    assert torch.equal(_bits(no_bias), _bits(exact.float() * (sx[:, None] * scale[None, :])))


def test_weights_quantize_per_output_channel_and_round_trip_through_the_pack():
    _, weight, _ = _problem(1, 200, 45, seed=3)
    weight[7] = 0.0
    q, scale = quantize_weight(weight)
    wide = weight.float()
    assert torch.equal(scale, wide.abs().amax(dim=1) / 127) and scale[7] == 0 and not q[7].any()
    assert q.abs().amax(dim=1)[:7].eq(127).all()  # each channel's largest weight maps to +-127
    assert torch.equal(q[0], torch.round(wide[0] / scale[0]).to(torch.int8))
    packed = _packed(q, scale)
    back_q, back_scale = i8.unpack(packed, 200, first=0, count=45)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)
    some_q, _ = i8.unpack(packed, 200, ids=torch.tensor([44, 0, 31]))
    assert torch.equal(some_q, q[[44, 0, 31]])


# -- the variants against the reference ---------------------------------------------------------------


def _every_output(x, packed, outputs, inner, variant, bias):
    return [
        i8.linear(x, packed, outputs, inner, variant, mode="int"),
        i8.linear(x, packed, outputs, inner, variant, bias=bias, out_dtype=torch.float32),
        i8.linear(x, packed, outputs, inner, variant, bias=bias, out_dtype=torch.bfloat16),
    ]


def _assert_variant_equals_the_reference(variant, rows, inner, outputs, seed):
    x, weight, bias = _problem(rows, inner, outputs, seed=seed)
    q, scale = quantize_weight(weight)
    q[0, :5] = -128  # a checkpoint's weights may reach -128
    packed = _packed(q, scale)
    for got, want in zip(
        _every_output(x, packed, outputs, inner, variant, bias),
        _every_output(x, packed, outputs, inner, "scalar", bias),
    ):
        assert torch.equal(_bits(got), _bits(want)), (variant, rows, inner, outputs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows,inner,outputs", [(1, 896, 70), (33, 896, 96), (9, 1000, 37)])
def test_each_variant_gives_the_reference_bits(variant, rows, inner, outputs):
    _assert_variant_equals_the_reference(variant, rows, inner, outputs, seed=rows + inner)


@pytest.mark.slow  # about half a minute of plain-C sums: the full suite only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("inner", [896, 1536, 4864, 8960])
def test_each_variant_gives_the_reference_bits_at_real_shapes(variant, inner):
    for rows in (1, 7, 64, 300):
        _assert_variant_equals_the_reference(variant, rows, inner, 96 + inner % 32, seed=rows * inner)


@pytest.mark.parametrize("variant", ["scalar", *VARIANTS])
def test_gated_silu_and_raw_members_are_the_same_sums_in_every_variant(variant):
    x, gate, bias = _problem(19, 576, 40, seed=5)
    up = (torch.randn(40, 576, generator=torch.Generator().manual_seed(6)) / 24).bfloat16()
    (qg, sg), (qu, su) = quantize_weight(gate), quantize_weight(up)
    packed = i8.packed(40, 576, gated=True)
    i8.pack_into(packed, 576, qg, sg, "gate")
    i8.pack_into(packed, 576, qu, su, "up")
    raw = i8.linear(
        x, packed, 40, 576, variant, bias=bias, up_bias=-bias, mode="raw", out_dtype=torch.float32
    )  # [M, 80]
    alone = [
        i8.linear(x, _packed(q, s), 40, 576, "scalar", bias=b, out_dtype=torch.float32)
        for q, s, b in ((qg, sg, bias), (qu, su, -bias))
    ]
    assert torch.equal(_bits(raw), _bits(torch.cat(alone, dim=1)))
    gated = i8.linear(x, packed, 40, 576, variant, bias=bias, up_bias=-bias, mode="silu", out_dtype=torch.float32)
    reference = i8.linear(x, packed, 40, 576, "scalar", bias=bias, up_bias=-bias, mode="silu", out_dtype=torch.float32)
    assert torch.equal(_bits(gated), _bits(reference))
    g, u = alone
    assert torch.allclose(gated, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["scalar", *VARIANTS])
def test_a_row_gets_the_same_bits_alone_and_in_any_crowd(variant):
    crowd, weight, bias = _problem(300, 640, 70, seed=9)
    packed = _packed(*quantize_weight(weight))
    everyone = i8.linear(crowd, packed, 70, 640, variant, bias=bias, out_dtype=torch.float32)
    for first, count in [(0, 1), (5, 1), (3, 7), (9, 9), (0, 16), (17, 31), (100, 129), (299, 1)]:
        got = i8.linear(crowd[first : first + count], packed, 70, 640, variant, bias=bias, out_dtype=torch.float32)
        assert torch.equal(_bits(got), _bits(everyone[first : first + count])), (first, count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_to_the_same_bytes_with_the_conversion_instruction_or_the_portable_form(dtype):
    """Where the build has AVX-512F the row quantization converts with vcvtps2dq and no clamp (which changes no
    value: |x| <= amax); a build forced to the portable form (clamp, then round by adding and subtracting 1.5 *
    2^23) gives the same bytes and scales: ties, the row's extremes, NaNs among finite values, tails past 16."""
    try:
        portable = build_kernels(("I8_PORTABLE_QUANTIZE",)).int8
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")
    x, _, _ = _problem(40, 1000, 1, seed=21, dtype=dtype)
    x[1, :8] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 126.5, -126.5, -127.0]).to(dtype)  # inv = 1: exact ties
    x[1, 8:] = 0.0
    x[2, ::7] = float("nan")  # never the max; each NaN becomes byte 0
    x[3] = 0.0
    x[4, 5] = -x[4].abs().max() * 3  # a negative extreme
    x[5] = torch.randn(1000).to(dtype) * 1e-20  # small, still above 2^-100
    for rows in (x, x[:, :997]):  # a tail of 5 values past the 16-lane body (and an unaligned row stride)
        want_q, want_scale = i8.quantize_rows(rows)
        got_q, got_scale = portable.quantize_rows(rows)
        assert torch.equal(got_q, want_q) and torch.equal(_bits(got_scale), _bits(want_scale))
    assert i8.quantize_rows(x)[0][1, :8].tolist() == [127, 0, 0, 2, -2, 126, -126, -127]


def test_the_epilogue_gives_the_same_bits_with_the_fma_instruction_or_fmaf():
    """The 16-lane epilogue's fma: _mm512_fmadd_ps where the build has AVX-512F, fmaf lane by lane elsewhere (an AVX2
    CPU's build); a build forced to the fmaf form gives the same outputs in every mode and output dtype."""
    try:
        portable = build_kernels(("I8_PORTABLE_FMA",)).int8
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")
    x, gate, bias = _problem(21, 576, 37, seed=11)
    up = (torch.randn(37, 576, generator=torch.Generator().manual_seed(12)) / 24).bfloat16()
    plain = _packed(*quantize_weight(gate))
    gated = i8.packed(37, 576, gated=True)
    i8.pack_into(gated, 576, *quantize_weight(gate), "gate")
    i8.pack_into(gated, 576, *quantize_weight(up), "up")
    calls = [(plain, bias, None, "plain", dtype) for dtype in (torch.float32, torch.bfloat16)] + [
        (gated, bias, -bias, mode, dtype) for mode in ("silu", "raw") for dtype in (torch.float32, torch.bfloat16)
    ]
    for variant in ["scalar", *(v for v in ISA if i8.variant_runs(v))]:
        for packed, b, up_bias, mode, dtype in calls:
            want = i8.linear(x, packed, 37, 576, variant, bias=b, up_bias=up_bias, mode=mode, out_dtype=dtype)
            got = portable.linear(x, packed, 37, 576, variant, bias=b, up_bias=up_bias, mode=mode, out_dtype=dtype)
            assert torch.equal(_bits(got), _bits(want)), (variant, mode, dtype)


# -- overflow ------------------------------------------------------------------------------------------


def test_the_overflow_bound_is_k_times_127_times_128_below_2_to_the_31():
    assert i8.inner_fits(MAX_K) and not i8.inner_fits(MAX_K + 1) and not i8.inner_fits(0)
    assert MAX_K * 127 * 128 < 2**31 <= (MAX_K + 1) * 127 * 128
    with pytest.raises(KernelError, match="overflow"):
        i8.packed(32, MAX_K + 1)
    with pytest.raises(KernelError):
        i8.linear(torch.ones(1, MAX_K + 1), torch.zeros(64, dtype=torch.int8), 32, MAX_K + 1, "scalar")
    too_wide = torch.nn.Linear(MAX_K + 1, 2, bias=False)
    assert not INT8_SCALAR.reads(too_wide) and INT8_SCALAR.reads(torch.nn.Linear(MAX_K, 2, bias=False))


@pytest.mark.parametrize("variant", ["scalar", *VARIANTS])
def test_sums_at_the_overflow_bound_are_exact(variant):
    """127 * -128 at every k of the largest K: -2^31 + 1024, and VNNI's offset sums wrap on the way there."""
    x = torch.ones(2, MAX_K)
    x[1] = -1.0
    q = torch.full((32, MAX_K), -128, dtype=torch.int8)
    q[1::2] = 127
    packed = _packed(q, torch.ones(32))
    sums = i8.linear(x, packed, 32, MAX_K, variant, mode="int")
    assert sums[0, 0] == -127 * 128 * MAX_K == -(2**31) + 1024 and sums[1, 0] == 127 * 128 * MAX_K
    assert sums[0, 1] == 127 * 127 * MAX_K and sums[1, 1] == -127 * 127 * MAX_K


# -- the layer method -----------------------------------------------------------------------------------


def test_fused_members_equal_the_whole_call_and_read_back_their_quantized_weights():
    x, _, _ = _problem(11, 128, 1, seed=11)
    generator = torch.Generator().manual_seed(12)
    weights = [(torch.randn(n, 128, generator=generator) / 11).bfloat16() for n in (64, 32, 32)]
    biases = [torch.randn(n, generator=generator).bfloat16() for n in (64, 32, 32)]
    layer = INT8_SCALAR.make(kernels, weights, biases)
    whole = layer(x, torch.float32)  # [11, 128]
    for index, start in enumerate((0, 64, 96)):
        assert torch.equal(
            _bits(layer.member(index, x, torch.float32)), _bits(whole[:, start : start + weights[index].shape[0]])
        )
        q, scale = quantize_weight(weights[index])
        read = layer.weight(index)
        assert read.dtype == torch.bfloat16 and torch.equal(read, dequantize_weight(q, scale, torch.bfloat16))
        assert torch.equal(getattr(read, PREQUANTIZED)[0], q)  # its int8 form rides along
    assert layer.nbytes == layer.packed.numel() + 128 * 4
    new = (torch.randn(32, 128, generator=generator) / 11).bfloat16()
    layer.load(1, weight=new)
    fresh = INT8_SCALAR.make(kernels, [weights[0], new, weights[2]], biases)
    assert torch.equal(_bits(layer(x, torch.float32)), _bits(fresh(x, torch.float32)))
    layer.release()
    assert layer.packed.numel() == 0
    with pytest.raises(KernelError, match="beyond the packed matrix"):  # refused, never read past the end
        layer(x)
    with pytest.raises(KernelError, match="beyond the packed matrix"):
        layer.quantized(2)


def test_a_weight_carrying_its_int8_form_is_packed_as_that_form_only_while_it_equals_it():
    _, weight, _ = _problem(1, 256, 40, seed=13)
    scale = weight.float().abs().amax(dim=1) / 127.5  # llmcompressor's symmetric scale: q in [-128, 127]
    q = torch.round(weight.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    dense = dequantize_weight(q, scale, torch.bfloat16)
    again = quantize_weight(dense)  # quantizing q * scale again by our rule does not give q and scale back
    assert not torch.equal(again[1], scale)
    setattr(dense, PREQUANTIZED, (q, scale))
    got = int8_form(dense)
    assert torch.equal(got[0], q) and torch.equal(got[1], scale) and not hasattr(dense, PREQUANTIZED)  # consumed
    setattr(dense, PREQUANTIZED, (q, scale))
    dense[0, 0] += 1  # changed since: quantized by the rule
    changed = int8_form(dense)
    assert torch.equal(changed[0], quantize_weight(dense)[0])


def test_the_self_check_proves_the_variants_and_the_selector_takes_the_first_that_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    shapes = [Shape(70, 896), Shape(96, 640)]
    choice = choose_linear_method(kernels, torch.int8, shapes)
    first = next(m for m in INT8_METHODS.values() if m.runs_on(kernels))
    assert choice.method is first and choice.checks[-1].passed
    if first is not INT8_SCALAR:
        assert "plain-C reference" in choice.checks[-1].detail
    missing = [m for m in INT8_METHODS.values() if not m.runs_on(kernels)]
    for method in missing:
        assert "cannot run" in check_method(kernels, method, shapes).detail


class _WrongRounding(Int8Method):
    """A variant that claims the int8 arithmetic but computes the bf16 pair dots (right values, other bits)."""

    def make(self, kernels, weights, biases, gated=False):
        from cbrun.engine.backends.cpu.linear.methods import DP_SCALAR

        return DP_SCALAR.make(kernels, [w.bfloat16() for w in weights], [b.bfloat16() for b in biases], gated)


def test_a_variant_that_differs_from_the_reference_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path))
    wrong = _WrongRounding("int8-wrong", torch.bfloat16, True, "int8", "avx2")
    if not wrong.runs_on(kernels):
        pytest.skip("this CPU cannot run avx2 (the claimed variant)")
    result = check_method(kernels, wrong, [Shape(40, 576)])
    assert not result.passed and "plain-C reference" in result.detail
    assert check_method(kernels, INT8_AVX2, [Shape(40, 576)]).passed
