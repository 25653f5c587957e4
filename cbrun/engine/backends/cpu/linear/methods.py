"""Linear methods: how the model's linear layers compute on CPU, chosen once at load, never per call.

A method is an arithmetic (which bits a row gets) and a kernel that computes it.
The backend picks one per weight dtype when it installs a model (selector.py
runs each candidate's self-check first), then gives every layer a *layer
method*: an object holding that layer's weights in the layout its kernel reads,
packed once, that computes the layer for any number of rows in one order.

  method        weights  arithmetic                                         same bits on every CPU
  f32           fp32     linear.c: one fp32 FMA chain over k                yes
  dpbf16-amx    bf16     linear_dpbf16.c: AMX's tdpbf16ps order, on tiles   yes
  dpbf16-isa    bf16     the same order on re-paired vdpbf16ps (AVX512-BF16) yes
  dpbf16-twin   bf16     the same order in portable vector FMAs (AVX-512F,   yes
                         AVX2), flush modes set
  dpbf16-scalar bf16     the same order in plain C (tile_order.h: the        yes (slowest)
                         reference)
  onednn-b64    bf16     oneDNN's packed bf16 GEMM on fixed 64-row blocks    no: this CPU's own (opt-in)

The bf16 order is the one AMX computes natively (16-pair blocks of K, an even
and an odd chain each, C + (E + O)), so an AMX CPU runs its tiles at full speed
and every other CPU computes the same bits with vector instructions.

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

from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.linear.onednn import BlockedOneDnn
from cbrun.engine.backends.cpu.linear.packed_layout import PackedLinear
from cbrun.engine.weights import shareable


class LayerMethod(Protocol):
    """One layer's weights in its kernel's layout: x [M, K] -> [M, N] (gated: silu(gate) * up).

    A layer method holds one or several *members* (the nn.Linear weights it was
    made from, side by side: q, k, v; or gate and up). Where it packs them
    (`owns_weights`), its packed matrix is the only copy the engine keeps: the
    module's own tensor is dropped, and `weight` reads a member back, bit for
    bit, `load` replaces one in place, and `member` computes one alone (the
    stock forward of a fused layer calls its linears one by one).
    """

    owns_weights: bool  # the weights live in this method's own layout (the module's copy may be dropped)
    serves_rows: bool  # `rows` is cheap: a tied embedding may look its rows up here

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def member(self, index: int, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Member `index` alone: x [M, K] -> [M, N_index] (a gated method's gate or up sums, plus bias)."""
        ...

    def gated_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated method's gate and up sums (plus biases) in one pass: x [M, K] -> fp32 [M, N] each, whose
        silu_mul is the gated call's result bit for bit (LoRA adds its deltas in between)."""
        ...

    def weight(self, index: int) -> torch.Tensor:
        """Member `index`'s weight [N_index, K] in its dtype, exactly as it was given."""
        ...

    def load(self, index: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        """Replace member `index`'s weight and/or bias (same shape, converted to the method's dtype): packed again in
        place, or, for a method that reads the weights in place, the tensor itself taken where it can be read as
        it is (weights.place)."""
        ...

    def rows(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of member `index`'s weight: [T, K] (a tied embedding's lookup)."""
        ...

    def release(self) -> None:
        """Free this method's own storage; it cannot compute afterwards (the backend is closing)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes this method holds of its own (packed weights, fp32 bias copies); 0 when it reads in place."""
        ...


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

    def runs_on(self, kernels: CpuKernels) -> bool:
        """Whether this CPU can run the method's kernel at all (an ISA variant needs its instructions)."""
        return self.kernel != "dp" or kernels.dp.variant_runs(self.variant)

    def reference(self) -> LinearMethod | None:
        """The plain-C method this one must equal bit for bit (its self-check compares them), if any."""
        return DP_SCALAR if self.kernel == "dp" and self.variant != "scalar" else None

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
            return BlockedOneDnn(weights, biases, gated)
        raise ValueError(f"unknown linear kernel {self.kernel!r}")


F32 = LinearMethod("f32", torch.float32, True, "linear")
DP_AMX = LinearMethod("dpbf16-amx", torch.bfloat16, True, "dp", "amx")
DP_ISA = LinearMethod("dpbf16-isa", torch.bfloat16, True, "dp", "isa")
DP_TWIN = LinearMethod("dpbf16-twin", torch.bfloat16, True, "dp", "twin")
DP_SCALAR = LinearMethod("dpbf16-scalar", torch.bfloat16, True, "dp", "scalar")
ONEDNN_B64 = LinearMethod("onednn-b64", torch.bfloat16, False, "onednn")
METHODS = {m.name: m for m in (F32, DP_AMX, DP_ISA, DP_TWIN, DP_SCALAR, ONEDNN_B64)}


class MemberForward:
    """One member of a layer method as its linear's own forward: x [..., K] -> [..., N_index]. A fused
    layer's stock forward (probes, callers other than the engine) calls its linears through these."""

    def __init__(self, method: LayerMethod, index: int) -> None:
        self.method, self.index = method, index

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.method.member(self.index, x, out_dtype)


class _InPlaceLinear:
    """linear.c: fp32 (or bf16, widened) weights read in place, several sharing x in one pass."""

    owns_weights = False
    serves_rows = True
    nbytes = 0

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

    def member(self, index: int, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self.kernels.linear(rows, self.weights[index], self.biases[index], out_dtype)  # [M, N_index]
        return out.view(*x.shape[:-1], out.shape[-1])

    def gated_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        gate, up = (self.kernels.linear(rows, w, b, torch.float32) for w, b in zip(self.weights, self.biases))
        return gate, up

    def weight(self, index: int) -> torch.Tensor:
        return self.weights[index]

    def load(self, index: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            if weight is not None:
                self.weights[index] = _read_in_place(self.weights[index], weight)
            if bias is not None and (own := self.biases[index]) is not None:
                self.biases[index] = _read_in_place(own, bias)

    def rows(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        return self.weights[index].index_select(0, ids)

    def release(self) -> None:
        self.weights, self.biases = [], []


def _read_in_place(own: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """What an in-place method reads from now on: `new` itself where the kernel can read it as it is (the model's
    tensor, or a trainer's shared with it: no copy), else `own` holding new's values (converted)."""
    if shareable(own, new):
        return new.detach()
    own.copy_(new)
    return own


class _PairDotLinear(PackedLinear):
    """linear_dpbf16.c: bf16 weights packed once into pair-interleaved blocks (AMX's B-tile layout); one variant's
    kernel.

    The packed matrix is the only copy of the weights: each member is packed
    straight from its tensor into its own output lanes, and read back out of
    them (unpack, exact) when the model wants its dense weights again.
    """

    serves_rows = True
    bias_dtype = torch.bfloat16

    def __init__(
        self,
        kernels: CpuKernels,
        variant: str,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
        gated: bool,
    ) -> None:
        super().__init__(weights, biases, gated)
        self.dp, self.variant = kernels.dp, variant
        self.packed = self.dp.packed(self.outputs, self.inner, gated)  # [blocks * Kp * 32] int16
        for index, weight in enumerate(weights):
            self._pack(index, weight)

    def _linear(self, rows: torch.Tensor, mode: str, out_dtype: torch.dtype | None) -> torch.Tensor:
        gated: bool | str = "raw" if mode == "raw" else mode == "silu"
        return self.dp.linear(
            rows,
            self.packed,
            self.outputs,
            self.inner,
            self.variant,
            bias=self.bias,
            up_bias=self.up_bias,
            gated=gated,
            out_dtype=out_dtype,
        )

    def member(self, index: int, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        start, width, block = self.starts[index], self.widths[index], self.dp.block_outputs
        if self.gated or start % block:
            return super().member(index, x, out_dtype)
        # a member on its own blocks is computed alone: the same chains, without the other members' outputs
        per_block = self.dp.padded_inner(self.inner) * block
        bias = self.bias[start : start + width] if self.bias is not None else None
        out = self.dp.linear(
            x.reshape(-1, x.shape[-1]),
            self.packed[start // block * per_block :],
            width,
            self.inner,
            self.variant,
            bias=bias,
            out_dtype=out_dtype,
        )  # [M, N_index]
        return out.view(*x.shape[:-1], width)

    def weight(self, index: int) -> torch.Tensor:
        return self.dp.unpack(
            self.packed, self.inner, self.roles[index], self.starts[index], self.widths[index]
        )  # [N_index, K] bf16

    def rows(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        start = self.starts[index]
        return self.dp.unpack(self.packed, self.inner, self.roles[index], ids=ids + start if start else ids)

    def _pack(self, index: int, weight: torch.Tensor) -> None:
        rows = weight.detach().to(torch.bfloat16)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        self.dp.pack_into(self.packed, self.inner, rows, self.roles[index], self.starts[index])
