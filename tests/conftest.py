"""Shared fixtures: tiny random-weight models saved as real Hugging Face directories, and SmolLM2.

Each tiny model directory holds config.json, generation_config.json (eos id 2),
safetensors weights and an offline byte-level BPE tokenizer (400 tokens:
<pad>=0, <s>=1 prepended on encode, </s>=2 as eos; simple chat template), so
`cbrun.models.load_model(str(dir))` runs transformers' real loading path.
All tiny models share vocab 512, hidden 64, 4 query / 2 KV heads,
intermediate 128, 2048 positions, untied embeddings, seed 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so test modules can `from helpers import ...`

from helpers import TINY_VOCAB_SIZE, build_tiny_tokenizer, save_tiny_model, write_llama_gguf  # noqa: E402

SLIDING_WINDOW = 32  # small, so ordinary test prompts exceed it

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The byte-level BPE tokenizer saved beside every tiny model (PreTrainedTokenizerFast)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """LlamaForCausalLM, 2 layers, head_dim 16."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Qwen3ForCausalLM, 2 layers, explicit head_dim 32 (not hidden/heads), q/k norms."""
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, head_dim=32, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_mistral_sliding_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """MistralForCausalLM, 2 layers, every layer a sliding window of SLIDING_WINDOW (32) tokens."""
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **_COMMON)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="session")
def tiny_gemma_hybrid_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Gemma3ForCausalLM (gemma3_text), 4 layers alternating sliding (window 32) and full attention.

    config.layer_types == ["sliding_attention", "full_attention"] * 2; head_dim 16.
    """
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **_COMMON,
    )
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory, tiny_llama_dir) -> Path:
    """`tiny_llama_dir` converted to an F32 .gguf file (same weights, tokenizer and chat template)."""
    return write_llama_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.F32.gguf")


@pytest.fixture(scope="session")
def smollm2():
    """`(model, tokenizer)` for the default model, SmolLM2-135M-Instruct, in float32 on CPU.

    Downloaded once into the per-user cache; loading the GGUF still takes ~30 s, so it is
    loaded once per session: do not mutate the model or tokenizer in tests.
    """
    from cbrun.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, dtype="float32", device="cpu")
