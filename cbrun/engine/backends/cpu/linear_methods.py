"""Linear methods: how the model's linear layers compute on CPU, chosen once at load, never per call.

A method is an arithmetic (which bits a row gets) and a kernel that computes it.
The backend picks one per weight dtype when it installs a model (selector.py
runs each candidate's self-check first), then gives every layer a *layer
method*: an object holding that layer's weights in the layout its kernel reads,
packed once, that computes the layer for any number of rows in one order.

  method        weights  arithmetic                                         same bits on every CPU
  f32           fp32     linear.c: one fp32 FMA chain over k                yes
  dpbf16-isa    bf16     linear_dpbf16.c: vdpbf16ps pair chain (AVX512-BF16) yes
  dpbf16-twin   bf16     the same chain in portable vectors, flush modes set yes (slower)
  dpbf16-scalar bf16     the same chain in plain C (the reference)           yes (slowest)
  onednn-b64    bf16     oneDNN's packed bf16 GEMM on fixed 64-row blocks    no: this CPU's own (opt-in)

Batch invariance for oneDNN comes from never letting it see the batch: every
call is one block of 64 rows (the last zero-padded), so its blocking over K
cannot change with M. That held in probes but oneDNN promises only run-to-run
determinism of one primitive, so it is a machine-local, opt-in method
(`kernels="fastest"`), and its self-check runs on every new machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch

from cbrun.engine.backends.cpu.kernels import CpuKernels


class LayerMethod(Protocol):
    """One layer's weights in its kernel's layout: x [M, K] -> [M, N] (gated: silu(gate) * up)."""

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class LinearMethod:
    """A family of arithmetic and its kernel: makes layer methods from nn.Linear weights."""

    name: str
    weight_dtype: torch.dtype
    portable: bool  # the same bits on every CPU (a twin exists); False: this machine's own arithmetic
    kernel: str  # "linear" (linear.c), "dp" (linear_dpbf16.c, with `variant`), "onednn"
    variant: str = ""

    def reads(self, module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
        """Whether this method can take `module`: a plain CPU nn.Linear of its weight dtype, contiguous."""
        if type(module) is not torch.nn.Linear:
            return False
        weight, bias = module.weight, module.bias
        return (
            weight.dtype == self.weight_dtype
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
        )

    def make(
        self,
        kernels: CpuKernels,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
        gated: bool = False,
    ) -> LayerMethod:
        """A layer method for `weights` side by side ([N_i, K] each; outputs concatenated), or, with
        `gated`, for gate and up ([N, K] each) giving silu(x @ gate^T + b) * (x @ up^T + b)."""
        if self.kernel == "linear":
            return _InPlaceLinear(
                kernels, [w.detach() for w in weights], [b.detach() if b is not None else None for b in biases], gated
            )
        if self.kernel == "dp":
            return _PairDotLinear(kernels, self.variant, weights, biases, gated)
        if self.kernel == "onednn":
            return _BlockedOneDnn(weights, biases, gated)
        raise ValueError(f"unknown linear kernel {self.kernel!r}")


F32 = LinearMethod("f32", torch.float32, True, "linear")
DP_ISA = LinearMethod("dpbf16-isa", torch.bfloat16, True, "dp", "isa")
DP_TWIN = LinearMethod("dpbf16-twin", torch.bfloat16, True, "dp", "twin")
DP_SCALAR = LinearMethod("dpbf16-scalar", torch.bfloat16, True, "dp", "scalar")
ONEDNN_B64 = LinearMethod("onednn-b64", torch.bfloat16, False, "onednn")
METHODS = {m.name: m for m in (F32, DP_ISA, DP_TWIN, DP_SCALAR, ONEDNN_B64)}


def _fp32_bias(biases: Sequence[torch.Tensor | None], widths: list[int]) -> torch.Tensor | None:
    """The biases side by side in fp32 [sum N_i] (zeros for a missing one), or None when there are none."""
    if all(b is None for b in biases):
        return None
    parts = [b.detach().float() if b is not None else torch.zeros(n) for b, n in zip(biases, widths)]
    return torch.cat(parts).contiguous()


class _InPlaceLinear:
    """linear.c: fp32 (or bf16, widened) weights read in place, several sharing x in one pass."""

    def __init__(
        self, kernels: CpuKernels, weights: list[torch.Tensor], biases: list[torch.Tensor | None], gated: bool
    ) -> None:
        self.kernels, self.weights, self.biases, self.gated = kernels, weights, biases, gated

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if self.gated:
            out = self.kernels.gated_silu(rows, self.weights[0], self.weights[1], *self.biases)
            out = out if out_dtype in (None, out.dtype) else out.to(out_dtype)
        else:
            out = self.kernels.linear_many(rows, self.weights, self.biases, out_dtype)  # [M, sum N_i]
        return out.view(*x.shape[:-1], out.shape[-1])


class _PairDotLinear:
    """linear_dpbf16.c: bf16 weights packed once into pair-interleaved blocks; one variant's kernel."""

    def __init__(
        self,
        kernels: CpuKernels,
        variant: str,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
        gated: bool,
    ) -> None:
        self.kernels, self.variant, self.gated = kernels, variant, gated
        self.inner = weights[0].shape[1]
        if gated:
            self.outputs = weights[0].shape[0]
            self.packed = kernels.dp_pack(weights[0].detach().contiguous(), weights[1].detach().contiguous())
            self.bias = _fp32_bias(biases[:1], [self.outputs])
            self.up_bias = _fp32_bias(biases[1:], [self.outputs])
        else:
            whole = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
            self.outputs = whole.shape[0]
            self.packed = kernels.dp_pack(whole.contiguous())  # [blocks * Kp * 32] int16
            self.bias = _fp32_bias(biases, [w.shape[0] for w in weights])
            self.up_bias = None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self.kernels.dp_linear(
            rows, self.packed, self.outputs, self.inner, self.variant, self.bias, self.up_bias, self.gated, out_dtype
        )  # [M, N]
        return out.view(*x.shape[:-1], self.outputs)


class _BlockedOneDnn:
    """oneDNN's bf16 GEMM on its packed weight, always called on one block of BLOCK rows (zero-padded)."""

    BLOCK = 64

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], gated: bool) -> None:
        whole = torch.cat([w.detach() for w in weights]).contiguous()  # [sum N_i, K] (gated: gate then up)
        self.gated = gated
        self.outputs = whole.shape[0] // 2 if gated else whole.shape[0]
        widths = [w.shape[0] for w in weights]
        bias = _fp32_bias(biases, widths)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(whole, self.BLOCK)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
        count = rows.shape[0]
        padded = -(-count // self.BLOCK) * self.BLOCK
        if padded != count:
            rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
        blocks = [
            torch.ops.mkldnn._linear_pointwise(rows[i : i + self.BLOCK], self.packed, self.bias, "none", [], "")
            for i in range(0, padded, self.BLOCK)
        ]
        out = torch.cat(blocks)[:count]  # [M, N or 2N] bf16
        if self.gated:
            gate, up = out.float().split(self.outputs, dim=1)
            out = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        out = out.to(out_dtype or x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])
