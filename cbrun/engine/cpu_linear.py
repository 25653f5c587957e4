"""Small-batch linear layers on CPU: the decoder's projections through the compiled kernel.

At decode sizes (up to a few dozen rows per step) the BLAS fp32 GEMM repacks
each weight matrix on every call, which costs as much as the multiply; the
kernel in csrc/linear.c reads weights in place. Measured on the
default model's shapes, streaming all 30 layers' weights (AVX2, 2 threads):
about 2x the GFLOP/s of `F.linear` at 4-32 rows, 1.3x at 64, 1.0-1.3x at
128-256. Raising the switch-over from 64 to 256 rows made a W-random-like
run 7-10% faster end to end (its decode steps hold 100-250 rows); larger
steps (prefill chunks) go back to `F.linear`, which is level there.

The patch is per module instance (a `forward` attribute), installed by the
engine core for its lifetime and removed by `uninstall`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MAX_KERNEL_ROWS = 256  # above this the BLAS GEMM is as fast (measured)


def kernel_can_read(module) -> bool:
    """Whether `module` is a plain nn.Linear whose weight the kernel can read in place (fp32, CPU, contiguous)."""
    return type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 \
        and module.weight.device.type == "cpu" and module.weight.is_contiguous()


def install_small_batch_linears(decoder: torch.nn.Module, kernels) -> list[torch.nn.Linear]:
    """Route every fp32 CPU nn.Linear under `decoder` through the kernel for small batches; returns them."""
    patched = []
    for module in decoder.modules():
        if kernel_can_read(module):
            module.forward = functools.partial(_small_batch_forward, module, kernels)
            patched.append(module)
    return patched


def uninstall(modules: list[torch.nn.Linear]) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)


def small_batch_linear(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       large=F.linear) -> torch.Tensor:
    """x [..., K] -> [..., N]: the kernel when the flattened fp32 rows are few, else `large(x, weight, bias)`."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] > MAX_KERNEL_ROWS or x.dtype != torch.float32:
        return large(x, weight, bias)
    out = kernels.linear(rows, weight, bias)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])


def _small_batch_forward(module: torch.nn.Linear, kernels, x: torch.Tensor) -> torch.Tensor:
    return small_batch_linear(kernels, x, module.weight, module.bias)
