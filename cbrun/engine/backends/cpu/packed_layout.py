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
