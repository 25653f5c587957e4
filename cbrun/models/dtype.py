"""The dtype and device a model is loaded in: names the user types -> torch's, and what 'auto' means here."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("cbrun")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
_DTYPE_CHOICES = "auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)"


def resolve_device(device: str = "auto") -> str:
    """'auto' means the GPU when there is one: the engine is much faster there."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Map a dtype name to a torch dtype; 'auto' picks the fastest exact-enough one for `device`.

    On CPU 'auto' is bfloat16 where the CPU has bf16 dot products (AVX512-BF16
    or AMX: Zen 4 and later, Sapphire Rapids and later) and cbrun's kernel for
    them (the AMX tiles, or vdpbf16ps) passes its self-check here: there bf16
    runs several times faster than fp32, and its bits are the same on every CPU
    (AMX's tile order; a CPU without either computes them with vector FMAs,
    more slowly). Elsewhere it is
    float32, the fastest arithmetic such a CPU has.
    """
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"unsupported dtype {name}; choose one of {_DTYPE_CHOICES}")
    key = str(name).lower()
    if key == "auto":
        return _auto_dtype(device)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {_DTYPE_CHOICES}")
    return _DTYPES[key]


def _auto_dtype(device: str) -> torch.dtype:
    """'auto' for `device`. On a CPU that reports bf16 dot products this builds (or loads from the disk
    cache) the CPU kernels before any engine exists: whether bf16 serves is their self-check's verdict,
    and it must be known before the weights are read in that dtype. The kernels are the process's one
    copy (kernels/loader.py's load_cpu_kernels), the same object the engine's CPU backend takes up later, so
    nothing is built twice; explicit dtypes, CUDA and CPUs without the instructions build nothing here."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if os.environ.get("CBRUN_KERNELS", "").lower() == "torch":
        return torch.float32  # the torch reference paths: no bf16 kernel to serve
    from cbrun.engine.backends.cpu.linear.method_selector import bf16_dot_products_here

    ready, why = bf16_dot_products_here()
    log.info("--dtype auto on CPU: %s (%s)", "bfloat16" if ready else "float32", why)
    return torch.bfloat16 if ready else torch.float32
