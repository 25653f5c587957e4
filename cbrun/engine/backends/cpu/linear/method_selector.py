"""Which linear method serves each weight dtype: chosen once at load, after each candidate's self-check.

Policies (EngineConfig.kernels, `--kernels`):
  portable  the default: methods whose bits are the same on every CPU. bf16
            takes vdpbf16ps where the CPU has AVX512-BF16, else its portable
            twin, else the plain-C reference (the same numbers, slower).
  fastest   also machine-local methods (oneDNN's packed bf16 on fixed blocks),
            when a short timed trial shows one faster and it passes the
            invariance probe on this CPU. Still batch-invariant here; its bits
            differ from other CPUs'.

int8 (EngineConfig.quantization): one W8A8 method serves every linear but the
output head, the first of AMX-INT8, AVX512-VNNI, AVX2 and the plain-C
reference that passes (all give the same bits: linear/int8.py).

A candidate that fails its check is skipped with one log line and the next
one serves; the results go to `cbrun info` and the run summary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.linear.int8 import INT8_AMX, INT8_AVX2, INT8_SCALAR, INT8_VNNI
from cbrun.engine.backends.cpu.linear.methods import DP_AMX, DP_ISA, DP_SCALAR, DP_TWIN, F32, ONEDNN_B64, LinearMethod
from cbrun.engine.backends.cpu.linear.self_check import CheckResult, Shape, check_method
from cbrun.engine.config import KERNEL_POLICIES

log = logging.getLogger("cbrun.engine")

# The bf16 methods of one order that may serve one CPU (an AMX CPU runs all three): where more than one runs here,
# each is checked and timed at the model's shapes and the fastest serves, whatever the policy (the same bits).
_RACED_BF16 = (DP_AMX, DP_ISA, DP_TWIN)

_CANDIDATES: dict[tuple[str, torch.dtype], list[LinearMethod]] = {
    ("portable", torch.float32): [F32],
    ("portable", torch.bfloat16): [DP_AMX, DP_ISA, DP_TWIN, DP_SCALAR],
    ("fastest", torch.float32): [F32],
    ("fastest", torch.bfloat16): [DP_AMX, DP_ISA, ONEDNN_B64, DP_TWIN, DP_SCALAR],
    ("portable", torch.int8): [INT8_AMX, INT8_VNNI, INT8_AVX2, INT8_SCALAR],  # W8A8, from fp32 or bf16 weights
    ("fastest", torch.int8): [INT8_AMX, INT8_VNNI, INT8_AVX2, INT8_SCALAR],
}


@dataclass
class MethodChoice:
    """The method serving one weight dtype, and every candidate's check (in the order tried)."""

    dtype: torch.dtype
    method: LinearMethod | None
    checks: list[CheckResult] = field(default_factory=list)

    def brief(self) -> str:
        """ "bfloat16 dpbf16-isa (same bits on every CPU)": the run summary's line."""
        name = self.method.name if self.method else "none"
        bits = "same bits on every CPU" if self.method and self.method.portable else "this CPU only"
        label = "int8 W8A8 (every linear but the head)" if self.dtype == torch.int8 else str(self.dtype)[6:]
        return f"{label} {name} ({bits})"

    def summary(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.method is None:
            return f"{name}: no method passed its self-check"
        chosen = next(c for c in self.checks if c.method == self.method.name)
        skipped = [f"{c.method} ({c.detail})" for c in self.checks if not c.passed]
        bits = "the same bits on every CPU" if self.method.portable else "this CPU's own bits"
        text = (
            f"{name}: {self.method.name} ({bits}; self-check {chosen.detail}"
            f"{', cached' if chosen.cached else f', {chosen.seconds:.2f} s'})"
        )
        return text + (f"; skipped {'; '.join(skipped)}" if skipped else "")


def choose_linear_method(
    kernels: CpuKernels,
    dtype: torch.dtype,
    shapes: list[Shape],
    policy: str = "portable",
    candidates: list[LinearMethod] | None = None,
) -> MethodChoice:
    """The first candidate that passes its self-check at `shapes`, or a choice with no method. A timed trial
    picks the quickest passing one among the methods of bf16's one order that run here (AMX tiles, vdpbf16ps,
    vector FMAs), and under "fastest" among every passing method but the plain-C references."""
    if policy not in KERNEL_POLICIES:
        raise ValueError(f"unknown kernel policy {policy!r} (choose from {', '.join(KERNEL_POLICIES)})")
    candidates = candidates if candidates is not None else _CANDIDATES.get((policy, dtype), [])
    choice = MethodChoice(dtype, None)
    timed = policy == "fastest"
    racing = [m for m in candidates if timed and m not in (DP_SCALAR, INT8_SCALAR)]
    if not timed and len(same_order := [m for m in candidates if m in _RACED_BF16 and m.runs_on(kernels)]) > 1:
        racing, timed = same_order, True
    for method in racing:  # "fastest": every fast candidate runs its check and trial
        choice.checks.append(check_method(kernels, method, shapes, timed=True, cache_key=kernels.build_name))
    passed = [(c.trial_ms, m) for c, m in zip(choice.checks, racing) if c.passed]
    if passed:
        choice.method = min(passed, key=lambda pair: pair[0])[1]
    for method in candidates:
        if choice.method is not None:
            break
        if method in racing:
            continue
        result = check_method(kernels, method, shapes, cache_key=kernels.build_name)
        choice.checks.append(result)
        if result.passed:
            choice.method = method
    for result in choice.checks:
        if not result.passed:
            log.info("linear method %s not used: %s", result.method, result.detail)
    return choice


_READY_SHAPES = [Shape(64, 576), Shape(40, 1536)]  # a probe of the instruction before a model is loaded


def bf16_dot_products_here() -> tuple[bool, str]:
    """Whether this CPU has bf16 dot products that serve: it reports AVX512-BF16 or AMX-BF16, the kernels
    build, and the tiles (or vdpbf16ps) pass their self-check (at small shapes; the model's shapes are checked at load).
    Returns (ready, why) for `--dtype auto` and `cbrun info`."""
    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
    from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

    flags = set(cpu_flags().split())
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return False, "the CPU has no bf16 dot products (AVX512-BF16 or AMX)"
    kernels = load_cpu_kernels()
    if kernels is None:
        return False, "the compiled kernels are unavailable"
    method = DP_AMX if DP_AMX.runs_on(kernels) else DP_ISA
    what = "AMX tiles" if method is DP_AMX else "vdpbf16ps"
    result = check_method(kernels, method, _READY_SHAPES, cache_key=kernels.build_name)
    if not result.passed:
        return False, f"{what} failed the self-check: {result.detail}"
    return True, f"{what} passed the self-check"
