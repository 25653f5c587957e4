"""Paged attention, registered with transformers' AttentionInterface.

transformers calls `paged_attention(module, query, key, value, mask, **kw)`
once per layer with the new tokens' projections:

    query  [1, H, T, D]      key/value [1, H_kv, T, D]      -> output [1, T, H, D]

The function writes the new K/V into the layer's page pool, then attends.
With the compiled CPU kernel every query token is a row attended in place
over its own keys, in one call for the whole step (csrc/attention.c): one
arithmetic for decodes, prefill chunks and shared prefixes, so a token's
output never depends on what else is in the step. The torch path (no
compiler, other devices) attends single-query rows in one batched call over
their gathered pages with a key bias, and each prefill chunk with SDPA
(plain causal when the chunk has no cached prefix, else an explicit
bottom-right causal mask). transformers builds no mask for our name, so the
engine owns causality.
Layers with attention logit soft-capping (Gemma 2) always take the torch
paths, with the cap spelled out, since neither SDPA nor our kernels cap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from cbrun.engine.batch import DecodeLayout, PagedBatch, PrefillSeq

ATTENTION_NAME = "cbrun_paged"
BATCH_KWARG = "cbrun_batch"


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`softcap` (Gemma 2) caps the scores as `softcap * tanh(s / softcap)`; the compiled kernels do not,
    so a soft-capped layer always takes the torch paths."""
    batch: PagedBatch = kwargs[BATCH_KWARG]
    layer = module.layer_idx
    layout = batch.groups[batch.layer_groups[layer]]
    k_pool, v_pool = batch.store.layer(layer)  # each [H_kv, NB, page, D]
    if batch.write_kernel is not None:
        batch.write_kernel(k_pool, key[0], layout.write_slots)
        batch.write_kernel(v_pool, value[0], layout.write_slots)
    else:
        _write(k_pool, v_pool, key[0], value[0], layout.write_slots)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    num_heads, num_tokens, head_dim = query.shape[1:]
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    if batch.num_rows:
        q = query[0, :, : batch.num_rows]  # [H, R, D]
        if batch.attend_kernel is not None and not softcap:
            rows = layout.decode
            out[: batch.num_rows] = batch.attend_kernel(
                q.transpose(0, 1).contiguous(), k_pool, v_pool, rows.tables, rows.row_seq, rows.first_page,
                rows.kv_len, rows.kv_lo, rows.tasks, scale)  # [R, H, D]
        else:
            out[: batch.num_rows] = _decode(q, k_pool, v_pool, layout.decode.per_row(), scale, softcap)
    for seq in layout.prefills:
        out[seq.start: seq.end] = _prefill(query, key, value, k_pool, v_pool, seq, scale, softcap)
    return out.unsqueeze(0), None


def _write(k_pool, v_pool, key, value, slots) -> None:
    """Store the new tokens' K/V ([H_kv, T, D]) at their flat slots."""
    num_kv, num_blocks, page, dim = k_pool.shape
    k_pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, key)
    v_pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, value)


def _decode(q: torch.Tensor, k_pool, v_pool, layout: DecodeLayout, scale: float,
            softcap: float | None = None) -> torch.Tensor:
    """Torch path: one query per sequence, all sequences at once: [H, B, D] -> [B, H, D]."""
    num_heads, batch, dim = q.shape
    num_kv, _, page, _ = k_pool.shape
    group = num_heads // num_kv
    if layout.pages is None:  # built for the compiled kernel: derive the torch path's gather and bias once
        _add_torch_addresses(layout, page)
    keys = k_pool.index_select(1, layout.pages).view(num_kv, batch, -1, dim)  # [H_kv, B, L, D]
    values = v_pool.index_select(1, layout.pages).view(num_kv, batch, -1, dim)
    q = q.view(num_kv, group, batch, dim).transpose(1, 2)  # [H_kv, B, G, D]
    scores = _cap(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, softcap)  # [H_kv, B, G, L]
    scores += layout.bias  # [B, 1, L] broadcasts
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [H_kv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, dim)


def _add_torch_addresses(layout: DecodeLayout, page: int) -> None:
    """Fill `layout.pages` and `layout.bias` from the kernel's tables (same rule as the batch builder)."""
    offsets = torch.arange(layout.tables.shape[1] * page, device=layout.tables.device)  # [L]
    key_pos = layout.first_page[:, None] * page + offsets[None, :]  # [B, L]
    valid = (key_pos < layout.kv_len[:, None]) & (key_pos >= layout.kv_lo[:, None])
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    layout.bias = bias.masked_fill_(~valid, float("-inf"))[:, None, :]  # [B, 1, L]
    layout.pages = layout.tables.reshape(-1)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2), applied to scaled scores before the mask."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _prefill(query, key, value, k_pool, v_pool, seq: PrefillSeq, scale: float,
             softcap: float | None = None) -> torch.Tensor:
    """One chunk of one sequence: [1, H, q, D] against its context -> [q, H, D]."""
    q = query[:, :, seq.start: seq.end]  # [1, H, q, D]
    if seq.new_kv_only:
        k = key[:, :, seq.start: seq.end]  # [1, H_kv, q, D]
        v = value[:, :, seq.start: seq.end]
    else:
        num_kv, _, _, dim = k_pool.shape
        k = k_pool.index_select(1, seq.pages).view(1, num_kv, -1, dim)  # [1, H_kv, L, D]
        v = v_pool.index_select(1, seq.pages).view(1, num_kv, -1, dim)
    if softcap:
        return _capped_attention(q[0], k[0], v[0], seq.mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True,
    )  # [1, H, q, D]
    return out[0].transpose(0, 1)


def _capped_attention(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
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


def register() -> str:
    """Register our attention under a name of our own; returns the name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
