"""The decoder's linear layers on CPU, through the compiled kernel at every row count.

The kernel (csrc/linear.c) reads fp32 or bf16 weights in place and sums every
output in one order whatever the number of rows, so a request's projections
are the same bits alone or in a step of a thousand rows (batch invariance).
BLAS GEMMs cannot promise that: they pick their blocking over K by the shape
of the call and switch kernels with M. At decode sizes the kernel is also
faster (BLAS repacks each weight matrix on every call).

The patch is per module instance (a `forward` attribute), installed by the
engine core for its lifetime and removed by `uninstall`.
"""

from __future__ import annotations

import functools

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_can_read(module) -> bool:
    """Whether `module` is a plain nn.Linear whose weight the kernel can read in place (fp32 or bf16, CPU,
    contiguous, a bias of the same dtype if any)."""
    if type(module) is not torch.nn.Linear:
        return False
    weight, bias = module.weight, module.bias
    return weight.dtype in KERNEL_DTYPES and weight.device.type == "cpu" and weight.is_contiguous() \
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))


def install_kernel_linears(model: torch.nn.Module, kernels) -> list[torch.nn.Linear]:
    """Route every nn.Linear of `model` the kernel can read through it; returns them. (A plain output
    head is projected by the runner itself, to fp32 logits; heads it leaves to the model use this.)"""
    patched = []
    for module in model.modules():
        if kernel_can_read(module):
            module.forward = functools.partial(kernel_linear, kernels, module.weight, module.bias)
            patched.append(module)
    return patched


def uninstall(modules: list[torch.nn.Linear]) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)


def kernel_linear(kernels, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] in `out_dtype` (default x's) through the kernel."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = kernels.linear(rows, weight, bias, out_dtype)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])
