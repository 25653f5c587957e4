"""One step's LoRA rows: which of the step's tokens run which adapter, and the adapter's work on them.

The engine lays a step's tokens end to end (step/batch.py); a request that
names an adapter puts its tokens in that adapter's rows. Every adapted linear
then adds, to its output rows of each adapter,

    delta = scaling * B(A(x_rows))      x_rows [n, K] -> [n, r] -> [n, N], fp32

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
            delta = linear.delta(x.index_select(0, rows))  # [n, N] fp32
            if y.dtype == torch.float32:
                y.index_add_(0, rows, delta)
            else:
                y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))

    def add_gated(
        self,
        gate: torch.nn.Module,
        up: torch.nn.Module,
        x: torch.Tensor,
        out: torch.Tensor,
        sums: Callable[[int, torch.Tensor], torch.Tensor],
        silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """A fused gated MLP's out [T, I] = silu(gate) * up, again for the rows of adapters of gate or up: their
        sums (`sums(0 | 1, x_rows)`: fp32 [n, I], bias included) plus the deltas, through `silu_mul`."""
        self._check(x)
        for adapter, rows in self.groups:
            on_gate, on_up = adapter.linears.get(gate), adapter.linears.get(up)
            if on_gate is None and on_up is None:
                continue
            rows = rows.to(x.device)
            picked = x.index_select(0, rows)  # [n, K]
            g, u = sums(0, picked), sums(1, picked)  # [n, I] fp32 each
            if on_gate is not None:
                g = g + on_gate.delta(picked)
            if on_up is not None:
                u = u + on_up.delta(picked)
            out.index_copy_(0, rows, silu_mul(g, u).to(out.dtype))

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(
                f"LoRA: an adapted linear got {x.shape[0]} rows in a step of {self.num_tokens} tokens "
                "(this model calls its linears on part of the step, which adapters cannot follow)"
            )
