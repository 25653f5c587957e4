"""The trainer's forward with a PEFT LoRA adapter gives the rollout's bits (issue 48, item 2).

A PEFT LoRA model wrapped in `ExactLogprobs` must give, bit for bit, what an
engine holding the same adapter (update_lora from get_peft_model_state_dict)
recorded when it sampled, in fp32 and bf16, and after an optimizer step on
the adapter; the gradients must reach A and B and only them.
"""

from __future__ import annotations

import pytest
import torch

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.lora.peft_files import AdapterError
from cbrun.models import load_model
from cbrun.training import ExactLogprobs

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")

PROMPTS = [[1] + list(range(40, 40 + n)) for n in (40, 3, 21)]
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def policy(model_dir, dtype: str, rank: int = 8, **extra):
    """A PEFT LoRA model on every projection, B drawn at random (PEFT starts it at zero: no delta to check)."""
    model, _ = load_model(str(model_dir), dtype=dtype)
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, **extra)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return wrapped


def adapter_of(wrapped) -> tuple[dict, dict]:
    """What a rollout engine is given: update_lora's state dict and config."""
    return peft.get_peft_model_state_dict(wrapped), wrapped.peft_config["default"].to_dict()


def sample(model_dir, dtype: str, wrapped) -> list[tuple[list[int], list[float]]]:
    """The engine's sampled (token ids, logprobs) of PROMPTS, every request on the adapter."""
    model, tokenizer = load_model(str(model_dir), dtype=dtype)
    with Engine(model, tokenizer, EngineConfig(enable_lora=True, max_lora_rank=8)) as engine:
        state, config = adapter_of(wrapped)
        engine.loras.add("policy", state, config=config)
        ids = [engine.add_request(p, SAMPLED, request_id=f"r{i}", lora="policy") for i, p in enumerate(PROMPTS)]
        done = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in ids)}
    return [(done[i].token_ids, done[i].logprobs) for i in ids]


def batch(generated) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """prompt + completion rows right-padded in one [B, L] batch, and where each completion starts."""
    rows = [prompt + tokens for prompt, (tokens, _) in zip(PROMPTS, generated)]
    ids = torch.zeros(len(rows), max(map(len, rows)) + 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    return ids, mask, [len(p) for p in PROMPTS]


def completions(logprobs: torch.Tensor, generated, starts: list[int]) -> list[list[float]]:
    return [logprobs[b, s : s + len(tokens)].tolist() for b, (s, (tokens, _)) in enumerate(zip(starts, generated))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lora_trainer_logprobs_equal_the_rollouts_bitwise_and_follow_its_optimizer(name, dtype, request):
    model_dir = request.getfixturevalue(f"tiny_{name}_dir")
    wrapped = policy(model_dir, dtype)
    wrapped.train()
    exact = ExactLogprobs(wrapped, dtype)
    generated = sample(model_dir, dtype, wrapped)
    ids, mask, starts = batch(generated)
    out = exact(ids, mask)
    assert completions(out.logprobs, generated, starts) == [lp for _, lp in generated]  # on-policy: ratio 1
    (-out.logprobs.sum()).backward()
    grads = {n: p.grad for n, p in wrapped.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)  # the adapter learns; the base stays frozen
    assert all(g.abs().max() > 0 for n, g in grads.items() if "lora_A" in n)  # B is non-zero: A gets gradients
    torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.05).step()
    resampled = sample(model_dir, dtype, wrapped)  # an engine given the stepped adapter
    ids, mask, starts = batch(resampled)
    with torch.no_grad():
        after = exact(ids, mask).logprobs
    assert completions(after, resampled, starts) == [lp for _, lp in resampled]
    assert resampled != generated  # the stepped adapter was read again on both sides
    assert not out.logprobs.isnan().any() and wrapped.training  # the caller's mode is given back


def test_fp32_master_lora_gives_a_bf16_engines_bits(tiny_llama_dir):
    """An fp32 PEFT model trained for a bf16 engine: the base rounded to bf16 as update_weights rounds it, the
    adapter held in fp32 on both sides."""
    wrapped = policy(tiny_llama_dir, "float32")
    exact = ExactLogprobs(wrapped, "bfloat16")
    generated = sample(tiny_llama_dir, "bfloat16", wrapped)
    ids, mask, starts = batch(generated)
    with torch.no_grad():
        out = exact(ids, mask).logprobs
    assert completions(out, generated, starts) == [lp for _, lp in generated]


def test_the_adapter_counts_and_the_base_view_shares_the_peft_models_tensors(tiny_llama_dir):
    wrapped = policy(tiny_llama_dir, "float32")
    base, _ = load_model(str(tiny_llama_dir), dtype="float32")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        adapted = ExactLogprobs(wrapped)(ids).logprobs
        plain = ExactLogprobs(base)(ids).logprobs
    assert not torch.equal(adapted, plain)  # the adapter counts; the view shares the base's tensors
    assert all(
        theirs is mine
        for (_, theirs), (_, mine) in zip(
            ExactLogprobs(wrapped).engine.model.named_parameters(),
            ((n, p) for n, p in wrapped.get_base_model().named_parameters() if ".lora_" not in n),
        )
    )


def test_what_the_engine_cannot_apply_is_refused_by_name(tiny_llama_dir):
    dora = policy(tiny_llama_dir, "float32", use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"), torch.no_grad():
        ExactLogprobs(dora)(torch.tensor([PROMPTS[1]]))
    wide = policy(tiny_llama_dir, "float32", rank=600)
    with pytest.raises(AdapterError, match="rank 600"), torch.no_grad():
        ExactLogprobs(wide)(torch.tensor([PROMPTS[1]]))
