"""The model forward: flat inputs in, logits of the sampled positions out.

The model is a stock transformers causal LM whose attention implementation
was switched to ours; each call passes flat `(1, T)` inputs, explicit
positions, no cache object, and the step's `PagedBatch` as one kwarg.
"""

from __future__ import annotations

import torch

from cbrun.engine.attention import BATCH_KWARG
from cbrun.engine.batch import PagedBatch


class ModelRunner:
    """Runs one forward pass per step and returns fp32 logits of sampled rows."""

    def __init__(self, model) -> None:
        self.model = model
        self.keeps_logits = bool(getattr(model, "_supports_logits_to_keep", lambda: False)())

    @torch.inference_mode()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """Logits [N, V] (fp32) at each sampled sequence's last token."""
        kwargs = {
            "input_ids": batch.input_ids,  # [1, T]
            "position_ids": batch.position_ids,  # [1, T]
            "use_cache": False,
            BATCH_KWARG: batch,
        }
        if not len(batch.logits_indices):
            self.model.model(**kwargs)  # chunk-only step: fill the cache, no logits
            return torch.empty(0)
        if self.keeps_logits:
            logits = self.model(**kwargs, logits_to_keep=batch.logits_indices).logits  # [1, N, V]
            return logits[0].float()
        hidden = self.model.model(**kwargs).last_hidden_state  # [1, T, hidden]
        rows = hidden[0].index_select(0, batch.logits_indices)  # [N, hidden]
        return self.model.lm_head(rows).float()
