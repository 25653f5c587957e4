"""`LoRARequest`: which adapter a request runs with, by vLLM's names and types.

    LoRARequest("sql", 1, "/adapters/sql")     # lora_name, lora_int_id, lora_path

A request names its adapter; the engine loads the adapter from `lora_path`
the first time a request names it (or `llm.add_lora` / `update_lora` loaded
it before, from a file or from tensors in memory) and keeps it for the
engine's life. Names are the key: two requests with the same name run the
same adapter, and one name cannot mean two ids.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and positive integer id, with the PEFT directory it is read from ("" when it was
    given as tensors, `update_lora`). `load_inplace`: read it from `lora_path` again even if an adapter of
    this name is loaded (vLLM's flag), replacing it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest: lora_path must be a string, got {type(self.lora_path).__name__}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
