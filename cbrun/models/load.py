"""load_model: a spec -> `(model, tokenizer)` ready for the engine, each loading step's failure named."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from cbrun.models.compressed import load_w8a8_weights, scale_keys_unreported, w8a8_config, without_quantization
from cbrun.models.dtype import resolve_device, resolve_dtype
from cbrun.models.errors import ModelLoadError
from cbrun.models.gguf import converted_dir, dequantize_config, save_converted
from cbrun.models.resolve import resolve_spec
from cbrun.models.support import check_supported

log = logging.getLogger("cbrun.models")
T = TypeVar("T")


def load_model(
    spec: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str = "auto", revision: str | None = None
) -> tuple[torch.nn.Module, object]:
    """Return `(model, tokenizer)`: the model in eval mode on `device`, in the resolved dtype.

    The model keeps transformers' default attention; the engine switches it to
    its own. The tokenizer always has a pad token (eos when it had none).
    `revision` (a branch, tag or commit) applies to hub ids only.
    Raises ModelLoadError when the spec cannot be found or is not supported.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    name_or_path, extra = resolve_spec(str(spec), revision)
    return _load(str(spec), name_or_path, extra, torch_dtype, device)


def _load(spec: str, name_or_path: str, extra: dict, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, Any]:
    """Load config first so an unsupported architecture fails before any weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    converted = converted_dir(name_or_path, extra, dtype)
    if converted is not None and (converted / "config.json").is_file():
        name_or_path, extra = str(converted), {}  # a GGUF file read before: load the saved copy
    kwargs = {"local_files_only": True, **extra}
    config = _attempt(spec, "read its config", AutoConfig.from_pretrained, name_or_path, **kwargs)
    check_supported(config, spec)
    w8a8 = w8a8_config(config, spec)  # a compressed-tensors W8A8 checkpoint: built dense, its int8 weights read below
    if w8a8 is not None:
        config = without_quantization(config)
    model_kwargs = dict(kwargs, config=config, dtype=dtype)
    if "gguf_file" in extra:
        model_kwargs["quantization_config"] = dequantize_config()
    tokenizer = _attempt(spec, "load its tokenizer", AutoTokenizer.from_pretrained, name_or_path, **kwargs)
    with scale_keys_unreported() if w8a8 is not None else contextlib.nullcontext():
        model: torch.nn.Module = _attempt(
            spec, "load its weights", AutoModelForCausalLM.from_pretrained, name_or_path, **model_kwargs
        )
    if w8a8 is not None:
        count = _attempt(spec, "read its int8 weights", load_w8a8_weights, model, name_or_path)
        log.info(
            "%s: %d int8 W8A8 linears read from the checkpoint (run them as int8 with --quantization int8)", spec, count
        )
    model = _text_decoder(model, dtype)
    model.to(device).eval()
    _ensure_special_tokens(model, tokenizer)
    if converted is not None and "gguf_file" in extra:
        save_converted(model, tokenizer, converted)
    return model, tokenizer


def _text_decoder(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A multimodal checkpoint (Gemma 3 4B and up) as its text-only causal LM, sharing the weights.

    cbrun feeds text only, and the engine drives a plain decoder: the language
    model and output head are moved into the text model class of the same
    family (built on the meta device, so nothing is allocated twice); the
    vision tower is dropped. Logits are unchanged for text-only inputs.
    """
    from transformers import AutoModelForCausalLM

    text_config = getattr(model.config, "text_config", None)
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    if text_config is None or language_model is None or not hasattr(model, "lm_head"):
        return model
    with torch.device("meta"):
        text_model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    text_model.model = language_model
    text_model.lm_head = model.lm_head
    text_model.generation_config = model.generation_config
    return text_model


def _attempt(spec: str, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one loading step, turning its failure into a ModelLoadError that names the step."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
        raise ModelLoadError(
            f"Cannot load model {spec!r}: failed to {what} ({type(error).__name__}: {error})"
        ) from error


def _ensure_special_tokens(model: torch.nn.Module, tokenizer: Any) -> None:
    """Give the tokenizer a pad token and the generation config an eos id, which batching relies on."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.eos_token_id is None:
        generation_config.eos_token_id = tokenizer.eos_token_id
