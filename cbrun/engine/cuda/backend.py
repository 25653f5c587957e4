"""The CUDA backend: Triton attention that reads the page pools in place.

The torch reference gathers every row's pages into a padded copy per layer,
so its memory and time grow with batch x longest context. Here every query
token of a step is a row attended over its own keys straight from the pools
(triton_attention.py), decodes and prefill chunks alike; the rows are cut
into query blocks once per step on the host (the blocks travel with the
step's other index tensors in one copy, device_copy.py) and shared by every
layer. Linear layers stay torch's (cuBLAS); K/V writes are one index_copy
per pool; sampling runs on the device (sampler.py) with one copy back per
step.

Under TRITON_INTERPRET=1 the same backend runs on CPU tensors, slowly: that
is how CI checks it without a GPU.
"""

from __future__ import annotations

import os

import torch

from cbrun.engine import torch_attention
from cbrun.engine.backend import TorchBackend
from cbrun.engine.model_spec import ModelSpec



def triton_usable(device: torch.device) -> bool | str:
    """True when the Triton kernels can run on `device`, else why not."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not (device.type == "cpu" and interpreted):
        return f"the model is on {device}, and Triton runs on CUDA (or on CPU under TRITON_INTERPRET=1)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (it ships with CUDA builds of torch)"
    return True


class CudaBackend(TorchBackend):
    """Triton paged attention for every query row; torch for the rest."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.attends_rows = False
        self.block_rows = 1

    def install(self, model, spec: ModelSpec) -> None:
        """Decide whether the kernel covers the model's attention, and how many rows a program takes."""
        config = model.config
        configs = (config, getattr(config, "text_config", None))
        softcaps = any(getattr(c, "attn_logit_softcapping", None) for c in configs if c is not None)
        group = config.num_attention_heads // spec.kv.num_kv_heads
        self.attends_rows = not softcaps
        from cbrun.engine.cuda.triton_attention import default_block_rows

        self.block_rows = default_block_rows(group)

    def plan_rows(self, seqs, page_size: int, windowed: bool) -> tuple:
        """(query blocks [NB, 2] int32: first row and row count of consecutive rows of one sequence, the
        kernel's rows per block): a decode-only step gets 1-row blocks, so its tiles hold G heads, not 64 rows.

        The row count is rounded up to a power of two: each distinct value is a kernel Triton compiles.
        """
        from cbrun.engine.cuda.triton_attention import plan_query_blocks

        longest = min(self.block_rows, 1 << (max(seq.count for seq in seqs) - 1).bit_length())
        row_seq = [index for index, seq in enumerate(seqs) for _ in range(seq.count)]
        return plan_query_blocks(row_seq, longest), longest

    def attend_rows(self, query, k_pool, v_pool, rows, scale: float, softcap: float | None) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys, read in place -> [R, H, D]."""
        if not self.attends_rows or softcap:
            return torch_attention.decode(query, k_pool, v_pool, rows.per_row(), scale, softcap)
        from cbrun.engine.cuda.triton_attention import paged_attention

        blocks, block_rows = rows.plan
        return paged_attention(query.transpose(0, 1), k_pool, v_pool, rows.tables, rows.row_seq, rows.first_page,
                               rows.kv_len, rows.kv_lo, scale, query_blocks=blocks, block_rows=block_rows)

    def describe(self) -> str:
        attention = "Triton paged attention" if self.attends_rows else "torch attention"
        return f"triton ({attention} on {self.device}, {self.block_rows} rows per query block)"
