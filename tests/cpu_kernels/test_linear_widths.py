"""The linear kernels give the same bits at every vector width.

linear.c runs VEC fp32 lanes per vector: 16 (one zmm register) where the
compiler targets AVX-512F, 8 otherwise, chosen when the library is built.
Each lane is one row's multiply-add chain over k in order, so the width only
regroups independent chains and must not change an output. Here the 8-wide and
the 16-wide builds (forced with -DCBRUN_VEC_WIDTH) compute the same calls and
are compared bit for bit, and both against a float64 reference (so a wrong
row, column or tile would fail, not only a width mismatch).

On an AVX2 machine the 16-wide build is the same C with every 64-byte vector
split by the compiler into two ymm halves (the "portable twin" of the AVX-512
build): it checks the wide build's logic (two-panel steps, its TILE_NR and
edge tiles, the half step, the 16-lane SiLU epilogue) and its arithmetic, but
not the zmm code itself, and its speed says nothing about the AVX-512 build's
(it spills registers; users on AVX2 get the 8-wide build). On an AVX-512
machine the same tests compare the real zmm build against the 8-wide one.
"""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.engine.backends.cpu.kernels.loader import build_kernels, load_cpu_kernels

ROWS = (1, 5, 8, 9, 16, 17, 31, 33, 100, 257)
INNER = (64, 100, 576)
WIDTHS = (7, 1536, 13)  # edge tiles at every TILE_NR (6, 10) and gated tile (3, 5)


@pytest.fixture(scope="module")
def builds():
    try:
        return {width: build_kernels((f"CBRUN_VEC_WIDTH={width}",)) for width in (8, 16)}
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (torch.equal on floats takes -0 == 0)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _fp32_bound(x: torch.Tensor, w: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A bound on the rounding error of a K-long fp32 multiply-add chain, K * 2^-24 * (|x| @ |w|^T), and of the
    bias added to it, 2^-24 * |result|."""
    inner = x.shape[1]
    return (inner + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 2.0**-23 * reference.abs()


def _assert_close(got: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> None:
    """got within the fp32 chain's bound of the float64 reference, plus bf16's rounding when got is bf16."""
    allowed = bound + (2.0**-8 * reference.abs() if got.dtype == torch.bfloat16 else 0)
    error = (got.double() - reference).abs()
    assert bool((error <= allowed + 1e-30).all()), f"max error {error.max():.3g}, max allowed {allowed.max():.3g}"


def test_builds_report_their_width_and_panel_rows(builds):
    for width, kernels in builds.items():
        assert kernels._lib.linear_vec_width() == width
        # the scratch CpuKernels allocates for the packed panels is sized by the library's own panel rows
        assert kernels.vector_width == width and kernels.panel_rows == kernels._lib.linear_panel_rows() == 16


def test_default_build_uses_the_cpus_width():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("compiled CPU kernels unavailable")
    expected = 16 if "avx512f" in cpu_flags().split() else 8
    assert kernels._lib.linear_vec_width() == expected == kernels.vector_width
    assert kernels.panel_rows == kernels._lib.linear_panel_rows()


# (x, weights and biases, output): fp32 and bf16 weights, bf16 inputs and outputs
DTYPES = [
    (torch.float32, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32),
]


@pytest.mark.parametrize("x_dtype,w_dtype,y_dtype", DTYPES)
@pytest.mark.parametrize("inner", INNER)
def test_linear_many_is_bitwise_the_same_at_both_widths(builds, x_dtype, w_dtype, y_dtype, inner):
    gen = torch.Generator().manual_seed(inner)
    scale = inner**-0.5
    x_all = (torch.randn(max(ROWS), inner, generator=gen)).to(x_dtype)
    weights = [(torch.randn(n, inner, generator=gen) * scale).to(w_dtype) for n in WIDTHS]
    biases = [
        torch.randn(WIDTHS[0], generator=gen).to(w_dtype),
        None,
        torch.randn(WIDTHS[2], generator=gen).to(w_dtype),
    ]
    w_cat = torch.cat(weights).double()
    b_cat = torch.cat(
        [b.double() if b is not None else torch.zeros(n, dtype=torch.float64) for b, n in zip(biases, WIDTHS)]
    )
    reference = x_all.double() @ w_cat.T + b_cat  # of every row: each M checks its first M rows
    bound = _fp32_bound(x_all, w_cat, reference)
    full = {}
    for rows in ROWS:
        y8, y16 = (builds[w].linear_many(x_all[:rows], weights, biases, out_dtype=y_dtype) for w in (8, 16))
        assert y8.shape == (rows, sum(WIDTHS)) and y8.dtype == y_dtype
        assert _same_bits(y8, y16), (rows, inner)
        full[rows] = y16
        _assert_close(y8, reference[:rows], bound[:rows])
    for rows in ROWS:  # and the wide build's rows are batch invariant
        assert _same_bits(full[rows], full[max(ROWS)][:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", INNER)
def test_gated_silu_is_bitwise_the_same_at_both_widths(builds, dtype, inner):
    gen = torch.Generator().manual_seed(100 + inner)
    scale = 2 * inner**-0.5  # gate values of a few units: both tails of the SiLU
    x_all = torch.randn(max(ROWS), inner, generator=gen).to(dtype)
    for width, with_bias in ((7, True), (1536, False)):
        gate, up = ((torch.randn(width, inner, generator=gen) * scale).to(dtype) for _ in range(2))
        gate_bias, up_bias = ((torch.randn(width, generator=gen).to(dtype) if with_bias else None) for _ in range(2))
        g = x_all.double() @ gate.double().T + (gate_bias.double() if with_bias else 0)
        u = x_all.double() @ up.double().T + (up_bias.double() if with_bias else 0)
        reference = torch.nn.functional.silu(g) * u
        # the chains' bounds carried through silu (|silu'| <= 1.1), plus the exp polynomial's 2e-7 and roundings
        bound_g, bound_u = _fp32_bound(x_all, gate, g), _fp32_bound(x_all, up, u)
        bound = 1.1 * bound_g * u.abs() + bound_u * g.abs() + 1e-6 * reference.abs() + 1e-7
        full = {}
        for rows in ROWS:
            y8, y16 = (builds[w].gated_silu(x_all[:rows], gate, up, gate_bias, up_bias) for w in (8, 16))
            assert y8.shape == (rows, width) and y8.dtype == dtype
            assert _same_bits(y8, y16), (rows, inner, width)
            full[rows] = y16
            _assert_close(y8, reference[:rows], bound[:rows])
        for rows in ROWS:
            assert _same_bits(full[rows], full[max(ROWS)][:rows]), (rows, width)
