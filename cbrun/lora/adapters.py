"""The engine's LoRA adapters: loaded once, held in fp32, applied row by row to the requests that name them.

Each adapted linear of an adapter keeps A [r, K] and scaling * B [N, r] (and
its transpose, which the CPU's grouped call reads) in fp32 and computes
`(scaling * B)(A(x))` in fp32 (on CPU one compiled call for every adapter of
a step, lora.c; elsewhere torch), whatever the model's dtype: PEFT also keeps adapters in fp32 over bf16
models. The delta of a row depends on that row alone (lora/step.py).

The base model is untouched: adapters are not merged, so any number of them
run in one step, and requests without one compute exactly what an engine
without adapters computes. Linears are reached two ways: the CPU backend's
fused decoder layers call the step's StepLoRA themselves; every other
adapted linear gets a forward hook that adds the delta to its output.
Hooks live on the module (not its `forward`), so backends re-routing
forwards (sleep and wake) do not disturb them.

A request's prefix-cache pages hold K/V computed under its adapter, so its
hash chain starts from the adapter's salt, which names the adapter and
changes whenever its weights do: pages cached under old weights never match
again and age out of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cbrun.lora.peft_files import AdapterConfig, AdapterError, AdapterWeights
from cbrun.lora.step import GroupedDeltas, StepLoRA

Linear = Callable[[torch.Tensor], torch.Tensor]  # fp32 x [n, K] -> fp32 [n, N]


@dataclass
class AdapterLinear:
    """One adapted linear: A and B (fp32, held here; B with the scaling folded in) as callables of the backend's
    arithmetic."""

    a: torch.Tensor  # [r, K] fp32
    b: torch.Tensor  # [N, r] fp32, times the scaling
    through_a: Linear
    through_b: Linear
    bt: torch.Tensor  # [r, N] fp32: b transposed, as the grouped call reads it

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] -> (scaling * B)(A(x)) [n, N] fp32."""
        return self.through_b(self.through_a(x.float()))


@dataclass
class LoadedAdapter:
    """An adapter the engine holds: its vLLM name and id, where it came from, and its linears by module."""

    name: str
    lora_int_id: int
    path: str
    config: AdapterConfig
    linears: dict[torch.nn.Module, AdapterLinear] = field(default_factory=dict)
    salt: bytes = b""  # the root of its requests' prefix-cache hash chains (new with every change of weights)


class LoRAAdapters:
    """Every adapter of one engine, by name. Changed only on the engine's loop thread, between steps.

    linear_for(weight): the backend's fp32 arithmetic for a weight [N, K] held in place; the torch default
    is F.linear. grouped: the backend's one-call arithmetic for every adapter of a step (lora/step.py), if any.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_rank: int,
        max_loras: int | None = None,
        linear_for: Callable[[torch.Tensor], Linear] | None = None,
        grouped: GroupedDeltas | None = None,
    ) -> None:
        self.model = model
        self.grouped = grouped
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.linear_for = linear_for or _torch_linear
        self.adapters: dict[str, LoadedAdapter] = {}
        self._changes = 0  # loads and updates so far: each gives an adapter a salt never used before
        self._active: StepLoRA | None = None  # the step being computed (for the hooks)
        self._hooks: dict[torch.nn.Module, Any] = {}  # module -> its forward hook's handle
        # the grouped call's packed operands, by the step's adapters in order, then member set; any change clears it
        self._packed: dict[tuple[str, ...], dict[tuple[torch.nn.Module, ...], Any]] = {}
        output_head = getattr(model, "get_output_embeddings", None)
        self._head = output_head() if callable(output_head) else None

    @classmethod
    def serving(cls, model: torch.nn.Module, backend: object, config: Any) -> LoRAAdapters:
        """The adapters of an engine (its EngineConfig's max_lora_rank and max_loras) over its backend's fp32
        linear arithmetic (and its grouped LoRA call, where it has one)."""
        grouped = getattr(getattr(backend, "kernels", None), "lora", None)
        if grouped is not None and config.max_lora_rank > grouped.max_rank:
            grouped = None  # ranks over the compiled call's: each adapter through the fp32 linear
        return cls(model, config.max_lora_rank, config.max_loras, fp32_linear_of(backend), grouped)

    # -- loading ------------------------------------------------------------------------
    def load(self, name: str, weights: AdapterWeights, lora_int_id: int | None = None, path: str = "") -> LoadedAdapter:
        """Hold adapter `name` (replacing one of that name); its linears checked against the model first."""
        if lora_int_id is not None:
            clash = next((a for a in self.adapters.values() if a.lora_int_id == lora_int_id and a.name != name), None)
            if clash is not None:
                raise AdapterError(f"LoRA id {lora_int_id} is adapter {clash.name!r} already, not {name!r}")
        if name not in self.adapters and self.max_loras is not None and len(self.adapters) >= self.max_loras:
            raise AdapterError(
                f"cannot load LoRA adapter {name!r}: {len(self.adapters)} are loaded and max_loras is {self.max_loras}"
                " (remove_lora one, or raise max_loras)"
            )
        self.check_shapes(name, weights.pairs)
        adapter = LoadedAdapter(
            name,
            lora_int_id if lora_int_id is not None else self._next_id(name),
            path,
            weights.config,
            {
                self._module(name, module): self._linear(a, b, weights.config.scaling(module, a.shape[0]))
                for module, (a, b) in weights.pairs.items()
            },
        )
        adapter.salt = self._new_salt(name)
        self.adapters[name] = adapter
        self._packed.clear()
        self._sync_hooks()
        return adapter

    def update(self, name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace adapter `name`'s A and B for the modules named in `pairs` (the rest stay; all checked before
        any is replaced); each keeps its alpha, so a new rank rescales as PEFT would (alpha / r)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
        self.check_shapes(name, pairs)
        updates: dict[torch.nn.Module, AdapterLinear] = {}
        for module_name, (a, b) in pairs.items():
            module = self._module(name, module_name)
            old = adapter.linears.get(module)
            if old is None:
                raise AdapterError(f"LoRA adapter {name!r} does not adapt {module_name} (it cannot gain a linear)")
            updates[module] = self._linear(a, b, adapter.config.scaling(module_name, a.shape[0]))
        adapter.linears.update(updates)
        adapter.salt = self._new_salt(name)
        self._packed.clear()

    def salt(self, name: str | None) -> bytes | None:
        """The prefix-cache salt of requests running adapter `name` (None for the base model)."""
        return None if name is None else self.adapters[name].salt

    def _new_salt(self, name: str) -> bytes:
        self._changes += 1
        return b"lora\0" + name.encode() + b"\0" + str(self._changes).encode()

    def remove(self, name: str) -> bool:
        removed = self.adapters.pop(name, None) is not None
        self._packed.clear()
        self._sync_hooks()
        return removed

    def close(self) -> None:
        """Take every hook off the model and drop the adapters."""
        self.adapters.clear()
        self._packed.clear()
        self._sync_hooks()

    def _next_id(self, name: str) -> int:
        held = self.adapters.get(name)
        if held is not None:
            return held.lora_int_id
        return max((a.lora_int_id for a in self.adapters.values()), default=0) + 1

    def _module(self, adapter: str, module_name: str) -> torch.nn.Linear:
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            raise AdapterError(f"LoRA adapter {adapter!r}: the model has no module {module_name!r}") from None
        if not isinstance(module, torch.nn.Linear):
            raise AdapterError(
                f"LoRA adapter {adapter!r}: {module_name} is a {type(module).__name__}; "
                "only linear layers can be adapted"
            )
        if module is self._head:
            raise AdapterError(f"LoRA adapter {adapter!r}: adapting the output head ({module_name}) is not supported")
        return module

    def _linear(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> AdapterLinear:
        a32 = a.detach().to(a.device, torch.float32).contiguous()
        scaled = (b.detach().to(a32.device, torch.float32) * scaling).contiguous()  # one rounding, at load
        return AdapterLinear(a32, scaled, self.linear_for(a32), self.linear_for(scaled), scaled.t().contiguous())

    def check_shapes(self, name: str, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Raise AdapterError unless every pair fits its module (A [r, in], B [out, r]) and r <= max_rank."""
        for module_name, (a, b) in pairs.items():
            module = self._module(name, module_name)
            rank = a.shape[0]
            if rank > self.max_rank:
                raise AdapterError(
                    f"LoRA adapter {name!r}: {module_name} has rank {rank}, over max_lora_rank {self.max_rank}"
                )
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                raise AdapterError(
                    f"LoRA adapter {name!r}: {module_name} is [{module.out_features}, {module.in_features}] but the "
                    f"adapter has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}"
                )

    # -- steps ----------------------------------------------------------------------------
    def step(self, rows: Mapping[str, Sequence[int]], num_tokens: int) -> StepLoRA | None:
        """The step's StepLoRA from each adapter's token rows (None when no row runs an adapter)."""
        names = tuple(name for name, indices in rows.items() if indices and self.adapters[name].linears)
        if not names:
            return None
        groups = [(self.adapters[name], torch.tensor(list(rows[name]), dtype=torch.long)) for name in names]
        packed = self._packed.setdefault(names, {}) if self.grouped is not None else None
        return StepLoRA(groups, num_tokens, self.grouped, packed)

    @contextmanager
    def active(self, step: StepLoRA | None):  # type: ignore[no-untyped-def]
        """The hooks apply `step` while the model's forward runs inside this block."""
        self._active = step
        try:
            yield
        finally:
            self._active = None

    def _sync_hooks(self) -> None:
        """A forward hook on exactly the modules some adapter adapts."""
        wanted = {module for adapter in self.adapters.values() for module in adapter.linears}
        for module in list(self._hooks):
            if module not in wanted:
                self._hooks.pop(module).remove()
        for module in wanted - set(self._hooks):
            self._hooks[module] = module.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        step = self._active
        if step is None or not step.adapts(module):
            return output
        x = args[0].reshape(-1, args[0].shape[-1])  # [T, K]
        y = output.reshape(-1, output.shape[-1])  # [T, N] (a view of output)
        step.add(module, x, y)
        return output


def fp32_linear_of(backend: object) -> Callable[[torch.Tensor], Linear]:
    """The backend's fp32 linear over a weight read in place: the CPU backend's compiled kernel (one order of
    sums for any number of rows, the f32 method's arithmetic), else torch's F.linear."""
    kernels = getattr(backend, "kernels", None)
    linear = getattr(kernels, "linear", None)
    if linear is None:
        return _torch_linear

    def make(weight: torch.Tensor) -> Linear:
        if weight.device.type != "cpu":
            return _torch_linear(weight)
        return lambda x: linear(x, weight)  # x [n, K] fp32 -> [n, N] fp32

    return make


def _torch_linear(weight: torch.Tensor) -> Linear:
    return lambda x: F.linear(x, weight)
