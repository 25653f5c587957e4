"""A linear method's self-check on the user's CPU, run before the method serves, cached beside the build.

A kernel variant compiled for an instruction set the build machine lacked, or
a library whose blocking changes with the CPU, can compute wrong or
batch-dependent numbers on a CPU nobody tested. So before a method serves it
shows, at the model's shapes (every K, and a few blocks of outputs: the
kernels block over rows and K, never over outputs), on random probe weights:

- invariance: each probe row gives bitwise the same outputs alone (one row)
  as inside batches of several sizes at several positions;
- twin equality (pair-dot and int8 variants): its outputs equal its plain-C
  reference (DP_SCALAR, INT8_SCALAR) bitwise, on typical values and on values
  whose partial sums are denormal (where flushing shows).

The outcome is cached per method and shape under a key of the kernel build
(sources, flags, compiler, CPU flags), torch's version and the thread count,
so a second run pays nothing.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cbrun.engine.backends.cpu.build.kernel_build import cache_root
from cbrun.engine.backends.cpu.kernels.abi import KernelError
from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.linear.methods import LayerMethod, LinearMethod

log = logging.getLogger("cbrun.engine")

# (batch size, position of the probe row): alone, small, odd, across block edges of 8, 32 and 64 rows
_CROWDS = ((1, 0), (5, 4), (9, 8), (37, 20), (64, 63), (67, 64), (130, 97))
_PROBE_ROWS = 3
_TRIAL_ROWS = 64
_TRIAL_OUTPUTS = 1024
_PROBE_OUTPUTS = 96  # outputs of a probe layer at most: three blocks of 32 (probe_shape)
_lock = threading.Lock()


@dataclass(frozen=True)
class Shape:
    """A linear layer's shape as the method sees it: outputs N, inputs K, gated (gate and up, N each)."""

    outputs: int
    inputs: int
    gated: bool = False

    def __str__(self) -> str:
        return f"{'gated ' if self.gated else ''}{self.inputs}->{self.outputs}"


@dataclass
class CheckResult:
    """How one method fared on this CPU at the model's shapes."""

    method: str
    passed: bool
    detail: str  # why it failed, or what it showed
    seconds: float  # what the check cost (0 when read from the cache)
    trial_ms: float = 0.0  # time of one 64-row call per shape, summed (for "fastest")
    cached: bool = False


def check_method(
    kernels: CpuKernels, method: LinearMethod, shapes: list[Shape], *, timed: bool = False, cache_key: str | None = None
) -> CheckResult:
    """Run (or read from the cache) `method`'s self-check at `shapes`; `timed` adds a speed trial."""
    probed = shapes if timed else sorted({probe_shape(s) for s in shapes}, key=str)  # a trial times real widths
    key = (
        f"{cache_key}|{method.name}|{torch.__version__}|{torch.get_num_threads()}|{timed}|"
        + ",".join(map(str, sorted(probed, key=str)))
        if cache_key
        else None
    )
    if key is not None and (stored := _read_cache().get(key)) is not None:
        return CheckResult(**{**stored, "seconds": 0.0, "cached": True})
    started = time.perf_counter()
    try:
        detail, trial = _run(kernels, method, shapes, timed)
    except (KernelError, RuntimeError) as exc:  # the method cannot run here at all
        detail, trial = f"failed to run: {exc}", 0.0
    result = CheckResult(method.name, detail.startswith("ok"), detail, time.perf_counter() - started, trial)
    if key is not None:
        _write_cache(key, result)
    return result


def _run(kernels: CpuKernels, method: LinearMethod, shapes: list[Shape], timed: bool) -> tuple[str, float]:
    """'ok ...' or the first failure, and the trial time in ms."""
    if not method.runs_on(kernels):
        return f"this CPU cannot run {method.name}", 0.0
    trial_ms = 0.0
    generator = torch.Generator().manual_seed(1234)
    for shape in sorted({probe_shape(s) for s in shapes}, key=str):
        layer, reference = _probe_layers(kernels, method, shape, generator)
        crowd = torch.randn(max(size for size, _ in _CROWDS) + _PROBE_ROWS, shape.inputs, generator=generator).to(
            method.weight_dtype
        )  # [R, K]
        for row in range(_PROBE_ROWS):
            alone = layer(crowd[row : row + 1], torch.float32)[0]
            for size, position in _CROWDS:
                batch = crowd[_PROBE_ROWS : _PROBE_ROWS + size].clone()
                batch[position] = crowd[row]
                if not _same_bits(layer(batch, torch.float32)[position], alone):
                    return f"not batch-invariant at {shape}: row {row} differs at position {position} of {size}", 0.0
        if reference is not None:
            for name, rows in (("typical", crowd[:_PROBE_ROWS]), ("tiny", _tiny_rows(shape, generator))):
                if not _same_bits(layer(rows, torch.float32), reference(rows, torch.float32)):
                    return f"differs from the plain-C reference at {shape} on {name} values", 0.0
    for shape in shapes if timed else []:  # the speed trial at (nearly) the real width
        trial = Shape(min(shape.outputs, _TRIAL_OUTPUTS), shape.inputs, shape.gated)
        layer, _ = _probe_layers(kernels, method, trial, generator, reference=False)
        trial_ms += _time_call(
            layer, torch.randn(_TRIAL_ROWS, shape.inputs, generator=generator).to(method.weight_dtype)
        )
    checks = "invariance" + (" and equality with the plain-C reference" if method.reference() is not None else "")
    return f"ok: {checks} at {len(shapes)} shapes", trial_ms


def probe_shape(shape: Shape) -> Shape:
    """The shape a check probes for a layer of `shape`: every input (a chain's length, which is what a kernel's
    blocking over K depends on) and at most _PROBE_OUTPUTS outputs, keeping the last partial block (N % 32),
    so an 8B model's 14336-wide MLP and 128k-word head cost the check what a small model's do."""
    if shape.outputs <= _PROBE_OUTPUTS:
        return shape
    return Shape(_PROBE_OUTPUTS - 32 + shape.outputs % 32, shape.inputs, shape.gated)


def _probe_layers(
    kernels: CpuKernels, method: LinearMethod, shape: Shape, generator: torch.Generator, reference: bool = True
) -> tuple[LayerMethod, LayerMethod | None]:
    """The method's layer on random weights of `shape` (and bias), and the reference's where it has one."""
    count = 2 if shape.gated else 1
    weights = [
        (torch.randn(shape.outputs, shape.inputs, generator=generator) / shape.inputs**0.5)
        .to(method.weight_dtype)
        .contiguous()
        for _ in range(count)
    ]
    biases = [torch.randn(shape.outputs, generator=generator).to(method.weight_dtype) for _ in range(count)]
    layer = method.make(kernels, weights, biases, gated=shape.gated)
    twin = None
    if reference and (plain := method.reference()) is not None:
        twin = plain.make(kernels, weights, biases, gated=shape.gated)
    return layer, twin


def _tiny_rows(shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """Rows whose products with the probe weights sum through denormal values (flushing shows there)."""
    return (torch.randn(2, shape.inputs, generator=generator) * 1e-37).to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )
    )


def _time_call(layer: LayerMethod, rows: torch.Tensor) -> float:
    layer(rows)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        layer(rows)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


# -- the cache -----------------------------------------------------------------------------------


def cache_path() -> Path:
    return cache_root() / "self_check.json"


def _read_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, result: CheckResult) -> None:
    """Merge one result into the cache file, replaced atomically (concurrent engines never see half)."""
    with _lock:
        entries = _read_cache()
        entries[key] = {k: v for k, v in asdict(result).items() if k not in ("cached",)}
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
                json.dump(entries, out, indent=1, sort_keys=True)
            os.replace(out.name, path)
        except OSError as exc:  # a read-only cache: the check runs again next time
            log.info("self-check cache not written (%s)", exc)
