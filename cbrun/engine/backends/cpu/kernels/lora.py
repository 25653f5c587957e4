"""lora.c's entry point: every adapter's delta of a step for one or several members in one call.

The adapters' A [r, K] and B^T [r, N] (fp32, scaling folded) are read where they lie; a row's delta has one
order of sums whatever else the call holds (lora.c says which), so a request's bits do not depend on the
adapters that share its step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbrun.engine.backends.cpu.kernels.abi import KernelError, check, threads

Pair = tuple[torch.Tensor, torch.Tensor]  # (A [r, K], B^T [r, N]) fp32, contiguous
# Per group: its rows [n] int64 (ascending) and, per member, its pair or None.
LoraGroup = tuple[torch.Tensor, Sequence[Pair | None]]

_FLOATS = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LoraRows:
    """One step's rows by adapter as lora_apply reads them (LoraKernels.plan): made once per step."""

    rows: torch.Tensor  # [n] int64, group by group
    start: ctypes.Array[ctypes.c_int64]  # [groups + 1]: group g holds rows[start[g] .. start[g + 1])
    groups: int
    tokens: int  # the step's T: every x and y of its calls has this many rows


@dataclass(frozen=True, kw_only=True)
class LoraOperands:
    """The adapters of a step's groups for one member set, as lora_apply reads them (LoraKernels.pack)."""

    pairs: tuple[tuple[Pair | None, ...], ...]  # [groups][members]: held, so the pointers below stay valid
    inner: int  # K
    widths: tuple[int, ...]  # N per member
    groups: int
    a: ctypes.Array[ctypes.c_void_p]  # [groups * members] A's data, NULL where a group leaves a member
    bt: ctypes.Array[ctypes.c_void_p]  # [groups * members] B^T's data
    ranks: ctypes.Array[ctypes.c_int64]  # [groups * members]
    width_array: ctypes.Array[ctypes.c_int64]  # [members]


class LoraKernels:
    """Grouped LoRA deltas (lora.c)."""

    MAX_MEMBERS = 4

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self.max_rank = int(library.lora_max_rank())

    def accepts(self, x: torch.Tensor, ys: Sequence[torch.Tensor]) -> bool:
        """Whether `apply` takes these operands as they lie (else the caller computes the deltas itself)."""
        if x.dim() != 2 or x.dtype not in _FLOATS or x.stride(1) != 1 or not 1 <= len(ys) <= self.MAX_MEMBERS:
            return False
        tokens, dtype = x.shape[0], ys[0].dtype
        return dtype in _FLOATS and all(
            y.dim() == 2 and y.dtype == dtype and y.stride(1) == 1 and y.shape[0] == tokens for y in ys
        )

    def plan(self, group_rows: Sequence[torch.Tensor], tokens: int) -> LoraRows:
        """A step's rows by adapter, checked and laid out once for all its calls: group_rows[g] [n_g] int64, each
        in 0 .. tokens - 1."""
        rows = torch.cat([r.to(torch.int64) for r in group_rows]) if group_rows else torch.zeros(0, dtype=torch.long)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= tokens):
            raise KernelError(f"lora_apply: a row outside the step's {tokens}")
        start = [0]
        for r in group_rows:
            start.append(start[-1] + r.shape[0])
        return LoraRows(rows.contiguous(), (ctypes.c_int64 * len(start))(*start), len(group_rows), tokens)

    def apply(self, x: torch.Tensor, groups: Sequence[LoraGroup], ys: Sequence[torch.Tensor]) -> None:
        """ys[m] [T, N_m] += each group's delta B_m (A_m x) on its rows of x [T, K], for every member m it adapts."""
        plan = self.plan([r for r, _ in groups], x.shape[0])
        self.apply_packed(x, plan, self.pack([p for _, p in groups], x.shape[1], [y.shape[1] for y in ys]), ys)

    def pack(self, pairs: Sequence[Sequence[Pair | None]], inner: int, widths: Sequence[int]) -> LoraOperands:
        """The per-group, per-member (A [r, K], B^T [r, N_m]) or None of a set of members, checked and laid out
        once for every step that runs these adapters (the caller keeps it while the adapters stay unchanged)."""
        members = len(widths)
        a_ptrs: list[int | None] = []
        bt_ptrs: list[int | None] = []
        ranks: list[int] = []
        for group in pairs:
            if len(group) != members:
                raise KernelError(f"lora_apply: a group with {len(group)} members for {members} outputs")
            for pair, width in zip(group, widths):
                if pair is None:
                    a_ptrs.append(None)
                    bt_ptrs.append(None)
                    ranks.append(0)
                    continue
                a, bt = pair
                rank = a.shape[0]
                if (
                    a.dtype != torch.float32
                    or bt.dtype != torch.float32
                    or a.dim() != 2
                    or a.shape[1] != inner
                    or bt.shape != (rank, width)
                    or not 1 <= rank <= self.max_rank
                    or not (a.is_contiguous() and bt.is_contiguous())
                ):
                    raise KernelError("lora_apply: A [r, K] and B^T [r, N] must be contiguous fp32 fitting x and y")
                a_ptrs.append(a.data_ptr())
                bt_ptrs.append(bt.data_ptr())
                ranks.append(rank)
        count = len(pairs) * members
        return LoraOperands(
            pairs=tuple(tuple(group) for group in pairs),
            inner=inner,
            widths=tuple(widths),
            groups=len(pairs),
            a=(ctypes.c_void_p * count)(*a_ptrs),
            bt=(ctypes.c_void_p * count)(*bt_ptrs),
            ranks=(ctypes.c_int64 * count)(*ranks),
            width_array=(ctypes.c_int64 * members)(*widths),
        )

    def apply_packed(self, x: torch.Tensor, plan: LoraRows, operands: LoraOperands, ys: Sequence[torch.Tensor]) -> None:
        """`apply` on a step's plan and packed operands. Called per layer and member set of every step with
        adapters, so it keeps to a few Python operations per operand."""
        if not self.accepts(x, ys):
            raise KernelError("lora_apply: x [T, K] and every y [T, N] of one float dtype, with unit-stride rows")
        members, (tokens, inner) = len(ys), x.shape
        if tokens != plan.tokens or operands.groups != plan.groups:
            raise KernelError(f"lora_apply: x has {tokens} rows, the plan {plan.tokens}; or its groups differ")
        if inner != operands.inner or tuple(y.shape[1] for y in ys) != operands.widths:
            raise KernelError(f"lora_apply: x [.., {inner}] and y widths do not fit the packed adapters")
        status = self._lib.lora_apply(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            x.stride(0) if tokens > 1 else inner,
            inner,
            plan.rows.data_ptr(),
            plan.start,
            plan.groups,
            operands.a,
            operands.bt,
            operands.ranks,
            members,
            (ctypes.c_void_p * members)(*(y.data_ptr() for y in ys)),
            (ctypes.c_int64 * members)(*(y.stride(0) if tokens > 1 else y.shape[1] for y in ys)),
            operands.width_array,
            int(ys[0].dtype == torch.bfloat16),
            threads(),
        )
        check(status, "lora_apply")
