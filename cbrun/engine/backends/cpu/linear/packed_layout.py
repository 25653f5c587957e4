"""How a packed linear method lays its members out (q|k|v side by side; gate and up interleaved per output), whatever
its kernel: the pair-dot, int8 and oneDNN methods share it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fp32_bias(biases: Sequence[torch.Tensor | None], widths: list[int]) -> torch.Tensor | None:
    """The biases side by side in fp32 [sum N_i] (zeros for a missing one), or None when there are none."""
    if all(b is None for b in biases):
        return None
    parts = [b.detach().float() if b is not None else torch.zeros(n) for b, n in zip(biases, widths)]
    return torch.cat(parts).contiguous()


def member_layout(
    weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], gated: bool
) -> tuple[int, list[int], int, list[str], list[int], torch.Tensor | None, torch.Tensor | None]:
    """How a packed method lays out its members, whatever its kernel: (inner K, member widths, outputs, each
    member's packing role, each member's first output, fp32 bias, fp32 up bias). Gated: gate and up side by side
    per output (outputs = one member's width); else the members' outputs one after another."""
    widths = [w.shape[0] for w in weights]
    if gated:
        bias, up_bias = fp32_bias(biases[:1], widths[:1]), fp32_bias(biases[1:], widths[:1])
        return weights[0].shape[1], widths, widths[0], ["gate", "up"], [0, 0], bias, up_bias
    roles, starts = ["plain"] * len(weights), offsets(widths)
    return weights[0].shape[1], widths, sum(widths), roles, starts, fp32_bias(biases, widths), None


def offsets(widths: Sequence[int]) -> list[int]:
    """Where each member's outputs start among the outputs side by side."""
    starts = [0]
    for width in widths[:-1]:
        starts.append(starts[-1] + width)
    return starts


class PackedLinear:
    """What the packed-method families (the bf16 pair dots, the int8 linears) share: members laid out by
    `member_layout` in one packed matrix, the only copy of the weights, computed by one kernel call.

    A family gives `_linear` (one call of its kernel on [M, K] rows in a mode: "plain", "silu" or "raw", the
    gate and up sums side by side), `_pack` (a member's weight into the matrix), `weight` and `rows` (members read
    back) and `bias_dtype` (what a loaded bias is rounded through). A member alone is its columns of the whole call:
    a row's sums do not depend on the other outputs.
    """

    owns_weights = True
    bias_dtype: torch.dtype
    packed: torch.Tensor

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], gated: bool) -> None:
        self.gated = gated
        self.inner, self.widths, self.outputs, self.roles, self.starts, self.bias, self.up_bias = member_layout(
            weights, biases, gated
        )

    def _linear(self, rows: torch.Tensor, mode: str, out_dtype: torch.dtype | None) -> torch.Tensor:
        raise NotImplementedError

    def _pack(self, index: int, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self._linear(rows, "silu" if self.gated else "plain", out_dtype)  # [M, N]
        return out.view(*x.shape[:-1], self.outputs)

    def member(self, index: int, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self._linear(rows, "raw" if self.gated else "plain", out_dtype)  # gated: [M, 2N]
        first = self.outputs * index if self.gated else self.starts[index]
        out = out[:, first : first + self.widths[index]].contiguous()  # [M, N_index]
        return out.view(*x.shape[:-1], self.widths[index])

    def gated_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._linear(x.reshape(-1, x.shape[-1]), "raw", torch.float32)  # [M, 2N]: gate sums, then up sums
        return out[:, : self.outputs], out[:, self.outputs :]

    def load(self, index: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        if weight is not None:
            self._pack(index, weight)
        if bias is not None:
            target = self.up_bias if self.gated and index == 1 else self.bias
            first = 0 if self.gated else self.starts[index]
            if target is not None:
                target[first : first + self.widths[index]] = bias.detach().to(self.bias_dtype).float()

    def release(self) -> None:
        self.packed = torch.empty(0, dtype=self.packed.dtype)

    @property
    def nbytes(self) -> int:
        extra = sum(b.numel() * 4 for b in (self.bias, self.up_bias) if b is not None)
        return self.packed.numel() * self.packed.element_size() + extra
