"""Adapters for the LoRA tests: random A and B on a model's linears, as PEFT tensors, directories or merges."""

from __future__ import annotations

from pathlib import Path

import torch

from cbrun.lora.peft_files import AdapterConfig, AdapterWeights, write_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALPHA = 16.0


def random_pairs(model, seed: int, rank: int = 8, targets=TARGETS, zero_b: bool = False, scale: float = 0.1):
    """Module name -> (A [r, in], B [out, r]) fp32 for every linear of `model` named in `targets`."""
    gen = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=gen) * scale
            b = (
                torch.zeros(module.out_features, rank)
                if zero_b
                else torch.randn(module.out_features, rank, generator=gen)
            )
            pairs[name] = (a, b * scale)
    return pairs


def state_dict(pairs) -> dict[str, torch.Tensor]:
    """PEFT's keys (get_peft_model_state_dict's) for module name -> (A, B)."""
    out = {}
    for name, (a, b) in pairs.items():
        out[f"base_model.model.{name}.lora_A.weight"] = a
        out[f"base_model.model.{name}.lora_B.weight"] = b
    return out


def save(directory: Path, pairs, alpha: float = ALPHA) -> Path:
    rank = next(iter(pairs.values()))[0].shape[0]
    write_adapter(directory, AdapterWeights(AdapterConfig(alpha), pairs), rank, sorted(TARGETS))
    return directory


def merged_weights(model, pairs, alpha: float = ALPHA) -> dict[str, torch.Tensor]:
    """The adapted linears' weights with B @ A merged in (fp32 sums, rounded once to the model's dtype)."""
    out = {}
    for name, (a, b) in pairs.items():
        weight = model.get_submodule(name).weight.detach()
        scaling = alpha / a.shape[0]
        out[f"{name}.weight"] = (weight.float() + scaling * (b @ a)).to(weight.dtype)
    return out
