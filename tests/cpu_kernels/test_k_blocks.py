"""The linear kernels blocked in K (issue 31): every output keeps exactly the unblocked chain.

dp_linear (bf16 pairs) and linear_rows/gated_silu (fp32 chains) take K in steps whose length depends on K
alone, carrying each output's fp32 sum from one step to the next. The references are builds with one step for
any K (-DDP_K_PAIRS=1048576 -DLIN_K_STEP=1073741824: each chain written in one loop); for bf16 its plain-C
variant, itself checked against the AMX-order model of test_linear_methods. Every variant of the default
(blocked) build must give their bits at real sizes.
"""

from __future__ import annotations

import pytest
import torch
from amx_order import amx_order_model

from cbrun.engine.backends.cpu.kernels.loader import build_kernels, load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the compiled CPU kernels cannot be built here")
HAS_ISA = kernels is not None and kernels.dp.variant_runs("isa")
VARIANTS = [
    "scalar",
    "twin",
    pytest.param("isa", marks=pytest.mark.skipif(not HAS_ISA, reason="this CPU lacks AVX512-BF16")),
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            kernels is None or not kernels.dp.variant_runs("amx"), reason="this CPU (or process) has no AMX-BF16"
        ),
    ),
]
# 0.5B-8B models' hidden and MLP widths (the widest in the slow tier: the scalar reference takes seconds there)
INNER = (896, 1536, 2048, *(pytest.param(k, marks=pytest.mark.slow) for k in (4864, 8960, 14336)))
ROWS = (1, 2, 7, 8, 9, 16, 17, 31, 64, 129, 130, 300)  # row groups of 16 (6 and 8 per pass), chunks of >= 128 rows


@pytest.fixture(scope="module")
def unblocked():
    try:
        return build_kernels(("DP_K_PAIRS=1048576", "LIN_K_STEP=1073741824"))
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_the_unblocked_reference_is_the_amx_order_model(unblocked):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 1536, generator=gen).to(torch.bfloat16)
    w = torch.randn(40, 1536, generator=gen).to(torch.bfloat16)
    got = unblocked.dp.linear(x, unblocked.dp.pack(w), 40, 1536, "scalar", out_dtype=torch.float32)
    assert torch.equal(_bits(got), _bits(amx_order_model(x, w)))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("inner", INNER)
def test_every_output_keeps_the_unblocked_chain(unblocked, variant, inner):
    gen = torch.Generator().manual_seed(inner)
    x = torch.randn(max(ROWS), inner, generator=gen).to(torch.bfloat16)
    x[3, : inner // 3] *= 1e-36  # sums through the denormal range, where flushing shows
    w = (torch.randn(64, inner, generator=gen) / inner**0.5).to(torch.bfloat16)
    bias = torch.randn(64, generator=gen)
    reference = unblocked.dp.linear(x, unblocked.dp.pack(w), 64, inner, "scalar", bias=bias, out_dtype=torch.float32)
    packed = kernels.dp.pack(w)
    for rows in ROWS:
        got = kernels.dp.linear(x[:rows], packed, 64, inner, variant, bias=bias, out_dtype=torch.float32)
        assert torch.equal(_bits(got), _bits(reference[:rows])), (variant, inner, rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", [True, "raw"])
def test_gated_outputs_keep_the_unblocked_chain(unblocked, variant, mode):
    """silu(gate) * up in bf16, and the raw sums, at an 8B model's MLP width with a partial last block."""
    inner, width = 4096, 40
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(130, inner, generator=gen).to(torch.bfloat16)
    gate, up = ((torch.randn(width, inner, generator=gen) / 64).to(torch.bfloat16) for _ in range(2))
    biases = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    reference = unblocked.dp.linear(
        x, unblocked.dp.pack(gate, up), width, inner, "scalar", bias=biases[0], up_bias=biases[1], gated=mode
    )
    got = kernels.dp.linear(
        x, kernels.dp.pack(gate, up), width, inner, variant, bias=biases[0], up_bias=biases[1], gated=mode
    )
    assert got.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", INNER)
def test_fp32_chains_keep_the_unblocked_chain(unblocked, dtype, inner):
    """linear.c's fp32 chains (fp32 or bf16 weights, widened) at real K: q|k|v side by side and gated silu."""
    gen = torch.Generator().manual_seed(inner + 1)
    x = torch.randn(max(ROWS), inner, generator=gen).to(dtype)
    weights = [(torch.randn(n, inner, generator=gen) / inner**0.5).to(dtype) for n in (40, 24)]
    biases = [torch.randn(n, generator=gen).to(dtype) for n in (40, 24)]
    side = unblocked.linear_many(x, weights, biases, torch.float32)
    gated = unblocked.gated_silu(x, weights[0], weights[0].flip(0), biases[0], biases[0])
    for rows in ROWS:
        got = kernels.linear_many(x[:rows], weights, biases, torch.float32)
        assert torch.equal(_bits(got), _bits(side[:rows])), (dtype, inner, rows)
        got = kernels.gated_silu(x[:rows], weights[0], weights[0].flip(0), biases[0], biases[0])
        assert torch.equal(_bits(got), _bits(gated[:rows])), (dtype, inner, rows)
