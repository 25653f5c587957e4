"""The CUDA backend: Triton attention that reads the page pools in place.

The torch reference gathers every row's pages into a padded copy per layer,
so its memory and time grow with batch x longest context. Here every query
token of a step is a row attended over its own keys straight from the pools
(triton_attention.py), decodes and prefill chunks alike; the rows are cut
into query blocks once per step on the host (the blocks travel with the
step's other index tensors, one asynchronous copy per dtype, device_copy.py)
and shared by every layer. Linear layers stay torch's (cuBLAS); K/V writes
are one index_copy per pool; sampling runs on the device (sampler.py) with
one copy back per step.

At install the kernel is run once on a small problem and compared with the
torch reference; where it cannot compile or disagrees (an old GPU, a dtype
it does not take), attention stays on the torch path and the log says why.
Under TRITON_INTERPRET=1 the same backend runs on CPU tensors, slowly: that
is how CI checks it without a GPU. The "kernel layout or torch" dispatch is
KernelBackend's (kernel_backend.py); this backend supplies the Triton
attention (TritonAttention) and nothing else: the rest is the torch
reference's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cbrun.engine.backends.base import KernelRows
from cbrun.engine.backends.kernel_backend import KernelBackend
from cbrun.engine.backends.metadata import PagedRows, SequenceRows
from cbrun.engine.model_spec import CausalLM, ModelSpec

log = logging.getLogger("cbrun.engine")

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def triton_usable(device: torch.device) -> bool | str:
    """True when the Triton kernels can run on `device`, else why not."""
    from cbrun.engine.backends.cuda import triton_attention

    if device.type not in ("cuda", "cpu"):
        return f"the model is on {device}, and Triton runs on CUDA (or on CPU under TRITON_INTERPRET=1)"
    if not triton_attention.triton_importable():
        return "triton is not installed (it ships with CUDA builds of torch)"
    if device.type == "cpu" and not triton_attention.interpret_mode():
        return "the model is on the CPU, where Triton runs only under its interpreter (TRITON_INTERPRET=1)"
    return True


class TritonAttention:
    """Triton paged attention (triton_attention.py) as a KernelBackend runs it, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.block_rows = 1

    def covers(self, spec: ModelSpec) -> str:
        """ "" when the kernel covers the model and passes its probe here; sizes the query blocks."""
        from cbrun.engine.backends.cuda.triton_attention import default_block_rows

        kv = spec.kv
        self.block_rows = default_block_rows(spec.num_heads // kv.num_kv_heads)
        if spec.softcaps_attention:
            return "the model soft-caps attention scores, which the kernel does not"
        if kv.dtype not in KERNEL_DTYPES:
            return f"the kernel takes fp32, bf16 and fp16 caches, not {kv.dtype}"
        return _probe(self.device, kv.dtype, spec.num_heads, kv.num_kv_heads, kv.head_dim)

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[torch.Tensor, int]:
        """(query blocks [NB, 2] int32: first row and row count of consecutive rows of one sequence, the
        kernel's rows per block): a decode-only step gets 1-row blocks, so its tiles hold G heads, not 64 rows.

        The row count is rounded up to a power of two: each distinct value is a kernel Triton compiles.
        """
        from cbrun.engine.backends.cuda.triton_attention import plan_query_blocks

        longest = min(self.block_rows, 1 << (max(seq.count for seq in seqs) - 1).bit_length())
        row_seq = [index for index, seq in enumerate(seqs) for _ in range(seq.count)]
        return plan_query_blocks(row_seq, longest), longest

    def attend(
        self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: KernelRows, scale: float
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys, read in place -> [R, H, D]."""
        from cbrun.engine.backends.cuda.triton_attention import paged_attention

        blocks, block_rows = rows.plan
        return paged_attention(
            query.transpose(0, 1),
            k_pool,
            v_pool,
            rows,
            scale,
            query_blocks=blocks,
            block_rows=block_rows,
        )


class CudaBackend(KernelBackend):
    """Triton paged attention for every query row; torch for the rest."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self.triton = TritonAttention(device)
        super().__init__(self.triton)  # the torch layout until install finds the kernel applies
        self.device = device

    @property
    def block_rows(self) -> int:
        """Rows of one query block at most (the kernel's M tile is block_rows x G heads)."""
        return self.triton.block_rows

    @block_rows.setter
    def block_rows(self, rows: int) -> None:
        self.triton.block_rows = rows

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[torch.Tensor, int]:
        """The kernel's plan of a step's rows (TritonAttention.plan_rows)."""
        return self.triton.plan_rows(seqs, page_size, windowed)

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Decide whether the kernel covers the model's attention, and how many rows a program takes."""
        self.install_attention(spec)
        if self.why_not:
            log.warning("Triton attention off (%s): the torch attention runs instead", self.why_not)

    def describe(self) -> str:
        attention = "Triton paged attention" if self.attends_rows else f"torch attention: {self.why_not}"
        return f"triton ({attention} on {self.device}, {self.block_rows} rows per query block)"


def _probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> str:
    """ "" when the kernel compiles here and matches the torch reference on a small step, else why not."""
    from cbrun.engine.backends.cuda.triton_attention import paged_attention, reference_paged_attention

    generator = torch.Generator().manual_seed(0)
    page, blocks = 16, 6
    pools = [torch.randn(kv_heads, blocks, page, dim, generator=generator).to(device, dtype) for _ in range(2)]
    q = torch.randn(3, heads, dim, generator=generator).to(device, dtype)  # [R, H, D]: a decode and a 2-token chunk
    paged = PagedRows(
        torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.long, device=device),
        torch.tensor([0, 1, 1], dtype=torch.long, device=device),
        torch.zeros(2, dtype=torch.long, device=device),
        torch.tensor([37, 20, 21], dtype=torch.long, device=device),
        torch.zeros(3, dtype=torch.long, device=device),
    )
    args = (q, *pools, paged, dim**-0.5)
    try:
        got = paged_attention(*args)
    except Exception as exc:  # no compiler for this GPU, too little shared memory, an old Triton
        return f"the kernel failed on this device: {type(exc).__name__}: {exc}"
    expected = reference_paged_attention(*args)
    error = (got.float() - expected.float()).abs().max().item()
    if not error <= _PROBE_TOLERANCE[dtype]:
        return f"the kernel differs from the torch reference by {error:.3g} on a probe"
    return ""
