"""Which ISA variants of the kernels run on this CPU, and which serves bf16 attention: decided once, at load.

As ggml-cpu scores its variants against the running CPU in one place at load
(`ggml-cpu/arch/x86/cpu-feats.cpp`), the loader (kernels/loader.py) asks the
library once, for every variant of every family in kernel_abi.VARIANTS
(bf16 pair dots: scalar, twin, isa; int8: scalar, avx2, vnni, amx), whether
this CPU runs it (the CPU reports the instructions; AMX: Linux also grants
the tile state). The kernels object keeps the answer: the linear methods read
it before their self-check at the model's shapes (linear/method_selector.py), and no
kernel call asks the CPU again.

bf16 attention (head sizes of whole 32-element blocks) computes AMX's
`tdpbf16ps` order for its scores and its value sums (attention.c,
attention_tile.h), by the tiles themselves (where AMX-BF16 is granted),
`vdpbf16ps` on re-paired operands for the scores (AVX512-BF16), a portable
twin (vector FMAs under the CPU's flush modes) or the plain-C reference. Of
the variants that run here and equal the reference on probes of both halves
(typical values, products through denormals, denormal inputs, cancelling sums,
weights that round to ties), the fastest in a short timed trial serves; so a
CPU whose flush modes or instructions do not behave as expected falls back to
the reference and still computes the same bits as every other CPU. The check
and the trial take milliseconds, so they run at every load rather than being
cached.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from cbrun.engine.backends.cpu.kernels.abi import VARIANTS, KernelError, check, ptr

log = logging.getLogger("cbrun.engine")

_RUNS = {"dp": "dp_variant_runs", "int8": "i8_variant_runs"}  # each family's "does this CPU run it" entry point
ATTENTION_VARIANTS = ("amx", "isa", "twin", "scalar")  # bf16 attention in AMX's order; "scalar": the reference


@dataclass(frozen=True)
class IsaVariants:
    """What the load found: the variants of each family this CPU runs, and the one serving attention scores."""

    runs: dict[str, tuple[str, ...]]  # family -> the variants that run here, in kernel_abi.VARIANTS' order
    attention: str  # the variant of bf16 attention in AMX's order: amx, isa, twin or scalar

    def runnable(self, family: str, variant: str) -> bool:
        if variant not in VARIANTS[family]:
            raise KeyError(f"{family} has no variant {variant!r} (choose from {', '.join(VARIANTS[family])})")
        return variant in self.runs[family]


class PairScores(Protocol):
    """What the attention check needs of the kernels: which variants run, and one variant's scores and values."""

    def dp_attention_runs(self, variant: str) -> bool: ...

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor: ...

    def attend_dp_values(self, variant: str, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor: ...


def score_variants(library: ctypes.CDLL) -> IsaVariants:
    """Every family's variants that this CPU runs, and the attention score variant that equals the reference."""
    runs = {
        family: tuple(name for name, number in table.items() if getattr(library, _RUNS[family])(number))
        for family, table in VARIANTS.items()
    }
    attention = choose_attention_dp_variant(_LibraryScores(library))
    return IsaVariants(runs, attention)


def dp_scores(library: ctypes.CDLL, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [G, n] of q [G, D] against keys [n, D] (bf16, D a multiple of 32, n <= the segment) by one variant
    of the AMX-order attention (attention_tile.h): what the load check and the tests compare."""
    heads, dim = q.shape
    count = keys.shape[0]
    if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or keys.shape[1] != dim:
        raise KernelError("attend_dp_scores: q [G, D] and keys [n, D] must be bf16")
    q, keys = q.contiguous(), keys.contiguous()
    out = torch.empty(heads, count, dtype=torch.float32)
    number = VARIANTS["dp"][variant]
    check(library.attend_dp_scores(number, ptr(q), ptr(keys), heads, count, dim, scale, ptr(out)), "attend_dp_scores")
    return out


def attention_variant_runs(library: ctypes.CDLL, variant: str) -> bool:
    """Whether this process runs a variant of the AMX-order attention (the tiles: AMX-BF16 and Linux's grant)."""
    return variant in ATTENTION_VARIANTS and bool(library.attend_dp_variant_runs(VARIANTS["dp"][variant]))


def dp_values(library: ctypes.CDLL, variant: str, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Value sums [G, D] of values [n, D] (bf16) weighted by weights [G, n] (fp32, rounded to bf16 by the kernel),
    keys from position 0, by one variant of the AMX-order attention."""
    heads, count = weights.shape
    dim = values.shape[1]
    if weights.dtype != torch.float32 or values.dtype != torch.bfloat16 or values.shape[0] != count:
        raise KernelError("attend_dp_values: weights [G, n] fp32 and values [n, D] bf16")
    weights, values = weights.contiguous(), values.contiguous()
    out = torch.empty(heads, dim, dtype=torch.float32)
    number = VARIANTS["dp"][variant]
    check(library.attend_dp_values(number, ptr(weights), ptr(values), heads, count, dim, ptr(out)), "attend_dp_values")
    return out


class _LibraryScores:
    """The library's AMX-order attention parts, before the kernels object that will keep the choice exists."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library

    def dp_attention_runs(self, variant: str) -> bool:
        return attention_variant_runs(self.library, variant)

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        return dp_scores(self.library, variant, q, keys, scale)

    def attend_dp_values(self, variant: str, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return dp_values(self.library, variant, weights, values)


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


def probe_values(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weights [3, 45], values [45, 64]): a partial last block, weights that round to bf16 ties, tiny products."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(3, 45, generator=generator)
    weights[0, ::3] = 1 + 2.0**-8 * (torch.arange(15) % 2 * 2 + 1) / 2  # halfway between bf16 values: ties
    values = torch.randn(45, 64, generator=generator).to(torch.bfloat16)
    tiny = values.clone()
    tiny[::2] = (tiny[::2].float() * 1e-37).to(torch.bfloat16)  # products and sums through the denormal range
    cancelling = values.clone()
    cancelling[1::2] = -cancelling[::2][: cancelling[1::2].shape[0]]
    return [(weights, values), (weights * 1e-3, tiny), (torch.ones(3, 45), cancelling)]


def _trial_seconds(kernels: PairScores, variants: list[str], rounds: int = 5) -> dict[str, float]:
    """Each variant's best time of 10 calls of its scores and value sums at a decode-like size (16 heads, 128 keys
    of 128 dims), the variants taking turns for `rounds` rounds after one warm-up call each: the timed trial
    between variants that all give the reference's bits. Turns, not one variant's rounds after another's, so a
    slow spell of the machine (the load's other work, a neighbour) falls on every variant alike."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(16, 128, generator=generator).bfloat16()
    keys = torch.randn(128, 128, generator=generator).bfloat16()
    weights, values = torch.rand(16, 128, generator=generator), torch.randn(128, 128, generator=generator).bfloat16()

    def seconds(variant: str, calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            kernels.attend_dp_scores(variant, q, keys, 0.125)
            kernels.attend_dp_values(variant, weights, values)
        return time.perf_counter() - start

    for variant in variants:
        seconds(variant, 1)  # warm-up
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for variant in variants:
            best[variant] = min(best[variant], seconds(variant, 10))
    return best


def choose_attention_dp_variant(kernels: PairScores) -> str:
    """Of amx, isa and twin, the fastest in a timed trial among those that run here and give the reference's bits on
    every probe of both halves; the reference where none does."""
    scores, values = probe_scores(), probe_values()

    def results(variant: str) -> list[torch.Tensor]:
        got = [kernels.attend_dp_scores(variant, q, keys, 0.125) for q, keys in scores]
        got += [kernels.attend_dp_values(variant, weights, rows) for weights, rows in values]
        return [t.view(torch.int32) for t in got]

    reference = results("scalar")
    passed = []
    for variant in ATTENTION_VARIANTS[:-1]:
        if not kernels.dp_attention_runs(variant):
            continue
        if all(torch.equal(a, b) for a, b in zip(results(variant), reference, strict=True)):
            passed.append(variant)
        else:
            log.warning("bf16 attention: the %s variant differs from the reference on this CPU; not used", variant)
    if len(passed) > 1:
        timings = _trial_seconds(kernels, passed)
        log.debug("bf16 attention trial: %s", ", ".join(f"{v} {1e3 * t:.2f} ms" for v, t in timings.items()))
        return min(passed, key=timings.__getitem__)
    return passed[0] if passed else "scalar"
