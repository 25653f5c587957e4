"""Packed token masks applied to logits: a grammar's mask, less the stop ids min_tokens holds back.

A mask is [ceil(V / 32)] int32, bit `t % 32` of word `t // 32` set when token `t` is allowed (the
layout llguidance fills, engine/grammar.py). These act on the sampler's logits, so they live beside
it: the grammar makes masks and imports nothing of sample/, the sampler applies them.
"""

from __future__ import annotations

import torch

from cbrun.engine.sample.kernels import SamplingKernels

_BIT = torch.arange(32, dtype=torch.int32)  # [32] bit positions inside one int32 word of a mask


def without_tokens(mask: torch.Tensor | None, token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """A packed mask ([ceil(V / 32)] int32) allowing what `mask` allows (all of V when None) but `token_ids`.

    When nothing would be left (a grammar that allows only those tokens), `mask` is returned as it is:
    the grammar wins over min_tokens' hold on stop tokens.
    """
    words = (vocab_size + 31) // 32
    banned = torch.full((words,), -1, dtype=torch.int32) if mask is None else mask.clone()  # [W]
    for token in token_ids:
        bit = token % 32
        banned[token // 32] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF  # bit 31 is int32's sign bit
    if mask is not None and not bool(banned.any()):
        return mask
    return banned


def apply_masks(
    logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor], kernels: SamplingKernels | None = None
) -> None:
    """Set the logits of tokens each mask disallows to -inf, in place, in its row only.

    logits [N, V]; rows: indices into N; masks: packed [W] int32 each.
    Columns past the mask's 32 * W tokens (none when built for V) stay as they are.
    With compiled kernels (the ones the sampler is given), one pass over the packed bits (unpacking them
    into torch tensors cost ~90 ms a step for 96 rows of a 49,152-token vocabulary); the same -inf either way.
    """
    packed = torch.stack(masks).to(logits.device)  # [r, W]
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1:
        kernels.apply_token_masks(logits, torch.tensor(rows, dtype=torch.long), packed.contiguous())
        return
    allowed = ((packed[:, :, None] >> _BIT.to(logits.device)) & 1).bool()  # [r, W, 32]
    vocab = logits.shape[1]
    allowed = allowed.view(len(rows), -1)[:, :vocab]  # [r, V]
    index = torch.tensor(rows, device=logits.device)
    with torch.inference_mode():  # the forward's logits are inference tensors
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
