"""A trainer's token logprobs whose values are the rollout engine's bits, with gradients.

RL trainers compare the logprob a token had when it was sampled with the
trainer's own (PPO/GRPO ratios, KL terms). With any other pair of engine and
trainer the two differ by rounding: another GEMM, another attention, another
batch. `ExactLogprobs` wraps the trainer's transformers causal LM so that on
a padded batch its logprobs are, bit for bit, what cbrun's engine gives the
same tokens (engine_forward.py): on-policy the ratio is exactly 1.

The gradient is the stock model's: the values come from the engine's
kernels, run without autograd, and the stock forward on the same padded
batch supplies the graph, joined as

    logprobs = exact + (stock - stock.detach())

whose value is `exact` (for finite x, x - x is exactly +0) and whose
gradient is d stock / d params. So a training step costs one engine forward
on top of the trainer's usual forward and backward; without grad (the
reference logprobs of a rollout) only the engine forward runs.

A PEFT LoRA model (get_peft_model's) is taken as a rollout engine holds it
(peft_lora.py): its base model's plain layers and its active adapter apart,
the adapter's current A and B read on every call as `LLM.update_lora(name,
get_peft_model_state_dict(model), config=...)` loads them. Its values are the
bits an engine gives requests that name the adapter; the gradient, through
the PEFT model's own forward, reaches A and B.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cbrun.engine.model_spec import CausalLM
from cbrun.training.engine_forward import DEFAULT_PAGE_SIZE, EngineForward, model_dtype
from cbrun.training.peft_lora import active_adapter, base_view, is_peft_model

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class TokenLogprobs(NamedTuple):
    """Per position of a padded batch [B, L]: the token's logprob given the tokens before it in its row
    (fp32; 0 where `scored` is False: padding and each row's first token)."""

    logprobs: torch.Tensor  # [B, L] fp32
    scored: torch.Tensor  # [B, L] bool


class ExactLogprobs:
    """`model`'s token logprobs with the engine's arithmetic, batch-independent, with stock gradients.

    `dtype` names the engine's dtype (float32 or bfloat16; default: the
    model's). A model in another dtype (fp32 master weights for a bf16
    engine) keeps its own for the gradients; the values come from a private
    copy in the engine's dtype, loaded from the model's weights on every call
    as the engine's `update_weights` loads them. `page_size` and `kernels`
    are the engine's (`LLM(..., block_size=..)`, `--kernels`).
    """

    def __init__(
        self,
        model: CausalLM,
        dtype: torch.dtype | str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        kernels: str = "portable",
    ) -> None:
        wanted = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if (wanted is None and dtype is not None) or wanted not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if model_dtype(model) not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the engine computes float32 or bfloat16 models, not {model_dtype(model)}")
        self.model = model
        self.lora = is_peft_model(model)  # a PEFT LoRA model: the base's plain layers, its adapter held apart
        self.engine = EngineForward(base_view(model) if self.lora else model, page_size, kernels, wanted)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TokenLogprobs:
        """input_ids [B, L] (left or right padded; each row's tokens one run where attention_mask is 1) ->
        each token's logprob given the tokens before it in its row, with gradients when grad is enabled."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = _positions(mask)  # [B, L] position in its row's own run
        rows = [input_ids[b][mask[b]].tolist() for b in range(input_ids.shape[0])]
        scored = mask & (positions > 0)  # [B, L] every token but each row's first
        exact = torch.zeros(input_ids.shape, dtype=torch.float32)  # [B, L]
        if any(len(r) > 0 for r in rows):
            present = [b for b, r in enumerate(rows) if r]
            adapter = active_adapter(self.model) if self.lora else None
            values = self.engine.logprobs([rows[b] for b in present], adapter)
            for b, row_values in zip(present, values):
                exact[b, scored[b]] = row_values
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self.model.parameters()):
            return TokenLogprobs(exact, scored)
        stock = self.stock(input_ids, mask, positions)  # [B, L] with the graph
        joined = exact + (stock - stock.detach())
        return TokenLogprobs(torch.where(scored, joined, torch.zeros_like(joined)), scored)

    def stock(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stock transformers forward's logprobs [B, L] fp32 (0 at each row's first column)."""
        logits = self.model(
            input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, use_cache=False
        ).logits  # [B, L, V]
        picked = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]  # [B, L-1]
        return F.pad(picked, (1, 0))  # [B, L]

    def close(self) -> None:
        """Free the engine's packed copies of the weights."""
        self.engine.close()


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position in its row's run of ones [B, L] (0 at padding); raises if a row's run has gaps."""
    counts = mask.long().cumsum(dim=-1)  # [B, L]
    positions = (counts - 1).clamp(min=0) * mask
    for b in range(mask.shape[0]):
        where = mask[b].nonzero()[:, 0]
        if len(where) and int(where[-1] - where[0]) + 1 != len(where):
            raise ValueError(f"row {b}: attention_mask must be one run of ones (left or right padding), not gaps")
    return positions
