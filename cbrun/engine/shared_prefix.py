"""Shared-prefix ("cascade") decode attention.

When many decoding rows start with the same cached pages (a common system
prompt, n samples of one prompt), the row-by-row decode kernel reads those
keys and values once per row and multiplies them one query at a time. Here
the shared part is attended for all of a group's rows at once, as two
matrix products per KV head:

    scores [R*G, L] = q [R*G, D] @ keys [L, D]^T      (per KV head)
    out    [R*G, D] = exp(scores - max) @ values [L, D]

and the decode kernel continues each row's softmax from that state over its
own remaining keys (from `kv_lo` = L on). Exact up to float rounding: the
two parts merge through the running max and sum, as in flash-decoding.
In fp32 the compiled kernel (csrc/panel_attention.c) does both products and
the softmax per panel of 16 query rows in cache, about twice torch's speed
here; the torch path below is its reference and fallback.

Groups are found once per step (`find_shared_prefixes`), for full-attention
layers only; a group pays off when rows x shared keys is large.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # rows in a group
# rows x shared keys. Measured on the default model (2 cores, 512 shared keys, W-prefix-like runs of
# 128 requests): with the compiled kernel, shared + decode attention took 6.5-6.7 s from 64 rows on
# against 8.1-9.3 s from 192 (the torch path gained nothing below ~192 rows); so from about 64.
MIN_ROW_KEYS = 64 * 512


@dataclass
class SharedPrefix:
    """Decode rows whose first `pages.numel()` pages are the same blocks, all visible to each of them."""

    rows: torch.Tensor  # [R] row indices
    pages: torch.Tensor  # [S] block ids


def find_shared_prefixes(tables: torch.Tensor, kv_len: torch.Tensor,
                         page_size: int) -> tuple[list[SharedPrefix], torch.Tensor | None]:
    """Groups of rows by their first block, with their common leading pages.

    tables [B, max_pages] (first logical page 0 for every row), kv_len [B].
    Returns the groups worth batching and each row's first key position left
    to the kernel ([B]; 0 for rows in no group), or ([], None).
    """
    if tables.shape[0] < MIN_ROWS or tables.shape[0] * int(kv_len.max()) < MIN_ROW_KEYS:
        return [], None  # no group could pay off: skip the per-step grouping work
    groups = []
    lo = torch.zeros_like(kv_len)
    first_blocks, counts = torch.unique(tables[:, 0], return_counts=True)
    for block in first_blocks[counts >= MIN_ROWS].tolist():
        rows = (tables[:, 0] == block).nonzero().squeeze(1)  # [R]
        group_tables = tables.index_select(0, rows)  # [R, max_pages]
        same = (group_tables == group_tables[0]).all(0).long()  # [max_pages]
        common = int(same.cumprod(0).sum())
        visible = int(kv_len.index_select(0, rows).min()) // page_size  # pages every row sees whole
        shared = min(common, visible)
        if shared == 0 or rows.numel() * shared * page_size < MIN_ROW_KEYS:
            continue
        groups.append(SharedPrefix(rows, group_tables[0, :shared].clone()))
        lo[rows] = shared * page_size
    return (groups, lo) if groups else ([], None)


def attend_shared_prefixes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           groups: list[SharedPrefix], scale: float, kernel=None):
    """Softmax state of each row over its group's shared keys (rows in no group: empty state).

    q [B, H, D]; pools [H_kv, NB, P, D]. Returns (max [B, H], sum [B, H],
    unnormalized output [B, H, D]), fp32, for the decode kernel to continue.
    `kernel` (the compiled `CpuKernels.shared_prefix`, fp32) computes a group
    in one pass that stays in cache; groups it declines take the torch path.
    """
    batch, heads, dim = q.shape
    top = torch.full((batch, heads), float("-inf"))
    total = torch.zeros(batch, heads)
    acc = torch.zeros(batch, heads, dim)
    for group in groups:
        if kernel is None or not kernel(q, k_pool, v_pool, group.rows, group.pages, scale, (top, total, acc)):
            _attend_group(q, k_pool, v_pool, group, scale, (top, total, acc))
    return top, total, acc


def _attend_group(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: SharedPrefix,
                  scale: float, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The torch path for one group: two GEMMs per KV head, written into `state` at the group's rows."""
    heads, dim = q.shape[1:]
    num_kv = k_pool.shape[0]
    group_size = heads // num_kv
    top, total, acc = state
    rows = group.rows.numel()
    queries = q.index_select(0, group.rows).float().mul_(scale).view(rows, num_kv, group_size, dim)
    for head in range(num_kv):  # one plain GEMM per head: faster than one bmm over 2-4 heads here
        keys = k_pool[head].index_select(0, group.pages).view(-1, dim).float()  # [L, D]
        values = v_pool[head].index_select(0, group.pages).view(-1, dim).float()
        scores = F.linear(queries[:, head].reshape(rows * group_size, dim), keys)  # [R*G, L]
        row_max = scores.amax(-1, keepdim=True)  # [R*G, 1]
        probs = scores.sub_(row_max).exp_()
        heads_of_kv = slice(head * group_size, (head + 1) * group_size)
        top[group.rows, heads_of_kv] = row_max.view(rows, group_size)
        total[group.rows, heads_of_kv] = probs.sum(-1).view(rows, group_size)
        acc[group.rows, heads_of_kv] = torch.mm(probs, values).view(rows, group_size, dim)
