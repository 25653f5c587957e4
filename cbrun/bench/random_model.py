"""Random-weight models of real architectures at real sizes (0.5B to 8B), for `cbrun bench --model random:NAME`.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PREFIX = "random:"

# model type and config of each shape (from the published config.json files; vocab_size is the tokenizer's)
SHAPES: dict[str, tuple[str, dict]] = {
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
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
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
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
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
    "llama-3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-7b": (
        "qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
_SHARD_BYTES = 2 << 30  # safetensors shards of at most 2 GiB, as published checkpoints are split
_INIT_STD = 0.02  # transformers' initializer_range: the weights' spread, as from_config would draw them


class RandomModelError(ValueError):
    """An unknown random:NAME; the message lists the known ones."""


def is_random(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def random_model_dir(spec: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The saved directory of `random:NAME` in `dtype` (built and saved on first use, then reused)."""
    from cbrun.models import cache_dir

    name = spec.removeprefix(PREFIX)
    if name not in SHAPES:
        raise RandomModelError(f"unknown random model {name!r}; choose from {', '.join(SHAPES)}")
    target = cache_dir() / "random-models" / f"{name}-{dtype}-seed{seed}-v2"
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
    """Write the checkpoint tensor by tensor into shards (an 8B model never sits in memory whole): the model is
    built on the meta device for its parameter names and shapes; matrices are drawn N(0, 0.02) from a generator
    seeded per tensor, norms are ones, biases zeros (transformers' own initialization)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

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
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    torch_dtype = getattr(torch, dtype)
    named = dict(model.named_parameters())  # tied weights once, under the name transformers saves
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for index, (param_name, param) in enumerate(named.items()):
        tensor = _draw(param_name, tuple(param.shape), seed * 100003 + index).to(torch_dtype)
        if size and size + tensor.nbytes > _SHARD_BYTES:
            _write_shard(shards[-1], directory, len(shards))
            shards.append({})
            size = 0
        shards[-1][param_name] = tensor
        size += tensor.nbytes
    _write_shard(shards[-1], directory, len(shards))
    _name_shards(directory, len(shards))
    config.save_pretrained(directory)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(
        directory
    )
    tokenizer.save_pretrained(directory)


def _draw(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).mul_(_INIT_STD)


def _write_shard(tensors: dict, directory: Path, number: int) -> None:
    """Save one shard (as shard `number`, renamed once their count is known) and let its tensors go."""
    from safetensors.torch import save_file

    save_file(tensors, str(directory / f"shard-{number}.safetensors"), metadata={"format": "pt"})
    tensors.clear()


def _name_shards(directory: Path, count: int) -> None:
    """model.safetensors for one shard, else model-0000i-of-0000n.safetensors with the index transformers reads."""
    import json

    from safetensors import safe_open

    if count == 1:
        os.replace(directory / "shard-1.safetensors", directory / "model.safetensors")
        return
    weight_map = {}
    for number in range(1, count + 1):
        final = f"model-{number:05d}-of-{count:05d}.safetensors"
        os.replace(directory / f"shard-{number}.safetensors", directory / final)
        with safe_open(str(directory / final), "pt") as shard:
            for key in shard.keys():  # noqa: SIM118  (safe_open is not a mapping)
                weight_map[key] = final
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
