"""Which ISA variants of the kernels run on this CPU, and which serves bf16 attention: decided once, at load.

As ggml-cpu scores its variants against the running CPU in one place at load
(`ggml-cpu/arch/x86/cpu-feats.cpp`), the loader (kernels/loader.py) asks the
library once, for every variant of every family in kernel_abi.VARIANTS
(bf16 pair dots: scalar, twin, isa; int8: scalar, avx2, vnni, amx), whether
this CPU runs it (the CPU reports the instructions; AMX: Linux also grants
the tile state). The kernels object keeps the answer: the linear methods read
it before their self-check at the model's shapes (linear/method_selector.py), and no
kernel call asks the CPU again.

bf16 attention scores are dot products of bf16 pairs, the arithmetic of
AVX512-BF16's `vdpbf16ps` (attention.c), computed by the instruction, a
portable twin (vector FMAs under the CPU's flush modes) or the plain-C
reference. The fastest variant that runs here and equals the reference on
probe scores (typical values, values whose products go through denormals,
denormal inputs, cancelling sums) serves; so a CPU whose flush modes or FMAs
do not behave as the twin expects falls back to the reference and still
computes the same bits as every other CPU. The check takes a few
milliseconds, so it runs at every load rather than being cached.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from cbrun.engine.backends.cpu.kernels.abi import VARIANTS, KernelError, check, ptr

log = logging.getLogger("cbrun.engine")

_RUNS = {"dp": "dp_variant_runs", "int8": "i8_variant_runs"}  # each family's "does this CPU run it" entry point
_PREFERENCE = ("isa", "twin", "scalar")  # bf16 attention scores, fastest first; "scalar" is the reference


@dataclass(frozen=True)
class IsaVariants:
    """What the load found: the variants of each family this CPU runs, and the one serving attention scores."""

    runs: dict[str, tuple[str, ...]]  # family -> the variants that run here, in kernel_abi.VARIANTS' order
    attention: str  # the pair-dot variant of bf16 attention scores: isa, twin or scalar

    def runnable(self, family: str, variant: str) -> bool:
        if variant not in VARIANTS[family]:
            raise KeyError(f"{family} has no variant {variant!r} (choose from {', '.join(VARIANTS[family])})")
        return variant in self.runs[family]


class PairScores(Protocol):
    """What the attention check needs of the kernels: which variants run, and one variant's scores."""

    def dp_attention_runs(self, variant: str) -> bool: ...

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor: ...


def score_variants(library: ctypes.CDLL) -> IsaVariants:
    """Every family's variants that this CPU runs, and the attention score variant that equals the reference."""
    runs = {
        family: tuple(name for name, number in table.items() if getattr(library, _RUNS[family])(number))
        for family, table in VARIANTS.items()
    }
    attention = choose_attention_dp_variant(_LibraryScores(library, runs["dp"]))
    return IsaVariants(runs, attention)


def dp_scores(library: ctypes.CDLL, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [G, n] of q [G, D] against keys [n, D] (bf16, D a multiple of 32, n <= the segment) by one variant
    of attention.c's pair-dot scores: what the load check and the tests compare."""
    heads, dim = q.shape
    count = keys.shape[0]
    if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or keys.shape[1] != dim:
        raise KernelError("attend_dp_scores: q [G, D] and keys [n, D] must be bf16")
    q, keys = q.contiguous(), keys.contiguous()
    out = torch.empty(heads, count, dtype=torch.float32)
    number = VARIANTS["dp"][variant]
    check(library.attend_dp_scores(number, ptr(q), ptr(keys), heads, count, dim, scale, ptr(out)), "attend_dp_scores")
    return out


class _LibraryScores:
    """The library's pair-dot scores, before the kernels object that will keep the choice exists."""

    def __init__(self, library: ctypes.CDLL, runs: tuple[str, ...]) -> None:
        self.library, self.runs = library, runs

    def dp_attention_runs(self, variant: str) -> bool:
        return variant in self.runs

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        return dp_scores(self.library, variant, q, keys, scale)


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


def choose_attention_dp_variant(kernels: PairScores) -> str:
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
