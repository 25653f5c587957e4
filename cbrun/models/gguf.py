"""GGUF files: loaded as plain dense weights, and that dequantized copy kept so the file is read only once."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from cbrun.user_cache import cache_dir


def dequantize_config():
    """transformers' GGUF loading as plain dense weights: the engine needs ordinary Linear layers and its
    own attention, not transformers' packed-GGUF kernels and ggml attention."""
    from transformers import GgufConfig

    return GgufConfig(dequantize=True)


def converted_dir(name_or_path: str, extra: dict, dtype: torch.dtype) -> Path | None:
    """Where a dequantized copy of a GGUF file is kept (reading and dequantizing GGUF is far slower than the copy).

    Keyed by the file's path, size and modification time, and by dtype; None when the spec is not a GGUF file.
    """
    if "gguf_file" not in extra:
        return None
    gguf = Path(name_or_path) / extra["gguf_file"]
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}-{str(dtype).removeprefix('torch.')}"


def save_converted(model: Any, tokenizer: Any, target: Path) -> None:
    """Save the dequantized model and tokenizer atomically; failure only costs speed next time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            os.replace(scratch, target)
            os.mkdir(scratch)  # let TemporaryDirectory clean up an empty folder
    except OSError:
        pass
