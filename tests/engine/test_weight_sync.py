"""Weight sync from an in-process trainer (issue 34, item 5): `update_weights` takes what it can share and
packs only what it is given, once.

A trainer's `state_dict()` holds its parameters' own memory. Where the engine can read a tensor as it is
(same dtype, device and contiguous layout: fp32 weights for an fp32 engine, norms and embeddings in the
engine's dtype) it takes it instead of copying it; bf16 linear weights are packed straight from the given
tensor, and a tied weight named twice is packed once. Every result is compared bitwise with a fresh engine
loaded with the same weights.
"""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_model

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")

PROMPTS = [[1, *range(40, 40 + n)] for n in (37, 9, 20)]
CONFIG = EngineConfig(num_blocks=32, backend="cpu")


@pytest.fixture(scope="module")
def qwen2_tied_dir(tmp_path_factory, tiny_tokenizer):
    """Qwen2 (q/k/v biases) with tied embeddings: embed_tokens.weight and lm_head.weight are one tensor."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("qwen2-tied-sync"))


def outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    return [(r.token_ids, r.logprobs) for r in engine.generate_batch(PROMPTS, params)]


def fresh_outputs(model_dir, dtype: str, state: dict[str, torch.Tensor]) -> list:
    """What a fresh engine on a model holding `state` gives."""
    model, tokenizer = load_model(str(model_dir), dtype=dtype)
    model.load_state_dict({name: t.clone() for name, t in state.items()})
    with Engine(model, tokenizer, CONFIG) as engine:
        return outputs(engine)


def step_in_place(model: torch.nn.Module, seed: int) -> None:
    """Change every parameter in place, as an optimizer step does (its memory stays the model's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))


def test_an_fp32_update_takes_the_trainers_tensors_instead_of_copying_them(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    trainer, _ = load_model(str(tiny_llama_dir), dtype="float32")
    step_in_place(trainer, 1)
    state = trainer.state_dict()
    with Engine(model, tokenizer, CONFIG) as engine:
        assert engine.update_weights(state) == len(state)
        engine_tensors = engine.core.model.state_dict()
        for name, tensor in state.items():  # the engine reads the trainer's memory: nothing was copied
            assert engine_tensors[name].data_ptr() == tensor.data_ptr(), name
        first = outputs(engine)
        step_in_place(trainer, 2)  # the trainer steps; the engine syncs again, with nothing to copy
        engine.update_weights(state)
        second = outputs(engine)
    assert first != second
    assert second == fresh_outputs(tiny_llama_dir, "float32", trainer.state_dict())


def test_a_bf16_update_packs_the_linears_once_and_shares_the_rest(qwen2_tied_dir, monkeypatch):
    model, tokenizer = load_model(str(qwen2_tied_dir), dtype="bfloat16")
    trainer, _ = load_model(str(qwen2_tied_dir), dtype="bfloat16")
    step_in_place(trainer, 3)
    state = trainer.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied: one tensor
    with Engine(model, tokenizer, CONFIG) as engine:
        packed = []
        pack = type(engine.core.backend.kernels.dp).pack_into
        monkeypatch.setattr(
            type(engine.core.backend.kernels.dp),
            "pack_into",
            lambda self, packs, inner, weight, *args: (
                packed.append(weight.shape) or pack(self, packs, inner, weight, *args)
            ),
        )
        engine.update_weights(state)
        linears = [m for m in trainer.modules() if type(m) is torch.nn.Linear]
        assert len(packed) == len(linears)  # each linear's weight packed once; the tied table once, not twice
        engine_tensors = engine.core.model.state_dict()
        norm = "model.layers.1.post_attention_layernorm.weight"
        assert engine_tensors[norm].data_ptr() == state[norm].data_ptr()  # a norm in the engine's dtype: shared
        updated = outputs(engine)
    assert updated == fresh_outputs(qwen2_tied_dir, "bfloat16", state)


def test_tensors_in_another_dtype_are_copied_and_the_callers_later_changes_do_not_reach_the_engine(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    trainer, _ = load_model(str(tiny_llama_dir), dtype="float32")
    step_in_place(trainer, 4)
    halves = {name: t.to(torch.bfloat16) for name, t in trainer.state_dict().items()}
    expected = {name: t.float() for name, t in halves.items()}
    with Engine(model, tokenizer, CONFIG) as engine:
        engine.update_weights(halves)
        updated = outputs(engine)
        for tensor in halves.values():
            tensor.zero_()  # the caller's tensors, not the engine's
        assert outputs(engine) == updated
    assert updated == fresh_outputs(tiny_llama_dir, "float32", expected)
