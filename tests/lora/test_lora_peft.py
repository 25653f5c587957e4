"""Adapters saved by PEFT itself load and compute what PEFT computes (its scaling rules included)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts

from cbrun.engine import Engine, EngineConfig
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

peft = pytest.importorskip("peft")
needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")

VARIANTS = {
    "plain": {"r": 8, "lora_alpha": 16},
    "rslora and patterns": {
        "r": 8,
        "lora_alpha": 12,
        "use_rslora": True,
        "rank_pattern": {"v_proj": 4},
        "alpha_pattern": {"down_proj": 3},
    },
}


@needs_kernels
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_peft_saved_adapter_gives_peft_models_logprobs(tiny_llama_dir, tmp_path, variant):
    base, _ = load_model(str(tiny_llama_dir), dtype="float32")
    config = peft.LoraConfig(
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random B: an adapter that changes the output
        **VARIANTS[variant],
    )
    torch.manual_seed(0)
    reference = peft.get_peft_model(base, config).eval()
    reference.save_pretrained(tmp_path)
    prompts = random_prompts(base.config.vocab_size, [11, 26], seed=2)
    completions = random_prompts(base.config.vocab_size, [9, 9], seed=3)
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    with Engine(model, tokenizer, EngineConfig(lora_modules=(("tuned", str(tmp_path)),), num_blocks=128)) as engine:
        for prompt, completion in zip(prompts, completions):
            rid = engine.add_score_request(prompt, [completion], lora="tuned")
            got = torch.tensor(engine.get_result(rid, timeout=300).logprobs)
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
            with torch.no_grad(), reference.disable_adapter():
                plain = reference(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            assert not torch.allclose(torch.log_softmax(plain.float(), -1), torch.log_softmax(logits.float(), -1))
