"""cbrun's per-user cache directory: alias model files, dequantized GGUF copies, the benchmarks' models, the
compiled kernels. At the package root, so the engine (kernels) and the model loader (models/) share it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Per-user cache: $CBRUN_CACHE, else $XDG_CACHE_HOME/cbrun, else ~/.cache/cbrun."""
    if os.environ.get("CBRUN_CACHE"):
        return Path(os.environ["CBRUN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "cbrun"
