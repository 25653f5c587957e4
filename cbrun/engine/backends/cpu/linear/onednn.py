"""The machine-local bf16 linear method: oneDNN's packed GEMM on fixed 64-row blocks (`kernels="fastest"`).

Batch invariance comes from never letting oneDNN see the batch: every call is one block of 64 rows (the last
zero-padded), so its blocking over K cannot change with M (linear/methods.py says why it is opt-in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbrun.engine.backends.cpu.linear.packed_layout import fp32_bias, offsets


class BlockedOneDnn:
    """oneDNN's bf16 GEMM on its packed weight, always called on one block of BLOCK rows (zero-padded).

    The reordered weight is the only copy: a member is read back with an exact reorder (to_dense)."""

    BLOCK = 64
    owns_weights = True
    serves_rows = False  # reading rows back reorders the whole matrix

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], gated: bool) -> None:
        self.gated = gated
        self.widths = [w.shape[0] for w in weights]
        self.starts = offsets(self.widths)
        self.outputs = self.widths[0] if gated else sum(self.widths)
        bias = fp32_bias(biases, self.widths)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self._reorder(torch.cat([w.detach() for w in weights]).contiguous())  # [sum N_i, K] (gated: gate then up)

    def _reorder(self, whole: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(whole.to(torch.bfloat16), self.BLOCK)

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
        count = rows.shape[0]
        padded = -(-count // self.BLOCK) * self.BLOCK
        if padded != count:
            rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
        blocks = [
            torch.ops.mkldnn._linear_pointwise(rows[i : i + self.BLOCK], self.packed, self.bias, "none", [], "")
            for i in range(0, padded, self.BLOCK)
        ]
        return torch.cat(blocks)[:count]  # [M, sum N_i] bf16

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self._raw(x)
        if self.gated:
            gate, up = out.float().split(self.outputs, dim=1)
            out = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        out = out.to(out_dtype or x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    def member(self, index: int, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        first = self.starts[index]
        out = self._raw(x)[:, first : first + self.widths[index]].to(out_dtype or x.dtype)
        return out.view(*x.shape[:-1], self.widths[index])

    def gated_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = self._raw(x).float().split(self.outputs, dim=1)  # bf16 sums, widened exactly
        return gate, up

    def weight(self, index: int) -> torch.Tensor:
        first = self.starts[index]
        return self.packed.to_dense()[first : first + self.widths[index]].clone()

    def load(self, index: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        first = self.starts[index]
        if weight is not None:
            whole = self.packed.to_dense()
            whole[first : first + self.widths[index]] = weight.detach()
            self._reorder(whole)
        if bias is not None and self.bias is not None:
            self.bias[first : first + self.widths[index]] = bias.detach().to(torch.bfloat16)

    def rows(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        return self.weight(index).index_select(0, ids)

    def release(self) -> None:
        self.packed = torch.empty(0, dtype=torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return sum(self.widths) * self.packed.shape[1] * 2 + (self.bias.numel() * 2 if self.bias is not None else 0)
