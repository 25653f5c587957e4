"""PEFT LoRA adapters as tensors: a saved adapter directory, or a PEFT state dict in memory.

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, ...) and `adapter_model.safetensors` (or `.bin`) with, per
adapted linear, `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. The adapter adds `scaling * B @ A @ x` to the
linear's output, scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

What cbrun cannot apply is refused here, by name, before anything is loaded:
DoRA (magnitude vectors), trained biases, `modules_to_save` (whole copies of
layers), adapters on embeddings, Conv1D layouts (`fan_in_fan_out`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")  # ".default" or another name


class AdapterError(ValueError):
    """An adapter that cannot be read or applied; the message names the file, key or setting."""


@dataclass(frozen=True)
class AdapterConfig:
    """What of PEFT's LoraConfig the arithmetic needs: alpha (per module where `alpha_pattern` says) and rsLoRA."""

    lora_alpha: float
    use_rslora: bool = False
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def scaling(self, module: str, rank: int) -> float:
        """The factor of module `module`'s B @ A (its rank read from its tensors, so `rank_pattern` needs nothing)."""
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():  # PEFT's rule: the pattern matches the name's end
            if re.match(rf"(.*\.)?{pattern}$", module):
                alpha = float(value)
                break
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @classmethod
    def from_dict(cls, config: Mapping[str, object], where: str = "adapter config") -> AdapterConfig:
        """From adapter_config.json's fields (or a dict of them: r and lora_alpha at least); refuses what cannot
        be applied."""
        peft_type = config.get("peft_type", "LORA")
        if peft_type not in ("LORA", None):
            raise AdapterError(f"{where}: peft_type {peft_type!r} is not LoRA")
        refused = {
            "use_dora": "DoRA adapters are not supported",
            "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
            "modules_to_save": "modules_to_save (full copies of layers) is not supported",
        }
        for key, why in refused.items():
            if config.get(key):
                raise AdapterError(f"{where}: {why} ({key}={config[key]!r})")
        if config.get("bias", "none") != "none":
            raise AdapterError(f"{where}: trained biases are not supported (bias={config['bias']!r}, need 'none')")
        alpha = config.get("lora_alpha", config.get("r"))
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise AdapterError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
        pattern = config.get("alpha_pattern") or {}
        if not isinstance(pattern, Mapping):
            raise AdapterError(f"{where}: alpha_pattern must be a mapping, got {pattern!r}")
        return cls(float(alpha), bool(config.get("use_rslora", False)), {str(k): float(v) for k, v in pattern.items()})


@dataclass
class AdapterWeights:
    """One adapter: per adapted linear (its module name in the model), A [r, in] and B [out, r]."""

    config: AdapterConfig
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | os.PathLike[str]) -> AdapterWeights:
    """The PEFT adapter saved in directory `path` (save_pretrained's layout)."""
    directory = Path(path).expanduser()
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} there (a PEFT save_pretrained directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} does not read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        raise AdapterError(f"LoRA adapter {str(path)!r}: neither of {', '.join(WEIGHT_FILES)} is there")
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(weights))
        else:
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise AdapterError(f"LoRA adapter {str(path)!r}: cannot read {weights.name}: {exc}") from None
    return AdapterWeights(AdapterConfig.from_dict(config, f"LoRA adapter {str(path)!r}"), pairs_of(tensors, str(path)))


def pairs_of(tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B) from a PEFT state dict (keys with or without `base_model.model.` and the adapter
    name, as `get_peft_model_state_dict` or `save_pretrained` write them); any other key is refused."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        match = _KEY.match(name)
        if match is None:
            raise AdapterError(
                f"{where}: key {key!r} is not a LoRA A or B weight (DoRA magnitudes, biases, embedding adapters and "
                "saved modules are not supported)"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not tensor.is_floating_point():
            raise AdapterError(f"{where}: {key!r} must be a 2-d floating-point tensor")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    pairs = {}
    for module, got in parts.items():
        if set(got) != {"A", "B"}:
            missing = "B" if "A" in got else "A"
            raise AdapterError(f"{where}: {module} has lora_{'A' if missing == 'B' else 'B'} but no lora_{missing}")
        a, b = got["A"], got["B"]
        if a.shape[0] != b.shape[1]:
            shapes = f"lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}"
            raise AdapterError(f"{where}: {module}: {shapes}: ranks differ")
        pairs[module] = (a, b)
    if not pairs:
        raise AdapterError(f"{where}: no LoRA weights in it")
    return pairs


def write_adapter(path: str | Path, weights: AdapterWeights, rank: int, target_modules: list[str]) -> None:
    """Save `weights` as a PEFT directory (the tests' and examples' adapters; PEFT reads it back)."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": weights.config.lora_alpha,
        "use_rslora": weights.config.use_rslora,
        "alpha_pattern": dict(weights.config.alpha_pattern),
        "target_modules": target_modules,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {}
    for module, (a, b) in weights.pairs.items():
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(directory / WEIGHT_FILES[0]))
