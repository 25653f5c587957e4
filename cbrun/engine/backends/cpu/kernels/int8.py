"""The int8 linear kernels (linear_int8.c) from Python: weight quantization, packing, and the W8A8 GEMM.

The signatures, variant, role and mode numbers are declared with every other
kernel's, in kernels/abi.py; which variants run here is found at load
(kernels/isa_variants.py). This module checks the tensors and calls them. Weights are quantized
here, once, in torch (elementwise IEEE operations: the same bits on every
CPU); activations are quantized by the kernel, row by row, at every call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import torch

from cbrun.engine.backends.cpu.kernels.abi import (
    MODES,
    ROLES,
    VARIANTS,
    KernelError,
    LinearParams,
    check,
    is_bf16,
    optional_ptr,
    ptr,
    threads,
    unit_stride_rows,
)

if TYPE_CHECKING:
    from cbrun.engine.backends.cpu.kernels.isa_variants import IsaVariants

_FLOATS = (torch.float32, torch.bfloat16)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight [N, K] (fp32 or bf16) -> (q [N, K] int8, scale [N] fp32),
    scale = max |w[n]| / 127 and q = round_half_even(w / scale) (|q| <= 127; a zero row has scale 0, q 0)."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1) / 127.0  # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wide / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] int8 and scale [N] -> q * scale [N, K] in `dtype` (one fp32 product, rounded once)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


class Int8Kernels:
    """linear_int8.c's entry points on the loaded library, with their arguments checked."""

    VARIANTS = VARIANTS["int8"]  # the variant numbers (kernel_abi), by name
    ROLES = ROLES
    MODES = MODES

    def __init__(self, library: ctypes.CDLL, variants: IsaVariants) -> None:
        self._lib = library
        self.variants = variants
        self.block_outputs = int(self._lib.i8_block_outputs())
        self._local = threading.local()  # per-thread scratch (engines may step in their own threads)

    def variant_runs(self, variant: str) -> bool:
        """Whether this CPU runs the variant (avx2, vnni: the CPU reports the ISA; amx: also Linux grants tiles),
        as the load found (kernels/isa_variants.py)."""
        return self.variants.runnable("int8", variant)

    def inner_fits(self, inner: int) -> bool:
        """Whether no int32 sum can overflow at K = inner: K * 127 * 128 < 2^31."""
        return bool(self._lib.i8_inner_fits(inner))

    def inner_padded(self, inner: int) -> int:
        return int(self._lib.i8_inner_padded(inner))

    def packed(self, outputs: int, inner: int, gated: bool = False) -> torch.Tensor:
        """An empty packed matrix (zeros) of `outputs` outputs over `inner` inputs (gated: that many gate and up)."""
        if not self.inner_fits(inner):
            raise KernelError(f"int8: K = {inner} could overflow int32 sums (K * 127 * 128 must stay below 2^31)")
        return torch.zeros(int(self._lib.i8_packed_size(outputs, inner, int(gated))), dtype=torch.int8)

    def pack_into(
        self,
        packed: torch.Tensor,
        inner: int,
        q: torch.Tensor,
        scale: torch.Tensor,
        role: str = "plain",
        first: int = 0,
    ) -> None:
        """Write q [n, K] int8 (rows unit-stride) and scale [n] fp32 as outputs first .. first + n - 1 of `role`."""
        if (
            q.dtype != torch.int8
            or q.dim() != 2
            or q.shape[1] != inner
            or q.stride(1) != 1
            or scale.dtype != torch.float32
            or scale.shape != (q.shape[0],)
            or not scale.is_contiguous()
        ):
            raise KernelError(f"int8 pack: q {tuple(q.shape)} {q.dtype} with scale {tuple(scale.shape)} {scale.dtype}")
        self._check_blocks(packed, inner, role, first + q.shape[0] - 1, "int8 pack")
        status = self._lib.i8_pack_weight(
            ptr(q), q.stride(0), ptr(scale), q.shape[0], inner, self.ROLES[role], first, ptr(packed), threads()
        )
        check(status, "int8 pack")

    def unpack(
        self,
        packed: torch.Tensor,
        inner: int,
        role: str = "plain",
        first: int = 0,
        count: int = 0,
        ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs of `role` back out, exactly: (q [count, K] int8, scale [count] fp32), outputs first ..
        first + count - 1, or the outputs `ids` (int64 [T]) when given."""
        if ids is not None:
            if ids.dtype != torch.int64 or not ids.is_contiguous():
                raise KernelError("int8 unpack: ids must be contiguous int64")
            count = ids.numel()
        if count:
            last = int(ids.max()) if ids is not None else first + count - 1
            if ids is not None and int(ids.min()) < 0:
                raise KernelError("int8 unpack: a negative output id")
            self._check_blocks(packed, inner, role, last, "int8 unpack")
        q = torch.empty(count, inner, dtype=torch.int8)
        scale = torch.empty(count, dtype=torch.float32)
        status = self._lib.i8_unpack_weight(
            ptr(packed),
            inner,
            self.ROLES[role],
            first,
            optional_ptr(ids),
            count,
            ptr(q),
            inner,
            ptr(scale),
            threads(),
        )
        check(status, "int8 unpack")
        return q, scale

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's activation quantization alone: x [M, K] -> (q [M, K] int8, scale [M] fp32)."""
        x = unit_stride_rows(x)
        rows, inner = x.shape
        if x.dtype not in _FLOATS:
            raise KernelError(f"int8 quantize: x {x.dtype}")
        padded = self.inner_padded(inner)
        q = torch.empty(rows, padded, dtype=torch.int8)
        scale = torch.empty(rows, dtype=torch.float32)
        status = self._lib.i8_quantize_rows(ptr(x), x.stride(0), is_bf16(x), rows, inner, ptr(q), ptr(scale), threads())
        check(status, "int8 quantize")
        return q[:, :inner], scale

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        outputs: int,
        inner: int,
        variant: str,
        *,
        bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        mode: str = "plain",
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [M, K] (fp32 or bf16) against the packed W: "plain" x @ W^T (+ bias) [M, N]; "silu"
        silu(x @ Wg^T + bias) * (x @ Wu^T + up_bias) [M, N]; "raw" both sums side by side [M, 2N]; "int" the
        exact int32 sums of the quantized operands [M, N]. See linear_int8.c for the arithmetic."""
        x = unit_stride_rows(x)
        rows, width = x.shape
        if width != inner or x.dtype not in _FLOATS or packed.dtype != torch.int8:
            raise KernelError(f"int8 linear: x [{rows}, {width}] {x.dtype} does not fit a packed [{outputs}, {inner}]")
        for b in (bias, up_bias):
            if b is not None and (b.dtype != torch.float32 or b.shape != (outputs,) or not b.is_contiguous()):
                raise KernelError(f"int8 linear: bias {tuple(b.shape)} {b.dtype} is not fp32 [{outputs}]")
        self._check_blocks(packed, inner, "gate" if mode in ("silu", "raw") else "plain", outputs - 1, "int8 linear")
        if mode == "int":
            out = torch.empty(rows, outputs, dtype=torch.int32)
        else:
            out = torch.empty(rows, outputs * (2 if mode == "raw" else 1), dtype=out_dtype or x.dtype)
            if out.dtype not in _FLOATS:
                raise KernelError(f"int8 linear: output dtype {out.dtype}")
        scratch, scales = self._scratch(rows, inner)
        params = LinearParams(
            x=ptr(x),
            packed=ptr(packed),
            bias=optional_ptr(bias),
            up_bias=optional_ptr(up_bias),
            y=ptr(out),
            scratch=ptr(scratch),
            row_scales=ptr(scales),
            ldx=x.stride(0),
            N=outputs,
            K=inner,
            ldy=out.stride(0),
            M=rows,
            x_bf16=is_bf16(x),
            y_bf16=is_bf16(out),
            mode=self.MODES[mode],
            variant=self.VARIANTS[variant],
            threads=threads(),
        )
        status = self._lib.i8_linear(ctypes.byref(params))
        check(status, "int8 linear")
        return out

    def _check_blocks(self, packed: torch.Tensor, inner: int, role: str, last: int, name: str) -> None:
        """Raise unless `packed` (int8, contiguous) holds output `last` of `role` over `inner` inputs: a matrix
        released or made for other shapes is refused, never read past its end."""
        if packed.dtype != torch.int8 or not packed.is_contiguous() or not self.inner_fits(inner):
            raise KernelError(f"{name}: the packed matrix is not contiguous int8 over a K that fits")
        needed = int(self._lib.i8_packed_size(last + 1, inner, int(role != "plain")))
        if last < 0 or packed.numel() < needed:
            raise KernelError(f"{name}: output {last} is beyond the packed matrix ({packed.numel()} bytes)")

    def _scratch(self, rows: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the quantized rows (padded to whole row groups) and their scales, per thread, grown on demand."""
        needed = max(1, int(self._lib.i8_scratch_bytes(rows, inner)))
        held = getattr(self._local, "rows", None)
        if held is None or held[0].numel() < needed or held[1].numel() < max(1, rows):
            held = self._local.rows = (torch.empty(needed, dtype=torch.int8), torch.empty(max(1, rows)))
        return held
