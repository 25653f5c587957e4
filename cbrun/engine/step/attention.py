"""Paged attention, registered with transformers' AttentionInterface.

transformers calls `paged_attention(module, query, key, value, mask, **kw)`
once per layer with the new tokens' projections:

    query  [1, H, T, D]      key/value [1, H_kv, T, D]      -> output [1, T, H, D]

The function writes the new K/V into the layer's page pool, then attends,
both through the engine's compute backend (backends/base.py), which the runner
passes next to the step's batch. The leading `num_rows` tokens are attended
row by row by the backend, as its metadata builder laid them out: with a
compiled kernel (CPU, Triton) that is every token of the step, each attended
in place over its own keys in one call, so one arithmetic serves decodes,
prefill chunks and shared prefixes and a token's output never depends on
what else is in the step. The torch reference's layout leaves longer or
fresh chunks after the rows, each attended whole with SDPA
(torch_attention.py). transformers builds no mask for our name, so the
engine owns causality.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from cbrun.engine.backends import torch_attention
from cbrun.engine.backends.base import Backend
from cbrun.engine.step.batch import PagedBatch

ATTENTION_NAME = "cbrun_paged"
BATCH_KWARG = "cbrun_batch"  # the step's PagedBatch (tensors only)
BACKEND_KWARG = "cbrun_backend"  # the engine's compute backend (backends/base.py), which attends and writes K/V


def paged_attention(
    module: Any,  # the layer's transformers attention module (its layer_idx is read)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`softcap` (Gemma 2) caps the scores as `softcap * tanh(s / softcap)`; the compiled kernels do not,
    so a backend lays a soft-capped model's steps out for the torch paths."""
    batch: PagedBatch = kwargs[BATCH_KWARG]
    backend: Backend = kwargs[BACKEND_KWARG]
    layer = module.layer_idx
    layout = batch.groups[batch.layer_groups[layer]]
    k_pool, v_pool = batch.store.layer(layer)  # each [H_kv, NB, page, D]
    backend.write_kv(k_pool, v_pool, key[0], value[0], layout.write_slots)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    num_heads, num_tokens, head_dim = query.shape[1:]
    if batch.num_rows:
        q = query[0, :, : batch.num_rows]  # [H, R, D]
        assert layout.rows is not None  # row-attended tokens have their layout
        attended = backend.attend_rows(q, k_pool, v_pool, layout.rows, scale, softcap)  # [R, H, D]
        if batch.num_rows == num_tokens:  # every token a row (the kernels' layout): no copy
            return attended.unsqueeze(0), None
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    if batch.num_rows:
        out[: batch.num_rows] = attended
    for seq in layout.prefills:
        out[seq.start : seq.end] = torch_attention.prefill(
            query, key, value, k_pool, v_pool, seq, scale=scale, softcap=softcap
        )
    return out.unsqueeze(0), None


def register() -> str:
    """Register our attention under a name of our own; returns the name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
