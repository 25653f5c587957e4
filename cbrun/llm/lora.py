"""`LLM`'s LoRA adapters by vLLM's names: `lora_request=` on generate and chat, add/remove/list, update in place.

A `LoRARequest(name, id, path)` is loaded from its PEFT directory the first
time a request names it and kept (vLLM loads lazily too); later requests that
name it run it at once. The engine knows adapters by name, so a name keeps
the id it was first given: naming it with another id is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbrun.engine import Engine
from cbrun.lora.request import LoRARequest


class LLMAdapters:
    """Resolves `lora_request` arguments to the engine's adapter names, loading adapters on first use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def per_prompt(self, lora_request: Any, count: int) -> list[LoRARequest | None]:
        """One LoRARequest (or None) per prompt from a single request, a list with one per prompt, or None;
        every adapter named is loaded before this returns."""
        if lora_request is None:
            return [None] * count
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"lora_request: {len(requests)} given for {count} prompts (one, or one per prompt)")
        for request in requests:
            if request is not None and not isinstance(request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest (or a list of them), got {type(request).__name__}")
        for request in {r.lora_name: r for r in requests if r is not None}.values():
            self.ensure(request)
        return requests

    def ensure(self, request: LoRARequest) -> None:
        """Load `request`'s adapter unless it is loaded (under the same id) already; load_inplace reloads it."""
        loaded = self.engine.loras.list()
        held = loaded.get(request.lora_name)
        if held is not None and not request.load_inplace:
            if held != request.lora_int_id:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} is loaded with id {held}, not {request.lora_int_id}"
                )
            return
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and its LoRARequest has no lora_path")
        self.engine.loras.add(request.lora_name, request.lora_path, request.lora_int_id)

    def remove(self, lora_id: int) -> bool:
        """vLLM's remove_lora(lora_id): drop the adapter with this id; False if none has it."""
        name = next((n for n, i in self.engine.loras.list().items() if i == lora_id), None)
        return name is not None and self.engine.loras.remove(name)

    def update(
        self,
        name: str,
        state_dict: Mapping[str, torch.Tensor],
        config: Mapping[str, Any] | None,
        lora_int_id: int | None,
        pause_mode: str | None,
    ) -> None:
        """Replace adapter `name`'s weights in place; one not loaded yet is added from the tensors, which then
        needs `config` (adapter_config fields: lora_alpha at least)."""
        if name in self.engine.loras.list():
            self.engine.loras.update(name, state_dict, pause_mode)
            return
        if config is None:
            raise ValueError(f"update_lora: no adapter {name!r} is loaded; pass config= (lora_alpha) to add it")
        self.engine.loras.add(name, state_dict, lora_int_id, config)


def names(requests: Sequence[LoRARequest | None]) -> list[str | None]:
    return [r.lora_name if r is not None else None for r in requests]
