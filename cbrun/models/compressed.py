"""compressed-tensors W8A8 checkpoints (as llmcompressor writes them and vLLM loads them), read without the package.

Such a checkpoint's config.json carries a `quantization_config` with
`quant_method: "compressed-tensors"` and `format: "int-quantized"` (or
"naive-quantized"); each quantized linear stores `weight` as int8 [N, K] and
`weight_scale` [N, 1] (per output channel, symmetric: dequantized w = q * s).
The model is built in the requested dtype from the same config minus its
quantization, then each quantized linear's weight is set to q * s, carrying
its int8 form (linear/int8.py's PREQUANTIZED): `--quantization int8` then packs the
checkpoint's own q and s, bit for bit; without it the model runs the
dequantized weights in its dtype. Other schemes (4-bit, fp8, group or tensor
scales, zero points) are refused by name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cbrun.models.errors import ModelLoadError

log = logging.getLogger("cbrun.models")

_FORMATS = ("int-quantized", "naive-quantized")


def w8a8_config(config: Any, spec: str) -> dict | None:
    """The checkpoint's compressed-tensors quantization_config when it is W8A8 as cbrun reads it, else None
    (not compressed-tensors). Raises ModelLoadError for a compressed-tensors scheme cbrun cannot read."""
    found = getattr(config, "quantization_config", None)
    settings = found if isinstance(found, dict) else getattr(found, "to_dict", lambda: None)()
    if not settings or settings.get("quant_method") != "compressed-tensors":
        return None
    refuse = f"Cannot load model {spec!r}: its compressed-tensors quantization"
    if settings.get("format") not in _FORMATS:
        raise ModelLoadError(f"{refuse} has format {settings.get('format')!r}; cbrun reads {' and '.join(_FORMATS)}")
    for name, group in (settings.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        if any(weights.get(key) != value for key, value in wanted.items()):
            raise ModelLoadError(f"{refuse} group {name!r} is not int8 symmetric per output channel: {weights}")
        activations = group.get("input_activations") or {}
        if activations and (activations.get("dynamic") is not True or activations.get("strategy") != "token"):
            log.warning(
                "%s: group %s quantizes activations %s; cbrun's int8 uses dynamic per-token", spec, name, activations
            )
    return settings


def without_quantization(config: Any) -> Any:
    """The config with its quantization_config removed (the model is built dense; weights come in below)."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


@contextlib.contextmanager
def scale_keys_unreported() -> Iterator[None]:
    """transformers' load report off while the dense model loads: it would list every weight_scale as unexpected
    (they are read by load_w8a8_weights afterwards)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_w8a8_weights(model: torch.nn.Module, directory: str) -> int:
    """Set every linear whose checkpoint weight is int8 with a weight_scale to q * s in its dtype, carrying (q, s);
    returns how many. Raises ModelLoadError on a shape the model does not have."""
    from safetensors import safe_open

    from cbrun.engine.backends.cpu.kernels.int8 import dequantize_weight
    from cbrun.engine.backends.cpu.linear.int8 import PREQUANTIZED

    modules = dict(model.named_modules())
    count = 0
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            names = set(tensors.keys())
            for scale_name in sorted(n for n in names if n.endswith(".weight_scale")):
                prefix = scale_name.removesuffix(".weight_scale")
                module = modules.get(prefix)
                if module is None and prefix.startswith("model."):  # a text model inside a multimodal name
                    module = modules.get(prefix.removeprefix("model."))
                if prefix + ".weight" not in names or not isinstance(module, torch.nn.Linear):
                    continue
                q = tensors.get_tensor(prefix + ".weight")
                scale = tensors.get_tensor(scale_name).float().reshape(-1).contiguous()
                if q.dtype != torch.int8 or q.shape != module.weight.shape or scale.shape != (q.shape[0],):
                    raise ModelLoadError(
                        f"checkpoint weight {prefix} is {q.dtype} {tuple(q.shape)} with scale {tuple(scale.shape)}; "
                        f"the model has {tuple(module.weight.shape)} and cbrun reads int8 with one scale per output"
                    )
                dense = dequantize_weight(q.contiguous(), scale, module.weight.dtype)
                module.weight.data = dense
                setattr(module.weight, PREQUANTIZED, (q.contiguous(), scale))
                count += 1
    return count
