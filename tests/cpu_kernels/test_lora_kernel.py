"""lora.c's grouped call: every adapter's delta in one call, each row's bits those it gets alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from cbrun.engine.backends.cpu.kernels.abi import KernelError
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")

WIDTHS = (96, 40, 40)  # q|k|v-like members, 40 not a multiple of the 16 lanes


def _adapters(count: int, inner: int, rank: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """Per adapter, per member (A [r, K], B^T [r, N]); adapter 1 leaves member 1 alone."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            None
            if (g == 1 and m == 1)
            else (torch.randn(rank, inner, generator=gen), torch.randn(rank, n, generator=gen))
            for m, n in enumerate(WIDTHS)
        ]
        for g in range(count)
    ]


def _outputs(y: torch.Tensor) -> list[torch.Tensor]:
    bounds = [0, WIDTHS[0], WIDTHS[0] + WIDTHS[1], sum(WIDTHS)]
    return [y[:, lo:hi] for lo, hi in itertools.pairwise(bounds)]  # column views, rows sum(WIDTHS) apart


@pytest.mark.parametrize("inner", [64, 77])  # a K tail of 13
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_grouped_deltas_match_float64_and_each_row_is_bitwise_as_alone(inner, rank):
    gen = torch.Generator().manual_seed(rank)
    tokens = 23
    x = torch.randn(tokens, inner, generator=gen)
    base = torch.randn(tokens, sum(WIDTHS), generator=gen)
    adapters = _adapters(3, inner, rank, seed=inner)
    rows = [torch.tensor(r) for r in ([0, 4, 5, 9, 22], [1, 2, 3, 10, 11, 12, 13], [6, 20])]  # 7, 8, 14.. untouched
    y = base.clone()
    kernels.lora.apply(x, list(zip(rows, adapters, strict=True)), _outputs(y))
    want = base.double()
    for group_rows, pairs in zip(rows, adapters, strict=True):
        for (lo, view), pair in zip(enumerate(_outputs(want)), pairs, strict=True):
            del lo
            if pair is not None:
                a, bt = pair
                view[group_rows] += x[group_rows].double() @ a.double().t() @ bt.double()
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-3)
    assert torch.equal(y[[7, 8, 14]], base[[7, 8, 14]])  # rows of no adapter are not touched
    assert torch.equal(_outputs(y)[1][rows[1]], _outputs(base)[1][rows[1]])  # nor a member the adapter leaves
    for group_rows, pairs in zip(rows, adapters, strict=True):
        for row in group_rows.tolist():  # alone: the same bits
            alone = base.clone()
            kernels.lora.apply(x, [(torch.tensor([row]), pairs)], _outputs(alone))
            assert torch.equal(alone[row], y[row])


def test_a_bf16_output_is_widened_added_to_and_rounded_once():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    y = torch.randn(9, 48, generator=gen).bfloat16()
    a, bt = torch.randn(16, 64, generator=gen), torch.randn(16, 48, generator=gen)
    rows = torch.tensor([0, 3, 8])
    got = y.clone()
    kernels.lora.apply(x, [(rows, [(a, bt)])], [got])
    fp32 = y.float()
    kernels.lora.apply(x.float(), [(rows, [(a, bt)])], [fp32])  # the same sums on fp32 outputs
    assert torch.equal(got, fp32.bfloat16())


def test_operands_the_call_cannot_take_are_refused():
    x, y = torch.randn(4, 32), torch.randn(4, 16)
    with pytest.raises(KernelError, match="B\\^T"):
        kernels.lora.apply(x, [(torch.tensor([0]), [(torch.randn(8, 32), torch.randn(8, 15))])], [y])
    assert not kernels.lora.accepts(x, [y.t()])  # a column stride the call does not read: the caller falls back
    with pytest.raises(KernelError, match="unit-stride"):
        kernels.lora.apply(x, [(torch.tensor([0]), [(torch.randn(8, 32), torch.randn(8, 4))])], [y.t()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_8_and_16_lane_builds_give_the_same_bits(dtype):
    """The register blocking differs by width (ranks and outputs per pass, two ymm per 16 lanes on AVX2); the
    chains must not: odd row counts, ranks and widths off every block, a K tail."""
    from cbrun.engine.backends.cpu.kernels.loader import build_kernels

    try:
        builds = [build_kernels((f"CBRUN_VEC_WIDTH={width}",)) for width in (8, 16)]
    except Exception as exc:  # no compiler, or a failed build
        pytest.skip(f"cannot build the CPU kernels here: {exc}")
    gen = torch.Generator().manual_seed(11)
    inner, tokens, widths = 93, 9, (200, 17, 64)
    x = torch.randn(tokens, inner, generator=gen).to(dtype)
    base = [torch.randn(tokens, n, generator=gen).to(dtype) for n in widths]
    groups = [
        (
            torch.tensor(rows),
            [(torch.randn(rank, inner, generator=gen), torch.randn(rank, n, generator=gen)) for n in widths],
        )
        for rows, rank in (([0, 2, 3, 5, 8], 7), ([1, 4, 6], 16), ([7], 5))
    ]
    outs = []
    for build in builds:
        ys = [y.clone() for y in base]
        build.lora.apply(x, groups, ys)
        outs.append(ys)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for narrow, wide in zip(*outs, strict=True):
        assert torch.equal(narrow.view(bits), wide.view(bits))
    assert not torch.equal(outs[0][0], base[0])
