"""Paged attention on the GPU: a Triton kernel that reads K/V pages where they lie in the pool.

Why in place: the engine keeps each layer's keys and values in a page pool and every
sequence owns a list of pages (a block table). Gathering a step's pages into a
contiguous buffer before attending would copy all context keys of all rows once per
layer and step; here each program computes, for every key position p it needs, the
block `tables[s, p // page - first_page[s]]` and the offset `p % page`, and loads the
key straight from the pool. A tile of BLOCK_N keys may span several pages. The pool's
four strides (kv head, block, in-page offset, dim) are kernel arguments, so the
engine's [H_kv, NB, page, D] pool and a flash-attn style [NB, page, H_kv, D] pool
(passed as the permuted view [h, block, offset, d]) both work.

How rows are blocked: every query token of a step is a row (q [R, H, D]); rows of one
sequence are consecutive, in increasing position. `plan_query_blocks` cuts them into
blocks of at most `block_rows` consecutive rows of one sequence, once per step on the
host. One program handles (query block, kv head): it stacks its rows x the G query
heads sharing that kv head (GQA) as the M dimension of `tl.dot` (padded to >= 16), so
a decode step (1 row per sequence) runs the G heads of a kv head together and a prefill
chunk runs up to block_rows tokens x G heads per program, each K/V tile loaded once for
all of them. The program walks the union of its rows' key ranges, from the first row's
kv_lo to the last row's kv_len (both read inside the kernel: no host synchronisation),
masks each (row, key) pair by kv_lo <= p < kv_len (causality and sliding windows) and
accumulates in fp32 with an online softmax (exp2 with log2(e) folded into the scale).

Block sizes: block_rows defaults to 64 // G, so a prefill program's M = rows x heads is about 64 (each K/V
tile then feeds 64 query vectors while the [64, D] fp32 accumulator still fits in registers); decode
programs have one row, M = max(16, next_pow2(G)). Keys go in tiles of BLOCK_N = 64 (32 when D > 128); D is padded to
a power of two >= 16 and masked, so any head dim works (64, 80, 96, 128, ...).

Triton is optional: this module imports without it (the CPU engine never needs it); triton is
imported and the kernel decorated on first use. Triton's CPU interpreter (used by the tests, on CPU
tensors) needs `TRITON_INTERPRET=1` before triton itself is first imported anywhere in the process:
triton 3.9 reads it when a function is decorated with `@triton.jit`, and triton.language's own jitted
helpers (tl.max, tl.sum, ...) are decorated at triton's import, which torch and transformers may
trigger early. `reference_paged_attention` is the plain torch definition the kernel is tested against.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from cbrun.engine.backends.metadata import PagedRows

# Imported on first use (`triton_importable`), so importing this module never loads triton: the CPU engine never
# needs it. Module globals, not locals, because the interpreter looks `tl` up among the kernel's globals.
triton: Any = None
tl: Any = None

BLOCK_M_MIN = 16  # tl.dot needs M >= 16
TARGET_M = 64  # rows x heads per program: enough K/V reuse for prefill, modest registers
LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """Triton imports and can run: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    return triton_importable() and (torch.cuda.is_available() or interpret_mode())


def triton_importable() -> bool:
    """Import triton into this module's globals; False when it is not installed."""
    global triton, tl
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False
    return True


def interpret_mode() -> bool:
    """Triton's own reading of TRITON_INTERPRET (what `triton.jit` obeys when it decorates); the variable
    itself on Triton releases without `triton.knobs`."""
    if not triton_importable():
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def default_block_rows(group: int) -> int:
    """Rows per query block for GQA group size `group`: rows x group fills TARGET_M (at least 1 row)."""
    return max(1, TARGET_M // group)


def plan_query_blocks(row_seq: list[int] | torch.Tensor, block_rows: int) -> torch.Tensor:
    """[NB, 2] int32 (first row, number of rows) -- consecutive rows of one sequence, at most block_rows each.

    Vectorised torch on row_seq's device (CPU for a list); the output's size depends on the data, so
    build it on the host once per step and move it to the GPU once for all layers.
    """
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    seqs = torch.as_tensor(row_seq).reshape(-1)  # [R]
    if seqs.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int32, device=seqs.device)
    _, run_len = torch.unique_consecutive(seqs, return_counts=True)  # [runs] rows per sequence run
    run_start = torch.cumsum(run_len, 0) - run_len  # [runs] first row of each run
    run_blocks = (run_len + block_rows - 1) // block_rows  # [runs] query blocks per run
    run_of_block = torch.repeat_interleave(torch.arange(run_len.numel(), device=seqs.device), run_blocks)  # [NB]
    first_block = torch.cumsum(run_blocks, 0) - run_blocks  # [runs] index of each run's first block
    index_in_run = torch.arange(run_of_block.numel(), device=seqs.device) - first_block[run_of_block]  # [NB]
    offset = index_in_run * block_rows  # [NB] first row of the block within its run
    first_row = run_start[run_of_block] + offset  # [NB]
    num_rows = torch.clamp(run_len[run_of_block] - offset, max=block_rows)  # [NB]
    return torch.stack([first_row, num_rows], dim=1).to(torch.int32)  # [NB, 2]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    paged: PagedRows,
    scale: float,
    query_blocks: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """out [R, H, D]; query_blocks from plan_query_blocks (built on host once per step and shared by all layers);
    None: plan here (this reads row_seq on the host, a synchronisation).

    q [R, H, D]; k_pool, v_pool viewed [H_kv, NB, page, D] (any strides); `paged`: tables [S, max_pages]
    int32/int64, row_seq [R], first_page [S], kv_len [R], kv_lo [R] integer. `block_rows` sizes the kernel's M tile
    (block_rows x G, padded): pass the plan's longest block, at most the block_rows it was planned with
    (default `default_block_rows(G)`), e.g. 1 for a decode-only step so M is max(16, G) and not 64; blocks
    longer than it still come out right (the program walks them in pieces), shorter ones waste padded M.
    """
    kernel = _kernel(interpret_mode())
    tables, row_seq = paged.tables, paged.row_seq
    num_rows, num_heads, head_dim = q.shape
    num_kv, _, page, pool_dim = k_pool.shape
    _check_shapes(q, k_pool, v_pool, num_kv, pool_dim)
    group = num_heads // num_kv
    block_rows = block_rows or default_block_rows(group)
    if query_blocks is None:  # no longer blocks than the longest run: a decode step keeps M small
        block_rows = min(block_rows, max(_longest_run(row_seq), 1))
        query_blocks = plan_query_blocks(row_seq.cpu(), block_rows)
    out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype, device=q.device)  # [R, H, D]
    blocks = query_blocks.to(device=q.device, dtype=torch.int32).contiguous()  # [NB, 2]
    if num_rows == 0 or blocks.shape[0] == 0:
        return out
    sizes = _tile_sizes(group, block_rows, head_dim)
    grid = (blocks.shape[0], num_kv)
    tables = tables.to(q.device)  # [S, max_pages], any strides
    kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        tables,
        _on(row_seq, q),
        _on(paged.first_page, q),
        _on(paged.kv_len, q),
        _on(paged.kv_lo, q),
        blocks,
        scale * LOG2E,
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *out.stride(),
        *tables.stride(),
        GROUP=group,
        PAGE=page,
        HEAD_DIM=head_dim,
        **_dot_options(q.dtype),
        **sizes,
    )
    return out


def _check_shapes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, num_kv: int, pool_dim: int) -> None:
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"want q [R, H, D] and pools [H_kv, NB, page, D]; got {tuple(q.shape)}, "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    if q.shape[1] % num_kv or q.shape[2] != pool_dim:
        raise ValueError(f"{q.shape[1]} query heads of dim {q.shape[2]} do not fit {num_kv} kv heads of dim {pool_dim}")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"q and pools must share a dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")


def _on(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor on `like`'s device with unit stride (no copy when it already is)."""
    return index.to(like.device).contiguous()


def _longest_run(row_seq: torch.Tensor) -> int:
    """Most consecutive rows of one sequence (host synchronisation; only when paged_attention plans itself)."""
    if row_seq.numel() == 0:
        return 0
    _, counts = torch.unique_consecutive(row_seq, return_counts=True)
    return int(counts.max().item())


def _dot_options(dtype: torch.dtype) -> dict[str, Any]:
    """fp32 dots in full precision (not tf32). Triton's interpreter does no bf16 arithmetic (it stores bf16 as
    uint16 and tl.dot multiplies the bits, triton-lang/triton#11584), so there bf16 dot operands are widened
    to fp32 first: exact, and p is still rounded to bf16 as on the GPU. Only casts then touch bf16."""
    upcast = dtype == torch.bfloat16 and interpret_mode()
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", DOT_UPCAST=upcast)


def _tile_sizes(group: int, block_rows: int, head_dim: int) -> dict[str, int]:
    """Kernel tile constants.

    BLOCK_M: rows x heads, a power of two >= 16; BLOCK_ROWS: rows it holds (>= block_rows, filling the pad).
    BLOCK_N: keys per tile, 64 (32 for head dims over 128, to bound the K/V tiles' shared memory): four
    16-key pages or eight 8-key pages per tile, few enough masked keys at a row's ends.
    BLOCK_D: head dim padded to a power of two >= 16 (masked).
    """
    block_m = max(BLOCK_M_MIN, triton.next_power_of_2(block_rows * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8  # the [M, Dp] fp32 accumulator lives in registers
    return dict(
        BLOCK_ROWS=block_m // group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=2,
    )  # 2 stages of K and V tiles fit shared memory even in fp32


@functools.cache
def _kernel(interpret: bool) -> Any:  # a triton JITFunction (untyped), launched as kernel[grid](...)
    """The jitted kernel, decorated on first use. `interpret` only keys the cache: triton.jit reads the mode."""
    if not triton_importable():
        raise RuntimeError("paged_attention needs triton (pip install triton) and a CUDA device or TRITON_INTERPRET=1")
    # the table's row stride (max_pages) changes every step: specializing on it (divisible by 16 or not)
    # would compile a kernel per value; the index pointers are 128-byte aligned by device_copy.py anyway
    return triton.jit(_paged_attention_kernel, do_not_specialize=["stride_ts"])


def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are Triton's
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    row_seq_ptr,
    first_page_ptr,
    kv_len_ptr,
    kv_lo_ptr,
    blocks_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qr,
    stride_qh,
    stride_qd,
    stride_kh,
    stride_kb,
    stride_ko,
    stride_kd,
    stride_vh,
    stride_vb,
    stride_vo,
    stride_vd,
    stride_or,
    stride_oh,
    stride_od,
    stride_ts,
    stride_tp,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: query block program_id(0) x kv head program_id(1); M slot m = (row m // G, head m % G)."""
    kv_head = tl.program_id(1)
    first_row = tl.load(blocks_ptr + 2 * tl.program_id(0))
    block_len = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
    seq = tl.load(row_seq_ptr + first_row).to(tl.int64)
    page0 = tl.load(first_page_ptr + seq)  # logical page held by table entry 0
    table = tables_ptr + seq * stride_ts
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    offs_m = tl.arange(0, BLOCK_M)  # [M]
    heads = kv_head * GROUP + offs_m % GROUP  # [M] query head of each M slot
    offs_d = tl.arange(0, BLOCK_D)  # [Dp]
    d_ok = offs_d < HEAD_DIM  # [Dp]
    offs_n = tl.arange(0, BLOCK_N)  # [N]
    in_piece = offs_m // GROUP  # [M] row of each M slot within the piece

    # a block longer than BLOCK_ROWS (planned with a larger block_rows) is walked in pieces
    for piece in range(0, block_len, BLOCK_ROWS):
        m_ok = (in_piece < BLOCK_ROWS) & (piece + in_piece < block_len)  # [M] real (row, head) slots
        rows = first_row + piece + tl.where(m_ok, in_piece, 0)  # [M]; padded slots reread the piece's first row
        hi = tl.where(m_ok, tl.load(kv_len_ptr + rows), 0)  # [M] keys < hi; 0 masks padded slots entirely
        lo = tl.load(kv_lo_ptr + rows)  # [M] keys >= lo
        key_start = tl.load(kv_lo_ptr + first_row + piece)  # rows ascend: first row has the lowest kv_lo
        key_end = tl.load(kv_len_ptr + first_row + tl.minimum(piece + BLOCK_ROWS, block_len) - 1)  # last row's kv_len

        q_off = rows[:, None].to(tl.int64) * stride_qr + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, Dp]
        if DOT_UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [M] running max (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # [M] running sum of exp2
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # [M, Dp]

        for start in range(key_start, key_end, BLOCK_N):
            pos = start + offs_n  # [N] absolute key positions
            n_ok = pos < key_end  # [N]
            block = tl.load(table + (pos // PAGE - page0) * stride_tp, mask=n_ok, other=0).to(tl.int64)  # [N]
            slot = pos % PAGE  # [N]
            kv_mask = n_ok[:, None] & d_ok[None, :]  # [N, Dp]
            k_off = block[:, None] * stride_kb + slot[:, None] * stride_ko + offs_d[None, :] * stride_kd
            k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)  # [N, Dp]
            if DOT_UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
            visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # [M, N]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2(-inf - 0) = 0, not NaN
            p = tl.exp2(s - m_safe[:, None])  # [M, N]
            alpha = tl.exp2(m_i - m_safe)  # [M] rescales what was accumulated under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = block[:, None] * stride_vb + slot[:, None] * stride_vo + offs_d[None, :] * stride_vd
            v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)  # [N, Dp]
            p_low = p.to(v.dtype)  # [M, N] probabilities in the pool's dtype, for the tensor cores
            if DOT_UPCAST:
                p_low = p_low.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=PRECISION)
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [M, Dp]; rows without keys stay 0
        o_off = rows[:, None].to(tl.int64) * stride_or + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def reference_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    paged: PagedRows,
    scale: float,
) -> torch.Tensor:
    """The definition, in fp32 torch: each row gathers its keys kv_lo[r] <= p < kv_len[r] and attends. [R, H, D]"""
    tables, row_seq, first_page, kv_len, kv_lo = (
        paged.tables,
        paged.row_seq,
        paged.first_page,
        paged.kv_len,
        paged.kv_lo,
    )
    num_rows, num_heads, head_dim = q.shape
    num_kv, _, page, _ = k_pool.shape
    group = num_heads // num_kv
    out = torch.zeros(num_rows, num_heads, head_dim, dtype=torch.float32, device=q.device)  # [R, H, D]
    for r in range(num_rows):
        seq = int(row_seq[r])
        pos = torch.arange(int(kv_lo[r]), int(kv_len[r]), device=q.device)  # [L]
        if pos.numel() == 0:
            continue
        blocks = tables[seq, pos // page - int(first_page[seq])].long()  # [L]
        keys = k_pool[:, blocks, pos % page].float().repeat_interleave(group, 0)  # [H, L, D]
        values = v_pool[:, blocks, pos % page].float().repeat_interleave(group, 0)  # [H, L, D]
        scores = torch.einsum("hd,hld->hl", q[r].float(), keys) * scale  # [H, L]
        out[r] = torch.einsum("hl,hld->hd", torch.softmax(scores, -1), values)
    return out.to(q.dtype)


__all__ = [
    "default_block_rows",
    "interpret_mode",
    "paged_attention",
    "plan_query_blocks",
    "reference_paged_attention",
    "triton_available",
    "triton_importable",
]
