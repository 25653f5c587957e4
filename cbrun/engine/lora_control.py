"""An engine's LoRA adapters from the caller's side: load, replace, update in place, remove, list.

`engine.loras` (and vLLM's names on `LLM`: add_lora, update_lora, remove_lora,
list_loras). Files are read in the caller's thread; every change of what the
engine holds runs on its loop thread between steps, so a step never sees an
adapter half loaded. The arithmetic is cbrun/lora/.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cbrun.engine.core import EngineCore
from cbrun.engine.core_loop import CoreLoop
from cbrun.lora.adapters import LoRAAdapters
from cbrun.lora.peft_files import AdapterConfig, AdapterError, AdapterWeights, pairs_of, read_adapter

WhileIdle = Callable[[str, Callable[[], Any], str | None], Any]  # Engine._while_idle: (action, change, pause_mode)
AdapterSource = str | os.PathLike[str] | Mapping[str, torch.Tensor]


class LoRAControl:
    """What callers may do to an engine's adapters (engines started with enable_lora)."""

    def __init__(self, core: EngineCore, loop: CoreLoop, while_idle: WhileIdle) -> None:
        self._core, self._loop, self._while_idle = core, loop, while_idle

    def add(
        self,
        name: str,
        source: AdapterSource,
        lora_int_id: int | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> int:
        """Load adapter `name` from a PEFT directory, or from a PEFT state dict in memory with `config` (its
        adapter_config fields: lora_alpha at least); returns its id. An adapter of that name is replaced, only
        while no live request runs it."""
        adapters = self._adapters()
        if isinstance(source, Mapping):
            if config is None:
                raise AdapterError(f"LoRA adapter {name!r}: tensors need config= (adapter_config fields: lora_alpha)")
            weights = AdapterWeights(AdapterConfig.from_dict(config), pairs_of(source, f"LoRA adapter {name!r}"))
            path = ""
        else:
            weights, path = read_adapter(source), str(source)

        def load() -> int:
            if name in adapters.adapters:
                self._refuse_in_use(name, "replace")
            return adapters.load(name, weights, lora_int_id, path).lora_int_id

        return self._loop.call(load)

    def add_at_start(self, modules: Sequence[tuple[str, str]], give_up: Callable[[], None]) -> None:
        """The config's lora_modules (name, path); one that does not load ends the engine (`give_up`: its loop
        thread stopped, its memory freed) and raises."""
        try:
            for name, path in modules:
                self.add(name, path)
        except BaseException:
            give_up()
            raise

    def update(self, name: str, state_dict: Mapping[str, torch.Tensor], pause_mode: str | None = None) -> None:
        """Replace loaded adapter `name`'s A and B in place from a PEFT state dict (get_peft_model_state_dict's
        keys), no file: the linears named change, the rest stay. As update_weights: between batches or paused;
        with `pause_mode` it pauses, updates and resumes, and requests a "keep" pause holds are computed again
        under the new adapter. Prefixes cached under the old one never match again."""
        pairs = pairs_of(state_dict, f"update_lora({name!r})")
        adapters = self._adapters()
        core = self._core

        def update() -> None:
            core.scheduler.recompute_all()
            adapters.update(name, pairs)
            for request in core.live_requests():
                if request.lora == name:
                    request.cache_salt = adapters.salt(name)

        self._while_idle("update a LoRA adapter", update, pause_mode)

    def remove(self, name: str) -> bool:
        """Drop adapter `name` (not while a live request runs it); False if none was loaded."""
        adapters = self._adapters()

        def remove() -> bool:
            self._refuse_in_use(name, "remove")
            return adapters.remove(name)

        return self._loop.call(remove)

    def list(self) -> dict[str, int]:
        """The loaded adapters: name -> id."""
        adapters = self._core.adapters
        return {} if adapters is None else {a.name: a.lora_int_id for a in list(adapters.adapters.values())}

    def _refuse_in_use(self, name: str, action: str) -> None:
        if any(request.lora == name for request in self._core.live_requests()):
            raise AdapterError(f"cannot {action} LoRA adapter {name!r}: live requests run it (pause or wait first)")

    def _adapters(self) -> LoRAAdapters:
        if self._core.adapters is None:
            raise AdapterError("LoRA is not enabled: start the engine with enable_lora=True")
        return self._core.adapters
