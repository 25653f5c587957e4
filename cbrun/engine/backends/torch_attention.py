"""The torch reference attention over the paged cache: plain torch ops, any device.

Every other backend is tested against these functions. Single-query rows
(decodes, short chunks over a cached context) are attended in one batched
call over their gathered pages with a key bias; each longer or fresh prefill
chunk goes through SDPA (plain causal when it has no cached prefix, else an
explicit bottom-right causal mask). Soft-capped layers (Gemma 2) spell the
cap out, since SDPA cannot cap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cbrun.engine.step.batch import DecodeLayout, PrefillSeq


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
    layout: DecodeLayout,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Torch path: one query per sequence, all sequences at once: [H, B, D] -> [B, H, D]."""
    num_heads, batch, dim = q.shape
    num_kv, _, page, _ = k_pool.shape
    group = num_heads // num_kv
    if layout.pages is None:  # the first layer of the step derives the gather and the bias, the others reuse them
        _add_torch_addresses(layout, page)
    assert layout.pages is not None and layout.bias is not None  # both set together, just above or earlier
    keys = k_pool.index_select(1, layout.pages).view(num_kv, batch, -1, dim)  # [H_kv, B, L, D]
    values = v_pool.index_select(1, layout.pages).view(num_kv, batch, -1, dim)
    q = q.view(num_kv, group, batch, dim).transpose(1, 2)  # [H_kv, B, G, D]
    scores = _cap(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, softcap)  # [H_kv, B, G, L]
    scores += layout.bias  # [B, 1, L] broadcasts
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [H_kv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, dim)


def _add_torch_addresses(layout: DecodeLayout, page: int) -> None:
    """Fill `layout.pages` and `layout.bias` [B, 1, L] from the per-row tables and key ranges: keys at
    positions in [kv_lo, kv_len) get 0, the rest (padding pages included) -inf."""
    offsets = torch.arange(layout.tables.shape[1] * page, device=layout.tables.device)  # [L]
    key_pos = layout.first_page[:, None] * page + offsets[None, :]  # [B, L]
    valid = (key_pos < layout.kv_len[:, None]) & (key_pos >= layout.kv_lo[:, None])
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    layout.bias = bias.masked_fill_(~valid, float("-inf"))[:, None, :]  # [B, 1, L]
    layout.pages = layout.tables.reshape(-1)


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
