"""A trainer's PEFT LoRA model as the engine sees it: the base model's plain layers and one adapter.

PEFT wraps each adapted linear of the base model in a `lora.Linear` that
holds the original as `base_layer` beside `lora_A` / `lora_B`. The engine's
CPU backend reads plain transformers layers, and a rollout engine holds the
adapter apart from the base (cbrun/lora/): requests name it, the base is
never merged. So the trainer's exact forward is taken the same way:

- `base_view` gives the base model with plain linears whose parameters and
  buffers are the PEFT model's own tensors (built on the meta device and
  pointed at them: no copy of the weights);
- `active_adapter` gives the PEFT model's current A and B and its config
  exactly as `LLM.update_lora(name, get_peft_model_state_dict(model),
  config=...)` hands them to a rollout engine, so both hold the same fp32
  A and scaled B, rounded once, in the same way.

What the engine cannot apply (DoRA, trained biases, `modules_to_save`,
several active adapters, merged adapters) is refused here by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from cbrun.engine.model_spec import CausalLM
from cbrun.lora.peft_files import AdapterConfig, AdapterError, AdapterWeights, pairs_of

_BASE_LAYER = ".base_layer"


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a PEFT model (get_peft_model's or PeftModel.from_pretrained's)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def active_adapter(model: Any) -> AdapterWeights:
    """The PEFT model's one active LoRA adapter: its current A and B per module (the live tensors, detached) and
    the config fields the engine reads, as update_lora takes them from a PEFT state dict and config."""
    from peft import get_peft_model_state_dict

    names = list(getattr(model, "active_adapters", [model.active_adapter]))
    if len(names) != 1:
        raise AdapterError(f"the PEFT model has {len(names)} active adapters ({names}); the engine applies one")
    name = names[0]
    where = f"PEFT adapter {name!r}"
    merged = [n for n, m in model.named_modules() if getattr(m, "merged_adapters", None)]
    if merged:
        raise AdapterError(f"{where} is merged into {merged[0]} (unmerge it: the engine keeps adapters apart)")
    config = AdapterConfig.from_dict(model.peft_config[name].to_dict(), where)
    state = get_peft_model_state_dict(model, adapter_name=name)
    return AdapterWeights(config, pairs_of({k: v.detach() for k, v in state.items()}, where))


def base_view(model: Any) -> CausalLM:
    """The PEFT model's base model with plain transformers layers, holding the PEFT model's own parameter and
    buffer tensors (the same objects: what the trainer changes, this sees); nothing is copied."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in [*base.named_parameters(remove_duplicate=False), *base.named_buffers(remove_duplicate=False)]:
        if ".lora_" in name:
            continue
        tensors[name.replace(_BASE_LAYER, "")] = tensor
    dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    with torch.device("meta"):  # its own config: the engine switches the attention on it
        view = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=dtype)
    slots = [
        *((n, "_parameters") for n, _ in view.named_parameters(remove_duplicate=False)),
        *((n, "_buffers") for n, _ in view.named_buffers(remove_duplicate=False)),
    ]
    for name, kind in slots:
        if name not in tensors:
            raise AdapterError(f"the PEFT model's base has no tensor for {name} (a layer PEFT replaced whole?)")
        owner, _, leaf = name.rpartition(".")
        getattr(view.get_submodule(owner), kind)[leaf] = tensors[name]
    view.eval()
    return view
