"""lora.c's entry point: every adapter's delta of a step for one or several members in one call.

The adapters' A [r, K] and B^T [r, N] (fp32, scaling folded) are read where they lie; a row's delta has one
order of sums whatever else the call holds (lora.c says which), so a request's bits do not depend on the
adapters that share its step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from cbrun.engine.backends.cpu.kernel_abi import KernelError, check, ptr, threads

# Per group: its rows [n] int64 (ascending) and, per member, (A [r, K], B^T [r, N]) fp32 or None.
LoraGroup = tuple[torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor] | None]]

_FLOATS = (torch.float32, torch.bfloat16)


class LoraKernels:
    """Grouped LoRA deltas (lora.c)."""

    MAX_MEMBERS = 4

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self.max_rank = int(library.lora_max_rank())

    def accepts(self, x: torch.Tensor, ys: Sequence[torch.Tensor]) -> bool:
        """Whether `apply` takes these operands as they lie (else the caller computes the deltas itself)."""
        return (
            x.dim() == 2
            and x.dtype in _FLOATS
            and x.stride(1) == 1
            and 1 <= len(ys) <= self.MAX_MEMBERS
            and all(
                y.dim() == 2 and y.dtype == ys[0].dtype and y.dtype in _FLOATS and y.stride(1) == 1 and len(y) == len(x)
                for y in ys
            )
        )

    def apply(self, x: torch.Tensor, groups: Sequence[LoraGroup], ys: Sequence[torch.Tensor]) -> None:
        """ys[m] [T, N_m] += each group's delta B_m (A_m x) on its rows of x [T, K], for every member m it adapts."""
        if not self.accepts(x, ys):
            raise KernelError("lora_apply: x [T, K] and every y [T, N] of one float dtype, with unit-stride rows")
        members, inner = len(ys), x.shape[1]
        rows = torch.cat([r.to(torch.long) for r, _ in groups]).contiguous()
        start = [0]
        a_ptrs: list[int | None] = []
        bt_ptrs: list[int | None] = []
        ranks: list[int] = []
        for group_rows, pairs in groups:
            start.append(start[-1] + len(group_rows))
            if len(pairs) != members:
                raise KernelError(f"lora_apply: a group with {len(pairs)} members for {members} outputs")
            for m, pair in enumerate(pairs):
                if pair is None:
                    a_ptrs.append(None)
                    bt_ptrs.append(None)
                    ranks.append(0)
                    continue
                a, bt = pair
                if (
                    a.dtype != torch.float32
                    or bt.dtype != torch.float32
                    or not (a.is_contiguous() and bt.is_contiguous())
                    or a.shape[1] != inner
                    or bt.shape != (a.shape[0], ys[m].shape[1])
                ):
                    raise KernelError("lora_apply: A [r, K] and B^T [r, N] must be contiguous fp32 fitting x and y")
                a_ptrs.append(ptr(a))
                bt_ptrs.append(ptr(bt))
                ranks.append(a.shape[0])
        count = len(groups) * members
        status = self._lib.lora_apply(
            ptr(x),
            int(x.dtype == torch.bfloat16),
            x.stride(0) if len(x) > 1 else inner,
            inner,
            ptr(rows),
            (ctypes.c_int64 * len(start))(*start),
            len(groups),
            (ctypes.c_void_p * count)(*a_ptrs),
            (ctypes.c_void_p * count)(*bt_ptrs),
            (ctypes.c_int64 * count)(*ranks),
            members,
            (ctypes.c_void_p * members)(*(ptr(y) for y in ys)),
            (ctypes.c_int64 * members)(*(y.stride(0) if len(y) > 1 else y.shape[1] for y in ys)),
            (ctypes.c_int64 * members)(*(y.shape[1] for y in ys)),
            int(ys[0].dtype == torch.bfloat16),
            threads(),
        )
        check(status, "lora_apply")
