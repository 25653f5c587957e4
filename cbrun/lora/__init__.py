"""LoRA adapters: requests name one (`LoRARequest`), the engine applies it row by row (adapters.py).

Only the request type is imported here, so that code naming an adapter does not load the engine.
"""

from cbrun.lora.request import LoRARequest

__all__ = ["LoRARequest"]
