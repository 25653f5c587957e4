"""The model forward: flat inputs in, logits of the sampled positions out.

The model is a stock transformers causal LM whose attention implementation
was switched to ours; each call passes flat `(1, T)` inputs, explicit
positions, no cache object, and the step's `PagedBatch` as one kwarg.

For a plain linear output head the runner projects the sampled rows itself,
through its backend: on CPU the compiled linear kernel, straight to fp32
logits (bf16 models too) and in one summation order for any number of rows,
so a request's logits do not depend on its neighbours. Heads that post-process
logits (soft-capping, scaling) go through the model's own forward.

One layer's path, which no single file shows (set up once, then per step):

    EngineCore.__init__ (core.py)        model.set_attn_implementation(register_attention()): the name
                                         "cbrun_paged" -> step/attention.py `paged_attention`, in
                                         transformers' AttentionInterface registry
    CpuBackend.install (cpu/backend.py)  install_fused_layers (fused/layers.py): each Llama-shaped layer
                                         that passes its probe gets, per instance, `forward =
                                         partial(fused_forward, ...)` (HeldWeights.route, linear/held_weights.py)
    step: EngineCore.step -> ModelRunner.forward -> self.model.model(**kwargs), the batch and the
          backend in kwargs as BATCH_KWARG / BACKEND_KWARG (and LORA_KWARG)
      -> transformers' decoder model (e.g. LlamaModel.forward) calls each layer with **kwargs
      -> fused layer: fused_forward -> _attention (fused/layers.py), or a stock layer: its self_attn
      -> both look the attention up by name: ALL_ATTENTION_FUNCTIONS.get_interface(
         config._attn_implementation) -> paged_attention(module, q, k, v, mask, **kwargs)
      -> paged_attention pulls the PagedBatch and the Backend out of **kwargs, writes K/V and attends
         through the backend (write_kv, attend_rows; torch_attention.prefill for the torch layout)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cbrun.engine.backends.base import Backend
from cbrun.engine.model_spec import CausalLM
from cbrun.engine.step.attention import BACKEND_KWARG, BATCH_KWARG
from cbrun.engine.step.batch import PagedBatch
from cbrun.lora.adapters import LoRAAdapters
from cbrun.lora.step import LORA_KWARG

# config attributes by which a causal LM transforms logits after its head
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


SCORE_CHUNK = 256  # score rows projected (and log-softmaxed) at a time: bounds the [rows, V] logits


@dataclass
class StepLogits:
    """What one forward hands back: logits of the sampled rows, and where the score rows' come from.

    score_hidden holds the final hidden states of the positions scoring
    requests keep; their logits are made `SCORE_CHUNK` rows at a time by
    `score_chunks`, so a long sequence never has a [T, V] tensor at once.
    score_logits is used instead for heads the runner cannot apply itself.
    """

    sampled: torch.Tensor  # [N, V] fp32
    score_hidden: torch.Tensor | None = None  # [S, hidden]
    score_logits: torch.Tensor | None = None  # [S, V] fp32 (model-applied heads only)


class ModelRunner:
    """Runs one forward pass per step and returns fp32 logits of sampled rows."""

    def __init__(self, model: CausalLM, backend: Backend, adapters: LoRAAdapters | None = None) -> None:
        self.model = model
        self.backend = backend
        self.adapters = adapters  # LoRA: the step's adapted rows reach the fused layers as a kwarg, the rest by hooks
        self.keeps_logits = bool(getattr(model, "_supports_logits_to_keep", lambda: False)())
        self.head = _plain_head(model)

    @torch.inference_mode()
    def forward(self, batch: PagedBatch) -> StepLogits:
        """Logits [N, V] (fp32) at each sampled sequence's last token, plus the score rows."""
        if batch.lora is None or self.adapters is None:
            return self._forward(batch)
        with self.adapters.active(batch.lora):
            return self._forward(batch)

    def _forward(self, batch: PagedBatch) -> StepLogits:
        kwargs = {
            "input_ids": batch.input_ids,  # [1, T]
            "position_ids": batch.position_ids,  # [1, T]
            "use_cache": False,
            BATCH_KWARG: batch,
            BACKEND_KWARG: self.backend,
        }
        if batch.lora is not None:
            kwargs[LORA_KWARG] = batch.lora
        num_sampled = len(batch.logits_indices)
        score_indices = batch.score_indices if batch.score_indices is not None else batch.logits_indices[:0]
        if not num_sampled and not len(score_indices):
            self.model.model(**kwargs)  # chunk-only step: fill the cache, no logits
            return StepLogits(torch.empty(0))
        if self.head is None and self.keeps_logits:
            keep = torch.cat([batch.logits_indices, score_indices])  # [N + S]
            logits = self.model(**kwargs, logits_to_keep=keep).logits[0].float()  # [N + S, V]
            return StepLogits(logits[:num_sampled], score_logits=logits[num_sampled:] if len(score_indices) else None)
        hidden = self.model.model(**kwargs).last_hidden_state[0]  # [T, hidden]
        sampled = (
            self._project(hidden.index_select(0, batch.logits_indices)) if num_sampled else torch.empty(0)
        )  # [N, V]
        score_hidden = hidden.index_select(0, score_indices) if len(score_indices) else None  # [S, hidden]
        return StepLogits(sampled, score_hidden=score_hidden)

    @torch.inference_mode()
    def score_chunks(self, step: StepLogits) -> Iterator[tuple[int, torch.Tensor]]:
        """(first score row, fp32 logits [c, V]) for the step's score rows, SCORE_CHUNK rows at a time.

        Each chunk goes through `_project`, the very head projection that
        sampled rows take, so a scored token gets the logits generate saw.
        """
        if step.score_logits is not None:
            for start in range(0, step.score_logits.shape[0], SCORE_CHUNK):
                yield start, step.score_logits[start : start + SCORE_CHUNK]
            return
        if step.score_hidden is None:
            return
        for start in range(0, step.score_hidden.shape[0], SCORE_CHUNK):
            yield start, self._project(step.score_hidden[start : start + SCORE_CHUNK])

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        """Output head: rows [n, hidden] -> fp32 logits [n, V]; the one place logits are made."""
        if self.head is None:
            return self.model.lm_head(rows).float()
        return self.backend.project(self.head, rows)


def _plain_head(model: CausalLM) -> torch.nn.Linear | None:
    """The model's output head when logits are exactly `lm_head(hidden)`, else None."""
    head = getattr(model, "lm_head", None)
    config = model.config
    configs = (config, getattr(config, "text_config", None))
    transforms = any(
        getattr(c, name, None) not in (None, 1, 1.0) for c in configs if c is not None for name in _LOGIT_TRANSFORMS
    )
    return head if type(head) is torch.nn.Linear and not transforms else None
