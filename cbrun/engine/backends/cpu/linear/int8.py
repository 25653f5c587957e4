"""int8 linear methods (W8A8): weights quantized once at load, activations per row at every call, exact sums.

  method       weights            arithmetic (linear_int8.c)                         same bits on every CPU
  int8-amx     fp32/bf16 -> int8  AMX-INT8 tdpbssd tiles                              yes
  int8-vnni    fp32/bf16 -> int8  AVX512-VNNI vpdpbusd (u8 x s8, offset taken back)   yes
  int8-avx2    fp32/bf16 -> int8  AVX2 vpmaddwd on int16-widened operands             yes
  int8-scalar  fp32/bf16 -> int8  plain C int32 loops: the reference                  yes (slowest)

Every variant sums the same int8 products in int32, and an integer sum has no
order, so their outputs are the reference's bits by construction (the
self-check still proves it on the user's CPU before one serves). Weights:
symmetric per output channel (scale = max |w| / 127), or as a compressed-
tensors checkpoint gives them. Activations: symmetric per row (token), so a
row's numbers never depend on its neighbours. The output head and the
embeddings are not linear methods of this kind: they stay in the model's dtype.

The packed matrix (int8 weights, each output's weight sum and scale) is the
only copy the engine keeps. Reading a member back (`weight`, at close) gives
its dequantized values q * scale in the dtype it was given, so an int8
engine's model comes back quantized, carrying its int8 form beside it (the
tensor attribute PREQUANTIZED, as a compressed-tensors checkpoint's weights
do): a weight that carries its int8 form and equals that form's dequantized
values bit for bit is packed as that form (quantizing q * scale again in bf16
would not always give q and scale back), so sleep(level=2) and wake_up, or a
second engine on the same model, serve the same int8 weights. Any other
weight, or one changed since, is quantized by the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch

from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.kernels.int8 import dequantize_weight, quantize_weight
from cbrun.engine.backends.cpu.linear.methods import LayerMethod, LinearMethod
from cbrun.engine.backends.cpu.linear.packed_layout import PackedLinear

PREQUANTIZED = "cbrun_int8"  # a weight tensor's attribute: its int8 form (q [N, K] int8, scale [N] fp32)


@dataclass(frozen=True)
class Int8Method(LinearMethod):
    """A variant of the int8 kernel: reads fp32 or bf16 nn.Linear weights, quantizes them at `make`."""

    def reads(self, module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
        """A plain CPU nn.Linear of fp32 or bf16, contiguous, whose K keeps the int32 sums from overflowing."""
        if type(module) is not torch.nn.Linear:
            return False
        weight, bias = module.weight, module.bias
        return (
            weight.dtype in (torch.float32, torch.bfloat16)
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
            and weight.shape[1] * 127 * 128 < 2**31
        )

    def runs_on(self, kernels: CpuKernels) -> bool:
        return kernels.int8.variant_runs(self.variant)

    def reference(self) -> LinearMethod | None:
        return INT8_SCALAR if self.variant != "scalar" else None

    def make(
        self,
        kernels: CpuKernels,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
        gated: bool = False,
    ) -> LayerMethod:
        return Int8Linear(kernels, self.variant, weights, biases, gated)


INT8_AMX = Int8Method("int8-amx", torch.bfloat16, True, "int8", "amx")
INT8_VNNI = Int8Method("int8-vnni", torch.bfloat16, True, "int8", "vnni")
INT8_AVX2 = Int8Method("int8-avx2", torch.bfloat16, True, "int8", "avx2")
INT8_SCALAR = Int8Method("int8-scalar", torch.bfloat16, True, "int8", "scalar")
INT8_METHODS = {m.name: m for m in (INT8_AMX, INT8_VNNI, INT8_AVX2, INT8_SCALAR)}


def int8_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for `weight`: the int8 form it carries when it equals that form dequantized, bit for bit, else
    quantize_weight's. The carried form is consumed (the packed matrix is then its only copy)."""
    given = getattr(weight, PREQUANTIZED, None)
    if given is not None:
        delattr(weight, PREQUANTIZED)
        q, scale = given
        if q.shape == weight.shape and torch.equal(dequantize_weight(q, scale, weight.dtype), weight.detach()):
            return q, scale
    return quantize_weight(weight)


class Int8Linear(PackedLinear):
    """linear_int8.c: one or several weights (q|k|v; or gate and up, gated) quantized and packed side by side."""

    serves_rows = False  # rows read back dequantized: a tied embedding keeps its own table

    def __init__(
        self,
        kernels: CpuKernels,
        variant: str,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
        gated: bool,
    ) -> None:
        super().__init__(weights, biases, gated)
        self.int8, self.variant = kernels.int8, variant
        self.dtype = self.bias_dtype = weights[0].dtype  # what `weight` gives back, and biases are rounded through
        self.packed = self.int8.packed(self.outputs, self.inner, gated)  # int8 [blocks * (Kp * 32 + 256)]
        for index, weight in enumerate(weights):
            self._pack_form(index, *int8_form(weight))

    def _linear(self, rows: torch.Tensor, mode: str, out_dtype: torch.dtype | None) -> torch.Tensor:
        return self.int8.linear(
            rows,
            self.packed,
            self.outputs,
            self.inner,
            self.variant,
            bias=self.bias,
            up_bias=self.up_bias,
            mode=mode,
            out_dtype=out_dtype,
        )

    def quantized(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Member `index`'s int8 weights [N_index, K] and scales [N_index], exactly as packed."""
        return self.int8.unpack(self.packed, self.inner, self.roles[index], self.starts[index], self.widths[index])

    def weight(self, index: int) -> torch.Tensor:
        """q * scale [N_index, K] in the dtype it was given, carrying its int8 form (PREQUANTIZED)."""
        q, scale = self.quantized(index)
        dense = dequantize_weight(q, scale, self.dtype)
        setattr(dense, PREQUANTIZED, (q, scale))
        return dense

    def rows(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        start = self.starts[index]
        q, scale = self.int8.unpack(self.packed, self.inner, self.roles[index], ids=ids + start if start else ids)
        return dequantize_weight(q, scale, self.dtype)

    def _pack(self, index: int, weight: torch.Tensor) -> None:
        """A loaded weight, quantized by the rule (load: a weight that is not this member's own int8 form)."""
        self._pack_form(index, *quantize_weight(weight))

    def _pack_form(self, index: int, q: torch.Tensor, scale: torch.Tensor) -> None:
        q = q if q.stride(-1) == 1 else q.contiguous()
        scale = scale.detach().float().reshape(-1).contiguous()
        self.int8.pack_into(self.packed, self.inner, q, scale, self.roles[index], self.starts[index])
