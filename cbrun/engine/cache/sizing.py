"""How many KV blocks to allocate when the user did not say.

The pool takes `max_memory_percent` of the memory available now (RAM on
CPU, free device memory on GPU), minus what one forward pass needs for
activations, logits and index tensors at the configured budgets.
"""

from __future__ import annotations

import logging

import psutil
import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.model_spec import ModelSpec

log = logging.getLogger("cbrun.engine")

_MIN_BLOCKS = 16


def available_memory(device: torch.device) -> int:
    """Bytes that could be used now on this device."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def step_workspace_bytes(spec: ModelSpec, config: EngineConfig, hidden_size: int) -> int:
    """A generous bound on one forward's transient memory at the configured budgets."""
    element = spec.kv.bytes_per_token // (2 * spec.kv.num_layers * spec.kv.num_kv_heads * spec.kv.head_dim)
    tokens = config.max_batch_tokens
    activations = tokens * hidden_size * 16 * element  # residual, MLP intermediates, q/k/v
    logits = config.max_requests_per_batch * spec.vocab_size * 4 * 3  # fp32 logits, logprobs, cdf
    gathered_kv = (
        2 * config.max_requests_per_batch * spec.max_context * spec.kv.num_kv_heads * spec.kv.head_dim * element
    )
    return activations + logits + min(gathered_kv, 4 << 30)


def choose_num_blocks(spec: ModelSpec, config: EngineConfig, device: torch.device, hidden_size: int = 4096) -> int:
    """Blocks that fit `max_memory_percent` of available memory after the step workspace."""
    budget = int(available_memory(device) * config.max_memory_percent)
    budget -= step_workspace_bytes(spec, config, hidden_size)
    per_block = spec.kv.bytes_per_block(config.page_size)
    blocks = max(_MIN_BLOCKS, budget // per_block)
    log.info(
        "cache sizing: %.2f GiB available x %.0f%% -> %d blocks of %d tokens (%.1f MiB each)",
        available_memory(device) / 2**30,
        100 * config.max_memory_percent,
        blocks,
        config.page_size,
        per_block / 2**20,
    )
    return int(blocks)
