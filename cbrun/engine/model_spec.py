"""What the engine needs to know about a model, read once from its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# A transformers causal LM and its tokenizer: their attributes (config, model, lm_head, layers; encode,
# eos_token_id) differ by architecture and are read dynamically, so they are typed as Any.
CausalLM = Any
Tokenizer = Any


class UnsupportedModelError(ValueError):
    """The model cannot be driven by the engine; the message says why."""


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the cache, read from the model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def bytes_per_block(self, page_size: int) -> int:
        return self.bytes_per_token * page_size


@dataclass(frozen=True)
class ModelSpec:
    kv: KVShape
    layer_groups: tuple[str, ...]  # per layer: "full" or "sliding"
    sliding_window: int | None
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    num_heads: int = 0  # query heads (G = num_heads // kv.num_kv_heads per kv head)
    softcaps_attention: bool = False  # scores capped as c * tanh(s / c) (Gemma 2): the kernels do not cap

    @property
    def has_full_layers(self) -> bool:
        return "full" in self.layer_groups


def read_model_spec(model: CausalLM, tokenizer: Tokenizer) -> ModelSpec:
    """Derive cache shape, layer attention types, limits and EOS ids from a loaded model."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{config.model_type}: encoder-decoder models are not supported")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    kv = KVShape(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        dtype=next(model.parameters()).dtype,
    )
    groups, window = _layer_groups(config)
    return ModelSpec(
        kv=kv,
        layer_groups=groups,
        sliding_window=window,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        max_context=int(getattr(config, "max_position_embeddings", 0) or 1 << 30),
        eos_token_ids=_eos_ids(model, tokenizer),
        num_heads=num_heads,
        softcaps_attention=_softcaps_attention(config),
    )


def _softcaps_attention(config: Any) -> bool:
    """Whether the model soft-caps its attention scores (Gemma 2's attn_logit_softcapping)."""
    configs = (config, getattr(config, "text_config", None))
    return any(getattr(c, "attn_logit_softcapping", None) for c in configs if c is not None)


def _layer_groups(config: Any) -> tuple[tuple[str, ...], int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"{config.model_type}: unsupported attention types {sorted(unknown)}")
        groups = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
    elif window:
        groups = ("sliding",) * config.num_hidden_layers
    else:
        groups = ("full",) * config.num_hidden_layers
    if "sliding" not in groups:
        window = None
    elif not window:
        raise UnsupportedModelError(f"{config.model_type}: sliding layers without a sliding_window size")
    return groups, window


def _eos_ids(model: CausalLM, tokenizer: Tokenizer) -> frozenset[int]:
    """EOS ids as model.generate sees them: generation config first, then model config, then tokenizer."""
    generation = getattr(model, "generation_config", None)
    for source in (
        getattr(generation, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
    ):
        if isinstance(source, int):
            return frozenset([source])
        if isinstance(source, (list, tuple)) and source:
            return frozenset(int(x) for x in source)
    return frozenset()


def default_device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device
