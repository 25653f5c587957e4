"""One step's LoRA rows: which of the step's tokens run which adapter, and the adapter's work on them.

The engine lays a step's tokens end to end (step/batch.py); a request that
names an adapter puts its tokens in that adapter's rows. Every adapted linear
then adds, to its output rows of each adapter,

    delta = (scaling * B)(A(x_rows))    x_rows [n, K] -> [n, r] -> [n, N], fp32

computed on the rows of that adapter alone, gathered, through the backend's
linear arithmetic (on CPU the compiled fp32 kernel, which gives a row the
same bits for any number of rows), and added element by element (one IEEE
add per output). So a row's output depends on its own input and adapter
only: several adapters in one step give each request the bits it gets
alone (batch invariance), and rows without an adapter are not touched.

This module is a leaf: the CPU backend's fused layers call it (through the
forward's `LORA_KWARG`), and the adapters' forward hooks (adapters.py) call it
for every other linear.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

LORA_KWARG = "cbrun_lora"  # the step's StepLoRA, passed to the model's forward with the batch (when any row has one)


class AdaptedLinear(Protocol):
    """One adapter's A and B of one linear: x [n, K] (any float dtype) -> fp32 delta [n, N]."""

    def delta(self, x: torch.Tensor) -> torch.Tensor: ...


class RowsAdapter(Protocol):
    """An adapter as a step sees it: its adapted linears, by module."""

    @property
    def linears(self) -> Mapping[torch.nn.Module, AdaptedLinear]: ...


@dataclass
class StepLoRA:
    """The adapters of one step, each with the step's token rows that run it ([n] int64, ascending)."""

    groups: Sequence[tuple[RowsAdapter, torch.Tensor]]
    num_tokens: int  # the step's T: every adapted linear's input has this many rows

    def adapts(self, *modules: torch.nn.Module) -> bool:
        """Whether any adapter of the step adapts any of `modules`."""
        return any(module in adapter.linears for adapter, _ in self.groups for module in modules)

    def add(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, N] (fp32, or the model's dtype; may be a column view) += each adapter's delta on its rows of x
        [T, K]. A low-precision y is widened, added to and rounded once per element."""
        self._check(x)
        for adapter, rows in self.groups:
            linear = adapter.linears.get(module)
            if linear is None:
                continue
            rows = rows.to(x.device)
            picked = x if len(rows) == self.num_tokens else x.index_select(0, rows)  # the whole step: no gathering
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
        whole: Callable[[torch.Tensor], torch.Tensor],
        sums: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """A fused gated MLP's silu(gate) * up [T, I] for x [T, K]: rows of no adapter of gate or up through
        `whole` (the fused kernel, as without adapters), the others (all of them in one pass over the weights) from
        their gate and up sums (`sums(x_rows)`: fp32 [n, I] each, biases included) plus each one's own deltas,
        through `silu_mul` (the fused kernel's activation: the same bits for a zero delta). Each row is computed
        once, and its numbers depend on its own input and adapter only."""
        self._check(x)
        groups = [
            (rows.to(x.device), adapter.linears.get(gate), adapter.linears.get(up))
            for adapter, rows in self.groups
            if gate in adapter.linears or up in adapter.linears
        ]
        adapted = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        for rows, _, _ in groups:
            adapted[rows] = True
        union = adapted.nonzero()[:, 0]  # [n] every adapted row, ascending: one pass over gate and up for all
        position = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        position[union] = torch.arange(len(union), device=x.device)
        picked = x.index_select(0, union)  # [n, K]
        g, u = sums(picked)  # [n, I] fp32 each (may be column views of one [n, 2I] result: added to in place)
        for rows, on_gate, on_up in groups:
            local = position[rows]
            mine = picked.index_select(0, local)
            if on_gate is not None:
                g.index_add_(0, local, on_gate.delta(mine))
            if on_up is not None:
                u.index_add_(0, local, on_up.delta(mine))
        activated = silu_mul(g, u)  # [n, I] fp32
        others = (~adapted).nonzero()[:, 0]
        if not len(others):
            return activated
        rest = whole(x.index_select(0, others))  # [T - n, I] in the model's dtype
        out = torch.empty(x.shape[0], rest.shape[1], dtype=rest.dtype, device=x.device)
        out.index_copy_(0, union, activated.to(rest.dtype))
        out.index_copy_(0, others, rest)
        return out

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(
                f"LoRA: an adapted linear got {x.shape[0]} rows in a step of {self.num_tokens} tokens "
                "(this model calls its linears on part of the step, which adapters cannot follow)"
            )
