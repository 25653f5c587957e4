"""Which architectures the engine can drive, and a refusal that says why for the ones it cannot.

Checked on the config, before any weights are read, so that an unsupported
model fails at load rather than deep in a forward pass.
"""

from __future__ import annotations

from typing import Any

from cbrun.models.errors import ModelLoadError

# Stock decoder-only causal LMs whose attention goes through transformers'
# AttentionInterface with standard (optionally sliding-window) causal attention;
# the engine swaps in its own paged attention for exactly these. gemma2 also
# passes `softcap`, and all of them pass `scaling`, which the engine honours.
# Each is parity-tested on a tiny model in tests/models/test_model_matrix.py (keep the two in step).
# gemma3 is the multimodal checkpoint: its text decoder is kept (see _text_decoder in load.py).
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2",
        "gemma3", "gemma3_text", "phi3", "olmo2", "granite", "helium",
        "smollm3", "starcoder2", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
    }
)  # fmt: skip

# Causal LMs people name that the engine cannot drive, and why (one line each).
_STATE_CACHE = "recurrent (state-space or linear-attention) layers, which need a state cache the engine lacks"
UNSUPPORTED_REASONS = {
    "gpt_oss": "its attention adds learned sink logits, which the paged attention does not",
    "deepseek_v2": "multi-head latent attention (keys and values of different head sizes)",
    "deepseek_v3": "multi-head latent attention (keys and values of different head sizes)",
    "llama4": "chunked-attention layers",
    **dict.fromkeys(
        ("mamba", "mamba2", "jamba", "bamba", "falcon_h1", "zamba", "zamba2", "qwen3_next", "lfm2"), _STATE_CACHE
    ),
}


def check_supported(config: Any, spec: str = "") -> None:
    """Refuse architectures the engine's paged attention cannot drive."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    if model_type in UNSUPPORTED_REASONS:
        raise ModelLoadError(
            f"Cannot load model {spec!r}: model type {model_type!r} is not supported: "
            f"{UNSUPPORTED_REASONS[model_type]}."
        )
    archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
    raise ModelLoadError(
        f"Cannot load model {spec!r}: model type {model_type!r} ({archs}) is not supported. "
        "cbrun drives stock decoder-only causal LMs whose attention goes through transformers' "
        f"AttentionInterface: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}."
    )
