"""The bf16 pair-dot linears (linear_dpbf16.c) from Python: packing weights once, and the GEMM on the packed blocks.

The kernels object holds these as `kernels.dp`, as it holds the int8 linears
as `kernels.int8` (kernels/int8.py): the packed layout and its checks are one
role, with its own scratch. The variant a call runs ("scalar", "twin", "isa", "amx")
is chosen by the linear method after the load found which run here
(kernels/isa_variants.py); see linear_dpbf16.c and tile_order.h for the arithmetic they share.
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

LINEAR_DTYPES = (torch.float32, torch.bfloat16)


class PairDotKernels:
    """linear_dpbf16.c's entry points on the loaded library, with their arguments checked."""

    VARIANTS = VARIANTS["dp"]  # the variant numbers (kernel_abi), by name
    ROLES = ROLES  # a weight's role in a packed matrix: all of it, or a gated matrix's gate or up half
    MODES = MODES

    def __init__(self, library: ctypes.CDLL, variants: IsaVariants) -> None:
        self._lib = library
        self.variants = variants
        self.block_outputs = int(self._lib.dp_block_outputs())  # outputs per packed block (DP_BLOCK)
        self._local = threading.local()  # per-thread scratch (engines may step in their own threads)

    def variant_runs(self, variant: str) -> bool:
        """Whether this CPU runs a variant of the pair kernels, linear and attention alike ("isa": AVX512-BF16)."""
        return self.variants.runnable("dp", variant)

    def padded_inner(self, inner: int) -> int:
        """K padded with zeros to whole 16-pair blocks (32 elements), as a packed matrix and its sums hold it."""
        return int(self._lib.dp_inner_padded(inner))

    def packed(self, outputs: int, inner: int, gated: bool = False) -> torch.Tensor:
        """An empty packed matrix (zeros): `outputs` outputs of `inner` inputs (gated: that many gate and up rows)."""
        size = self._lib.dp_packed_size(outputs, inner, int(gated))
        packed = torch.empty(size, dtype=torch.int16)
        blocks = size // (self.padded_inner(inner) * self.block_outputs)
        check(self._lib.dp_zero_blocks(ptr(packed), blocks, inner, threads()), "dp_packed")
        return packed  # zeros, each block first touched by the thread that computes it

    def pack_into(
        self, packed: torch.Tensor, inner: int, weight: torch.Tensor, role: str = "plain", first: int = 0
    ) -> None:
        """Write bf16 `weight` [n, K] (rows unit-stride) as outputs first .. first + n - 1 of `role` into `packed`."""
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.shape[1] != inner
            or weight.stride(1) != 1
            or weight.device.type != "cpu"
        ):
            raise KernelError(
                f"dp_pack: weight {tuple(weight.shape)} {weight.dtype} is not a bf16 CPU matrix of {inner} columns"
            )
        self._check_blocks(packed, inner, role, first + weight.shape[0] - 1, "dp_pack")
        status = self._lib.dp_pack_weight(
            ptr(weight),
            weight.stride(0),
            weight.shape[0],
            inner,
            self.ROLES[role],
            first,
            ptr(packed),
            threads(),
        )
        check(status, "dp_pack")

    def unpack(
        self,
        packed: torch.Tensor,
        inner: int,
        role: str = "plain",
        first: int = 0,
        count: int = 0,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Outputs of `role` back out of `packed`, bit for bit, as bf16 rows [count, K]: first .. first + count - 1,
        or the outputs `ids` (int64 [T]: a tied head's embedding lookup) when given."""
        if ids is not None:
            if ids.dtype != torch.int64 or not ids.is_contiguous():
                raise KernelError("dp_unpack: ids must be contiguous int64")
            count = ids.numel()
        if count:
            last = int(ids.max()) if ids is not None else first + count - 1
            if ids is not None and int(ids.min()) < 0:
                raise KernelError("dp_unpack: a negative output id")
            self._check_blocks(packed, inner, role, last, "dp_unpack")
        out = torch.empty(count, inner, dtype=torch.bfloat16)
        status = self._lib.dp_unpack_weight(
            ptr(packed),
            inner,
            self.ROLES[role],
            first,
            optional_ptr(ids),
            count,
            ptr(out),
            inner,
            threads(),
        )
        check(status, "dp_unpack")
        return out

    def pack(self, weight: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 weight [N, K] (gated: gate [N, K] and up [N, K]) -> its packed blocks, flat int16."""
        if up is not None and up.shape != weight.shape:
            raise KernelError("dp_pack: gate and up weights differ in shape")
        rows, inner = weight.shape
        packed = self.packed(rows, inner, gated=up is not None)
        if up is None:
            self.pack_into(packed, inner, weight)
        else:
            self.pack_into(packed, inner, weight, "gate")
            self.pack_into(packed, inner, up, "up")
        return packed

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
        gated: bool | str = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [M, K] (bf16, or fp32 rounded to bf16) @ packed W^T (+ fp32 bias) -> [M, N] in `out_dtype`
        (default x's); gated: silu(x @ Wg^T + bias) * (x @ Wu^T + up_bias); gated="raw": both sums (+ biases)
        side by side, [M, 2N]. See linear_dpbf16.c."""
        x = unit_stride_rows(x)
        rows, width = x.shape
        if width != inner or x.dtype not in LINEAR_DTYPES or packed.dtype != torch.int16:
            raise KernelError(f"dp_linear: x [{rows}, {width}] {x.dtype} does not fit a packed [{outputs}, {inner}]")
        for b in (bias, up_bias):
            if b is not None and (b.dtype != torch.float32 or b.shape != (outputs,) or not b.is_contiguous()):
                raise KernelError(f"dp_linear: bias {tuple(b.shape)} {b.dtype} is not fp32 [{outputs}]")
        mode = self.MODES["raw"] if gated == "raw" else self.MODES["silu"] if gated else self.MODES["plain"]
        self._check_blocks(packed, inner, "gate" if gated else "plain", outputs - 1, "dp_linear")
        out = torch.empty(rows, outputs * (2 if mode == self.MODES["raw"] else 1), dtype=out_dtype or x.dtype)
        if out.dtype not in LINEAR_DTYPES:
            raise KernelError(f"dp_linear: output dtype {out.dtype}")
        params = LinearParams(
            x=ptr(x),
            packed=ptr(packed),
            bias=optional_ptr(bias),
            up_bias=optional_ptr(up_bias),
            y=ptr(out),
            scratch=ptr(self._scratch(self._lib.dp_scratch_bytes(rows, inner))),
            ldx=x.stride(0),
            N=outputs,
            K=inner,
            ldy=out.stride(0),
            M=rows,
            x_bf16=is_bf16(x),
            y_bf16=is_bf16(out),
            mode=mode,
            variant=self.VARIANTS[variant],
            threads=threads(),
        )
        status = self._lib.dp_linear(ctypes.byref(params))
        check(status, "dp_linear")
        return out

    def _check_blocks(self, packed: torch.Tensor, inner: int, role: str, last: int, name: str) -> None:
        """Raise unless `packed` (int16, contiguous, on the CPU) holds output `last` of `role` over `inner` inputs:
        a matrix released or made for other shapes is refused, never read or written past its end."""
        if packed.dtype != torch.int16 or not packed.is_contiguous() or packed.device.type != "cpu" or inner < 1:
            raise KernelError(f"{name}: the packed matrix is not contiguous int16 on the CPU over K = {inner} >= 1")
        needed = int(self._lib.dp_packed_size(last + 1, inner, int(role != "plain"))) if last >= 0 else 0
        if last < 0 or packed.numel() < needed:
            raise KernelError(f"{name}: output {last} is beyond the packed matrix ({packed.numel()} int16)")

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """Room for dp_linear's copy of x in its variant's layout, kept per thread and grown on demand."""
        scratch = getattr(self._local, "dp_rows", None)
        if scratch is None or scratch.numel() < max(1, nbytes):
            scratch = self._local.dp_rows = torch.empty(max(1, nbytes), dtype=torch.uint8)
        return scratch
