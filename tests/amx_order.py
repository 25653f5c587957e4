"""AMX `tdpbf16ps`'s order written in torch float64: the model the plain-C references are checked against.

The linears' and attention's plain-C references (tile_order.h, attention_tile.h) must equal this model bit for
bit; every faster method must equal its reference. Written from the Intel SDM's pseudo-code of the instruction,
which the probe in ../shared/amx_probe matched on an AMX CPU.
"""

from __future__ import annotations

import torch


def round_ftz(s: torch.Tensor) -> torch.Tensor:
    """float64 values rounded once to fp32, then flushed to a signed zero where the rounded value (24 bits, an
    unbounded exponent) is below 2^-126: x86's FTZ, tininess after rounding. Values below 2^-100 are rounded
    scaled by 2^64, in the normal range, and scaled back (exactly, unless flushed)."""
    tiny = s.abs() < 2.0**-100
    r = torch.where(tiny, (s * 2.0**64).float().double(), s.float().double())
    flushed = tiny & (r.abs() < 2.0**-62)
    r = torch.where(tiny, r * 2.0**-64, r)
    return torch.where(flushed, torch.copysign(torch.zeros_like(r), r), r)


def amx_order_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """tdpbf16ps's order in torch: bf16 x [M, K], w [N, K] -> fp32 [M, N].

    K padded with zeros to whole 32-element blocks; per block, an even and an
    odd chain from +0 (fma per element pair, ascending), then C = C + (E + O),
    from C = +0; denormal inputs read as zero, every result flushed. fma(a, b,
    c) for bf16 a, b and fp32 c is computed in float64 and rounded once: a * b
    is exact in float64 (16 significant bits), and where the float64 sum is
    inexact the smaller term is below 2^-29 of the larger, which lies on the
    fp32 grid, so the second rounding cannot cross an fp32 midpoint.
    """

    def read(t):  # denormal inputs read as zero (bf16 shares fp32's exponent range)
        t = t.double()
        return torch.where(t.abs() < 2.0**-126, torch.copysign(torch.zeros_like(t), t), t)

    padded = -(-x.shape[1] // 32) * 32
    xs = read(torch.nn.functional.pad(x, (0, padded - x.shape[1])))
    ws = read(torch.nn.functional.pad(w, (0, padded - w.shape[1])))
    c = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for start in range(0, padded, 32):
        even, odd = torch.zeros_like(c), torch.zeros_like(c)
        for k in range(start, start + 32, 2):
            even = round_ftz(xs[:, k, None] * ws[None, :, k] + even)
            odd = round_ftz(xs[:, k + 1, None] * ws[None, :, k + 1] + odd)
        c = round_ftz(c + round_ftz(even + odd))
    return c.float()
