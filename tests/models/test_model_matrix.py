"""The architecture matrix: every model type cbrun accepts, proven on a tiny random-weight model.

For each type, a 2-layer, hidden-64 model is built from that type's own config
class, saved as a Hugging Face directory and loaded through `load_model`. The
engine then runs it on its CPU fast path (compiled kernels, fused decoder
layers where their install-time probe accepts the layer) with chunked prefill,
decodes mixed into the same steps, sliding windows and a prefix-cache hit,
and must give `model.generate`'s greedy tokens and a plain forward's logprobs.

`MATRIX` is also the source of the README's model table: run
`python tests/models/test_model_matrix.py` to print it, and
`test_readme_table_matches_the_matrix` keeps the two in step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for helpers

from helpers import TINY_VOCAB_SIZE, save_tiny_model

WINDOW = 16  # sliding window of the tiny models: shorter than most test prompts
README = Path(__file__).parents[2] / "README.md"
TABLE_START, TABLE_END = "<!-- model-matrix:start -->", "<!-- model-matrix:end -->"


@dataclass(frozen=True)
class Arch:
    """One row of the matrix: a model type, how its tiny model is built, and what the fast path does with it."""

    model_type: str
    config_class: str  # in `transformers`
    examples: str  # checkpoints of this type, for the README
    attention: str  # "full", "sliding" or "hybrid" in the tiny model (as in the real checkpoints)
    fused: bool  # whether every decoder layer gets the fused CPU forward
    why_not_fused: str = ""  # the reason, when `fused` is False
    config: dict = field(default_factory=dict)


_SLIDING = dict(sliding_window=WINDOW)
_HYBRID = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_NOT_LLAMA_SHAPED = "layer structure differs from Llama's"

MATRIX: list[Arch] = [
    Arch("llama", "LlamaConfig", "Llama 3.x, SmolLM2", "full", True),
    Arch("mistral", "MistralConfig", "Mistral 7B v0.1", "sliding", True, config=_SLIDING),
    Arch("ministral", "MinistralConfig", "Ministral 8B", "hybrid", True, config=dict(head_dim=16, **_HYBRID)),
    Arch("qwen2", "Qwen2Config", "Qwen2.5", "full", True),
    Arch("qwen3", "Qwen3Config", "Qwen3 dense", "full", True, config=dict(head_dim=32)),
    Arch(
        "gemma",
        "GemmaConfig",
        "Gemma 1",
        "full",
        False,
        "(1 + weight) RMSNorm and GELU MLP (the probe refuses the layer)",
        dict(head_dim=16),
    ),
    Arch(
        "gemma2",
        "Gemma2Config",
        "Gemma 2",
        "hybrid",
        False,
        f"{_NOT_LLAMA_SHAPED} (four norms); attention soft-capping runs on the torch attention path",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            initializer_range=0.3,
        ),
    ),  # weights large enough that the cap changes the scores
    Arch(
        "gemma3_text",
        "Gemma3TextConfig",
        "Gemma 3 1B / 270M",
        "hybrid",
        False,
        f"{_NOT_LLAMA_SHAPED} (four norms)",
        dict(head_dim=16, **_HYBRID),
    ),
    Arch(
        "gemma3",
        "Gemma3Config",
        "Gemma 3 4B-27B (text only)",
        "hybrid",
        False,
        f"{_NOT_LLAMA_SHAPED} (four norms); the vision tower is dropped at load",
        dict(
            mm_tokens_per_image=4,
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            ),
        ),
    ),
    Arch("phi3", "Phi3Config", "Phi-3, Phi-4-mini", "full", False, f"{_NOT_LLAMA_SHAPED} (packed qkv and gate_up)"),
    Arch("olmo2", "Olmo2Config", "OLMo 2", "full", False, f"{_NOT_LLAMA_SHAPED} (norms after each block)"),
    Arch(
        "granite",
        "GraniteConfig",
        "Granite 3.x",
        "full",
        False,
        "residual and attention multipliers (the probe refuses the layer)",
        dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    ),
    Arch(
        "helium",
        "HeliumConfig",
        "Helium 1",
        "full",
        False,
        "interleaved rotary (the probe refuses the layer)",
        dict(head_dim=16),
    ),
    Arch(
        "smollm3",
        "SmolLM3Config",
        "SmolLM3",
        "full",
        False,
        "NoPE layers have no rotary (the probe refuses them; rotary layers are fused)",
        dict(no_rope_layers=[1, 0]),
    ),
    Arch(
        "starcoder2",
        "Starcoder2Config",
        "StarCoder2",
        "full",
        False,
        f"{_NOT_LLAMA_SHAPED} (LayerNorm, GELU MLP)",
        dict(sliding_window=None),
    ),
    Arch(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3-30B-A3B",
        "full",
        False,
        "mixture-of-experts MLP",
        dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    Arch(
        "mixtral",
        "MixtralConfig",
        "Mixtral 8x7B",
        "full",
        False,
        "mixture-of-experts MLP",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    Arch(
        "olmoe",
        "OlmoeConfig",
        "OLMoE 1B-7B",
        "full",
        False,
        "mixture-of-experts MLP",
        dict(num_experts=8, num_experts_per_tok=2),
    ),
    Arch(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
        "full",
        False,
        "mixture-of-experts MLP with a shared expert",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
]
MOE_TYPES = {"qwen3_moe", "mixtral", "olmoe", "qwen2_moe"}

# Prompts crossing the window and the token budget, two sharing a 40-token prefix (a prefix-cache hit
# where the model has no sliding layers), and lengths of new tokens that outlast the window.
PROMPT_LENGTHS = [1, 6, 23, 45, 70]
MAX_TOKENS = [12, 24, 6, 18, 9, 20, 15]


def _tiny_config(arch: Arch):
    """The type's own config class with the tiny sizes (a multimodal one gets them in its text config)."""
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        num_hidden_layers=2,
    )
    if "vision_config" in arch.config:
        text = dict(common, head_dim=16, **_HYBRID)
        return getattr(transformers, arch.config_class)(text_config=text, **arch.config)
    return getattr(transformers, arch.config_class)(**{**common, **arch.config})


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(19)
    prompts = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]
    shared = prompts[3][:40]
    return prompts + [shared + [5, 6, 7], shared + [8]]


@pytest.fixture(scope="module")
def prompts():
    return _prompts()


@pytest.mark.parametrize("arch", MATRIX, ids=[a.model_type for a in MATRIX])
def test_engine_fast_path_matches_generate_and_plain_forward(arch, tiny_tokenizer, tmp_path, prompts):
    import torch
    from engine_helpers import load_pair, reference_greedy, reference_logprobs

    from cbrun.engine import Engine, EngineConfig, SamplingParams

    directory = save_tiny_model(_tiny_config(arch), tiny_tokenizer, tmp_path)
    engine_model, reference, tokenizer = load_pair(str(directory))
    assert reference.config.model_type == arch.model_type or arch.model_type == "gemma3"  # its text decoder
    expected = [reference_greedy(reference, p, m) for p, m in zip(prompts, MAX_TOKENS)]

    config = EngineConfig(page_size=16, max_batch_tokens=32, max_requests_per_batch=8, num_blocks=64)
    with Engine(engine_model, tokenizer, config) as engine:
        core = engine.core
        assert core.backend.name == "cpu", "the CPU fast path (compiled kernels) did not load"
        fused = len(core.backend.fused_layers)
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0), request_id=f"p{i}")
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))
        ]
        results = {r.request_id: r for r in (engine.get_result(timeout=300) for _ in ids)}
        stats = engine.stats()

    num_layers = engine_model.config.num_hidden_layers
    assert stats.prefix_hit_tokens > 0 or arch.attention != "full", "the shared prefix was not reused"
    assert fused == (num_layers if arch.fused else fused), f"{fused} of {num_layers} layers fused"
    if not arch.fused:
        assert fused < num_layers, "every layer is fused: mark the type fused in MATRIX"
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        result = results[f"p{i}"]
        assert result.error is None, result.error
        assert result.token_ids == want, f"prompt {i} ({len(prompt)} tokens) diverged from model.generate"
        logprobs = reference_logprobs(reference, prompt, result.token_ids)
        assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", [a for a in MATRIX if a.model_type in MOE_TYPES], ids=lambda a: a.model_type)
def test_moe_experts_route_tokens_sorted_by_expert(arch, tiny_tokenizer, tmp_path):
    """transformers' `grouped_mm` experts sort the (token, expert) pairs by expert and run one grouped GEMM;
    its `eager` fallback loops over experts in Python (about 1.5x slower at 32 decode rows, README)."""
    from cbrun.models import load_model

    model, _ = load_model(str(save_tiny_model(_tiny_config(arch), tiny_tokenizer, tmp_path)), dtype="float32")

    assert model.config._experts_implementation == "grouped_mm"


def test_multimodal_gemma3_keeps_the_logits_of_its_text_decoder(tiny_tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from cbrun.models import load_model

    arch = next(a for a in MATRIX if a.model_type == "gemma3")
    directory = save_tiny_model(_tiny_config(arch), tiny_tokenizer, tmp_path)
    text_model, _ = load_model(str(directory), dtype="float32")
    full = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])

    assert type(text_model).__name__ == "Gemma3ForCausalLM" and type(full).__name__ != "Gemma3ForCausalLM"
    assert not any(p.is_meta for p in text_model.parameters())
    with torch.no_grad():
        assert torch.equal(text_model(ids).logits, full(ids).logits)


def test_matrix_covers_exactly_the_supported_types():
    from cbrun.models import SUPPORTED_MODEL_TYPES, UNSUPPORTED_REASONS

    assert {a.model_type for a in MATRIX} == SUPPORTED_MODEL_TYPES
    assert not SUPPORTED_MODEL_TYPES & set(UNSUPPORTED_REASONS)


@pytest.mark.parametrize("config_class,model_type", [("GptOssConfig", "gpt_oss"), ("DeepseekV3Config", "deepseek_v3")])
def test_known_unsupported_type_is_refused_at_load_with_its_reason(tmp_path, config_class, model_type):
    import transformers

    from cbrun.models import UNSUPPORTED_REASONS, ModelLoadError, load_model

    getattr(transformers, config_class)(num_hidden_layers=1).save_pretrained(tmp_path)  # no weights needed

    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))

    assert UNSUPPORTED_REASONS[model_type] in str(info.value) and "\n" not in str(info.value)


def matrix_table() -> str:
    """The README's markdown table, generated from MATRIX."""
    rows = ["| model type | e.g. | attention | fused CPU decoder layers |", "|---|---|---|---|"]
    for arch in MATRIX:
        fused = "yes" if arch.fused else f"no: {arch.why_not_fused}"
        rows.append(f"| `{arch.model_type}` | {arch.examples} | {arch.attention} | {fused} |")
    return "\n".join(rows)


def test_readme_table_matches_the_matrix():
    text = README.read_text()
    assert TABLE_START in text and TABLE_END in text, "README has no model-matrix markers"
    current = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert current == matrix_table(), "README's model table is stale: run `python tests/models/test_model_matrix.py`"


if __name__ == "__main__":
    print(matrix_table())
