"""One step's LoRA rows: which of the step's tokens run which adapter, and the adapter's work on them.

The engine lays a step's tokens end to end (step/batch.py); a request that
names an adapter puts its tokens in that adapter's rows. Every adapted linear
then adds, to its output rows of each adapter,

    delta = (scaling * B)(A(x_rows))    x_rows [n, K] -> [n, r] -> [n, N], fp32

and adds it element by element (one IEEE add per output). On CPU one
compiled call (the backend's `GroupedDeltas`: lora.c) does this for every
adapter of the step and every member that reads the same x (q|k|v, gate|up),
reading the adapters in place; elsewhere each adapter's rows are gathered and
run through the backend's linear arithmetic. Either way a row's delta has one
order of sums whatever the step holds, so a row's output depends on its own
input and adapter only: several adapters in one step give each request the
bits it gets alone (batch invariance), and rows without an adapter are not
touched.

This module is a leaf: the CPU backend's fused layers call it (through the
forward's `LORA_KWARG`), and the adapters' forward hooks (adapters.py) call it
for every other linear.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

_NOTHING = object()  # a member set no adapter of the step adapts (packed as this)
LORA_KWARG = "cbrun_lora"  # the step's StepLoRA, passed to the model's forward with the batch (when any row has one)


class AdaptedLinear(Protocol):
    """One adapter's A and B of one linear: x [n, K] (any float dtype) -> fp32 delta [n, N]."""

    @property
    def a(self) -> torch.Tensor: ...  # [r, K] fp32

    @property
    def bt(self) -> torch.Tensor: ...  # [r, N] fp32, the scaling folded in

    def delta(self, x: torch.Tensor) -> torch.Tensor: ...


class GroupedDeltas(Protocol):
    """A backend's one-call LoRA arithmetic (on CPU kernels/lora.py's LoraKernels): ys[m] [T, N_m] += B_m (A_m x) on
    each group's rows of x [T, K], per member m the group's (A [r, K], B^T [r, N_m]) or None. `plan` lays out a
    step's rows by group once for all its calls, `pack` a member set's adapters once while they stay the same."""

    def accepts(self, x: torch.Tensor, ys: Sequence[torch.Tensor]) -> bool: ...

    def plan(self, group_rows: Sequence[torch.Tensor], tokens: int) -> Any: ...

    def pack(
        self, pairs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor] | None]], inner: int, widths: Sequence[int]
    ) -> Any: ...

    def apply_packed(self, x: torch.Tensor, plan: Any, operands: Any, ys: Sequence[torch.Tensor]) -> None: ...


class RowsAdapter(Protocol):
    """An adapter as a step sees it: its adapted linears, by module."""

    @property
    def linears(self) -> Mapping[torch.nn.Module, AdaptedLinear]: ...


@dataclass
class StepLoRA:
    """The adapters of one step, each with the step's token rows that run it ([n] int64, ascending)."""

    groups: Sequence[tuple[RowsAdapter, torch.Tensor]]
    num_tokens: int  # the step's T: every adapted linear's input has this many rows
    grouped: GroupedDeltas | None = None  # the backend's one-call arithmetic, where it has one
    packed: dict[tuple[torch.nn.Module, ...], Any] | None = None  # grouped.pack by member set, kept by the owner
    _plan: Any = field(default=None, init=False, repr=False)  # grouped.plan of the step's rows, made at first use

    def adapts(self, *modules: torch.nn.Module) -> bool:
        """Whether any adapter of the step adapts any of `modules`."""
        return any(module in adapter.linears for adapter, _ in self.groups for module in modules)

    def add(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, N] (fp32, or the model's dtype; may be a column view) += each adapter's delta on its rows of x
        [T, K]. A low-precision y is widened, added to and rounded once per element."""
        self.add_members((module,), x, (y,))

    def add_members(self, modules: Sequence[torch.nn.Module], x: torch.Tensor, ys: Sequence[torch.Tensor]) -> None:
        """ys[m] [T, N_m] += each adapter's delta of modules[m] on its rows of x [T, K], for members that read the
        same x (q|k|v: one call for all of them and every adapter, where the backend has the call)."""
        self._check(x)
        if self.grouped is not None and x.device.type == "cpu" and self.grouped.accepts(x, ys):
            if self._plan is None:
                self._plan = self.grouped.plan([rows for _, rows in self.groups], self.num_tokens)
            key = tuple(modules)
            operands = self.packed.get(key) if self.packed is not None else None
            if operands is None:
                pairs = [
                    [None if (lin := adapter.linears.get(module)) is None else (lin.a, lin.bt) for module in modules]
                    for adapter, _ in self.groups
                ]  # every group, so the one plan serves every call (a group of no pair is skipped)
                adapted = any(pair is not None for group in pairs for pair in group)
                operands = self.grouped.pack(pairs, x.shape[1], [y.shape[1] for y in ys]) if adapted else _NOTHING
                if self.packed is not None:
                    self.packed[key] = operands
            if operands is not _NOTHING:
                self.grouped.apply_packed(x, self._plan, operands, ys)
            return
        groups = [
            (rows, [adapter.linears.get(module) for module in modules])
            for adapter, rows in self.groups
            if any(module in adapter.linears for module in modules)
        ]
        for rows, linears in groups:
            rows = rows.to(x.device)
            picked = x if len(rows) == self.num_tokens else x.index_select(0, rows)  # the whole step: no gathering
            for linear, y in zip(linears, ys):
                if linear is None:
                    continue
                delta = linear.delta(picked)  # [n, N] fp32
                if y.dtype == torch.float32:
                    y.index_add_(0, rows, delta)
                else:
                    y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))

    def gated(
        self,
        gate: torch.nn.Module,
        up: torch.nn.Module,
        x: torch.Tensor,
        sums: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """A fused gated MLP's silu(gate) * up [T, I] fp32 for x [T, K]: every row's gate and up sums in one pass
        over the weights (`sums(x)`: fp32 [T, I] each, biases included; the fused kernel's result bit for bit
        through `silu_mul`), each adapted row's deltas added in between. Rows of no adapter get what the fused
        kernel gives them, and each row's numbers depend on its own input and adapter only."""
        self._check(x)
        g, u = sums(x)  # [T, I] fp32 each (may be column views of one [T, 2I] result: added to in place)
        self.add_members((gate, up), x, (g, u))
        return silu_mul(g, u)  # [T, I] fp32

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(
                f"LoRA: an adapted linear got {x.shape[0]} rows in a step of {self.num_tokens} tokens "
                "(this model calls its linears on part of the step, which adapters cannot follow)"
            )
