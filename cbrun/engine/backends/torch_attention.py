"""The torch reference attention over the paged cache, and the per-step metadata it reads: plain torch ops, any device.

Every other backend is tested against these functions. Single-query rows
(decodes, short chunks over a cached context) are attended in one batched
call over their gathered pages with a key bias; each longer or fresh prefill
chunk goes through SDPA (plain causal when it has no cached prefix, else an
explicit bottom-right causal mask). Soft-capped layers (Gemma 2) spell the
cap out, since SDPA cannot cap.

`TorchMetadataBuilder` lays a step out that way, once per step on the host:
the rows' padded page tables and key biases, the chunks' pages and masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbrun.engine.backends.metadata import PrefillSeq, RowLayout, SequenceRows

ROW_CHUNK = 64  # chunks over a cached context up to this long are attended row by row


@dataclass
class TorchRows(RowLayout):
    """The torch path's rows: every row's pages through one padded table, and a bias that masks its keys."""

    pages: torch.Tensor  # [B * max_pages] int64 block ids, row b's padded table at [b * max_pages, (b + 1) * max_pages)
    bias: torch.Tensor  # [B, 1, max_pages * page] fp32: 0 for a key at a position in [kv_lo, kv_len), else -inf


class TorchMetadataBuilder:
    """The torch reference's layout: decodes and short chunks over a cached context as rows, other chunks whole."""

    def attends_as_row(self, start: int, count: int) -> bool:
        return count == 1 or (start > 0 and count <= ROW_CHUNK)

    def build(
        self, seqs: Sequence[SequenceRows], page_size: int, window: int | None
    ) -> tuple[TorchRows | None, list[PrefillSeq]]:
        rows = [seq for seq in seqs if self.attends_as_row(seq.start, seq.count)]
        chunks = seqs[len(rows) :]  # the batch builder put the row sequences first
        layout = _rows(rows, page_size, window) if rows else None
        return layout, [_chunk(seq, page_size, window) for seq in chunks]


def _rows(seqs: Sequence[SequenceRows], page: int, window: int | None) -> TorchRows:
    """One padded table per row (its sequence's, repeated) and the bias of its visible keys: causal, and within
    the window if any. Padding pages hold finite values (zeroed pools) and are masked."""
    max_pages = max(len(seq.table) for seq in seqs)
    padded: list[list[int]] = []
    firsts: list[int] = []
    lengths: list[int] = []
    for seq in seqs:
        row_table = seq.table + [seq.table[0]] * (max_pages - len(seq.table))
        for pos in range(seq.start, seq.start + seq.count):
            padded.append(row_table)
            firsts.append(seq.first_page)
            lengths.append(pos + 1)  # causal: keys up to and including this token
    kv_len = torch.tensor(lengths, dtype=torch.long)  # [B]
    kv_lo = torch.tensor([max(0, n - window) if window is not None else 0 for n in lengths], dtype=torch.long)  # [B]
    offsets = torch.arange(max_pages * page)  # [L]
    key_pos = torch.tensor(firsts, dtype=torch.long)[:, None] * page + offsets[None, :]  # [B, L]
    valid = (key_pos < kv_len[:, None]) & (key_pos >= kv_lo[:, None])
    bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
    return TorchRows(pages=torch.tensor(padded, dtype=torch.long).reshape(-1), bias=bias[:, None, :])


def _chunk(seq: SequenceRows, page: int, window: int | None) -> PrefillSeq:
    """A chunk attended whole: over its own keys alone when it starts the sequence, else over its pages."""
    start, count, offset = seq.start, seq.count, seq.first_row
    query_pos = torch.arange(start, start + count)  # [q]
    if start == 0:
        mask = None
        if window is not None and count > window:
            mask = _causal_window(query_pos, torch.arange(count), window)
        return PrefillSeq(offset, offset + count, True, None, mask)
    key_pos = seq.first_page * page + torch.arange(len(seq.table) * page)  # [L]
    mask = _causal_window(query_pos, key_pos, window)
    return PrefillSeq(offset, offset + count, False, torch.tensor(seq.table, dtype=torch.long), mask)


def _causal_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] bool: key at or before the query, and within the window if any."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed


def write(
    k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the new tokens' K/V ([H_kv, T, D]) at their flat slots."""
    num_kv, num_blocks, page, dim = k_pool.shape
    k_pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, key)
    v_pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, value)


def decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: TorchRows,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Torch path: one query per row, all rows at once: [H, B, D] -> [B, H, D]."""
    num_heads, batch, dim = q.shape
    num_kv = k_pool.shape[0]
    group = num_heads // num_kv
    keys = k_pool.index_select(1, rows.pages).view(num_kv, batch, -1, dim)  # [H_kv, B, L, D]
    values = v_pool.index_select(1, rows.pages).view(num_kv, batch, -1, dim)
    q = q.view(num_kv, group, batch, dim).transpose(1, 2)  # [H_kv, B, G, D]
    scores = _cap(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, softcap)  # [H_kv, B, G, L]
    scores += rows.bias  # [B, 1, L] broadcasts
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [H_kv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, dim)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2), applied to scaled scores before the mask."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq: PrefillSeq,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One chunk of one sequence: [1, H, q, D] against its context -> [q, H, D]."""
    q = query[:, :, seq.start : seq.end]  # [1, H, q, D]
    if seq.new_kv_only:
        k = key[:, :, seq.start : seq.end]  # [1, H_kv, q, D]
        v = value[:, :, seq.start : seq.end]
    else:
        assert seq.pages is not None  # a chunk over a cached context names its pages
        num_kv, _, _, dim = k_pool.shape
        k = k_pool.index_select(1, seq.pages).view(1, num_kv, -1, dim)  # [1, H_kv, L, D]
        v = v_pool.index_select(1, seq.pages).view(1, num_kv, -1, dim)
    if softcap:
        return _capped_attention(q[0], k[0], v[0], seq.mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, q, D]
    return out[0].transpose(0, 1)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """SDPA cannot cap scores, so spell it out: q [H, q, D], k/v [H_kv, L, D] -> [q, H, D].

    `mask` None means plain causal over keys that are exactly the queries' own.
    """
    num_heads, length, dim = q.shape
    num_kv = k.shape[0]
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril_()
    grouped = q.reshape(num_kv, num_heads // num_kv * length, dim)  # [H_kv, G * q, D]
    scores = _cap(torch.matmul(grouped, k.transpose(-1, -2)).float() * scale, softcap)  # [H_kv, G * q, L]
    scores = scores.view(num_kv, -1, length, k.shape[1]).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_kv, -1, k.shape[1])
    out = torch.matmul(probs, v).view(num_heads, length, dim)  # [H, q, D]
    return out.transpose(0, 1)
