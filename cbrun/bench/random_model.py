"""Random-weight models of real architectures at real sizes, for `cbrun bench --model random:NAME`.

The default model (135M parameters) is small enough that per-step overheads
weigh as much as the matrix products; a 1-2B model is where GEMMs dominate, as
in most production jobs. Weights cannot be downloaded here, so the bench builds
the architecture from its config with seeded random weights (as vLLM's
`load_format="dummy"` does), saves it once as a Hugging Face directory (both
cbrun and vLLM then load the same files) and gives it SmolLM2's tokenizer, so
its vocabulary is SmolLM2's 49,152 tokens, not the original's: every layer has
the real shape, the output head is smaller than the real one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

PREFIX = "random:"

# model type and config of each shape (from the published config.json files; vocab_size is the tokenizer's)
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-1.7b": (
        "qwen3",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
}


class RandomModelError(ValueError):
    """An unknown random:NAME; the message lists the known ones."""


def is_random(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def random_model_dir(spec: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The saved directory of `random:NAME` in `dtype` (built and saved on first use, then reused)."""
    from cbrun.models import cache_dir

    name = spec.removeprefix(PREFIX)
    if name not in SHAPES:
        raise RandomModelError(f"unknown random model {name!r}; choose from {', '.join(sorted(SHAPES))}")
    target = cache_dir() / "random-models" / f"{name}-{dtype}-seed{seed}"
    if (target / "COMPLETE").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    _build(name, dtype, seed, scratch)
    (scratch / "COMPLETE").write_text(f"{spec} {dtype} seed {seed}\n")
    with contextlib.suppress(OSError):  # another run built it meanwhile
        os.replace(scratch, target)
    return target


def _build(name: str, dtype: str, seed: int, directory: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from cbrun.models import DEFAULT_MODEL, load_model

    _, tokenizer = load_model(DEFAULT_MODEL, dtype="float32", device="cpu")  # the tokenizer of the default model
    model_type, fields = SHAPES[name]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
