"""The model forward: flat inputs in, logits of the sampled positions out.

The model is a stock transformers causal LM whose attention implementation
was switched to ours; each call passes flat `(1, T)` inputs, explicit
positions, no cache object, and the step's `PagedBatch` as one kwarg.

For a plain linear output head the runner projects the sampled rows itself,
so on CPU fp32 the projection can use the small-batch kernel (up to MAX_KERNEL_ROWS = 256 rows)
or oneDNN: at this shape (rows against a vocabulary-sized weight) either runs
about 1.5-3x faster than the default fp32 GEMM, and the head is a quarter of
a small model's decode FLOPs.
Heads that post-process logits (soft-capping, scaling) go through the
model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cbrun.engine.attention import BATCH_KWARG
from cbrun.engine.batch import PagedBatch
from cbrun.engine.cpu_linear import kernel_can_read, small_batch_linear

# config attributes by which a causal LM transforms logits after its head
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class ModelRunner:
    """Runs one forward pass per step and returns fp32 logits of sampled rows."""

    def __init__(self, model, kernels=None) -> None:
        self.model = model
        self.keeps_logits = bool(getattr(model, "_supports_logits_to_keep", lambda: False)())
        self.head = _plain_head(model)
        fast = self.head is not None and kernel_can_read(self.head)
        self.kernels = kernels if fast else None
        self.project = _onednn_project if fast and _onednn_available() else _torch_project

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
        if self.head is None and self.keeps_logits:
            logits = self.model(**kwargs, logits_to_keep=batch.logits_indices).logits  # [1, N, V]
            return logits[0].float()
        hidden = self.model.model(**kwargs).last_hidden_state  # [1, T, hidden]
        rows = hidden[0].index_select(0, batch.logits_indices)  # [N, hidden]
        if self.head is None:
            return self.model.lm_head(rows).float()
        if self.kernels is not None:
            return small_batch_linear(self.kernels, rows, self.head.weight, self.head.bias, large=self.project)
        return self.project(rows, self.head.weight, self.head.bias).float()


def _plain_head(model) -> torch.nn.Linear | None:
    """The model's output head when logits are exactly `lm_head(hidden)`, else None."""
    head = getattr(model, "lm_head", None)
    config = model.config
    configs = (config, getattr(config, "text_config", None))
    transforms = any(getattr(c, name, None) not in (None, 1, 1.0) for c in configs if c is not None
                     for name in _LOGIT_TRANSFORMS)
    return head if type(head) is torch.nn.Linear and not transforms else None


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _torch_project(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(rows, weight, bias)


def _onednn_project(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [N, hidden] @ weight[V, hidden]^T through oneDNN (same result as F.linear up to rounding)."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")
