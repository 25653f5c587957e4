"""Which variant computes bf16 attention scores on this CPU: checked at kernel load, bitwise.

bf16 attention scores are dot products of bf16 pairs, the arithmetic of AVX512-BF16's `vdpbf16ps`
(attention.c). Three variants compute them: the instruction, a portable twin (vector FMAs under the
CPU's flush modes) and the plain-C reference. The fastest variant that runs here and equals the
reference on probe scores (typical values, values whose products go through denormals, denormal
inputs, cancelling sums) serves; so a CPU whose flush modes or FMAs do not behave as the twin expects
falls back to the reference and still computes the same bits as every other CPU. The check takes a
few milliseconds, so it runs at every load rather than being cached.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cbrun.engine.backends.cpu.kernels import CpuKernels

log = logging.getLogger("cbrun.engine")

_PREFERENCE = ("isa", "twin", "scalar")  # fastest first; "scalar" is the reference


def probe_scores(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q [3, 64], keys [37, 64]) bf16 pairs that exercise the pair order, the flushing and the tree."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    typical = (normal(3, 64), normal(37, 64))
    tiny_products = (normal(3, 64, scale=1e-19), normal(37, 64, scale=1e-19))  # products ~1e-38: denormal
    denormal_inputs = (normal(3, 64, scale=1e-39), normal(37, 64))  # bf16 denormals, read as zero
    mixed = normal(3, 64), normal(37, 64)
    mixed[1][::2] *= 1e-20  # half the keys tiny: lanes mixing flushed and normal results
    cancelling = normal(3, 64, scale=1e3), normal(37, 64, scale=1e3)
    cancelling[1][:, 32:] = -cancelling[1][:, :32]  # big partial sums that cancel in the tree
    return [typical, tiny_products, denormal_inputs, mixed, cancelling]


def choose_attention_dp_variant(kernels: CpuKernels) -> str:
    """The first of isa, twin, scalar that runs here and gives the reference's bits on every probe."""
    probes = probe_scores()
    reference = [kernels.attend_dp_scores("scalar", q, keys, 0.125).view(torch.int32) for q, keys in probes]
    for variant in _PREFERENCE:
        if variant == "scalar":
            return variant
        if not kernels.dp_attention_runs(variant):
            continue
        got = [kernels.attend_dp_scores(variant, q, keys, 0.125).view(torch.int32) for q, keys in probes]
        if all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)):
            return variant
        log.warning("bf16 attention scores: the %s variant differs from the reference on this CPU; not used", variant)
    return "scalar"
