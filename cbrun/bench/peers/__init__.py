"""Peer engines: each runs a warm-up and a timed pass over the same workload.

A peer is a function `run(ctx, workload, warmup) -> PeerResult` (registry.py
finds it by name). It raises `PeerUnavailable` when it cannot run here; any
other exception is a failure.
Peers use public APIs only (cbrun's Engine contract, transformers'
`generate_batch` / `generate`, vLLM's `LLM.generate`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from cbrun.bench.result import PeerResult, PeerUnavailable  # noqa: F401  (re-exported for peers)


class Progress:
    """Plain progress lines on stderr, at most one per `interval_s` per engine (silent when quiet)."""

    def __init__(self, quiet: bool = False, interval_s: float = 2.0, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.interval_s = interval_s
        self.stream = stream
        self._last = 0.0

    def message(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream or sys.stderr, flush=True)

    def update(self, engine: str, done: int, total: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= self.interval_s:
            self._last = now
            self.message(f"[{engine}] {done}/{total} requests finished")


@dataclass
class PeerContext:
    """Everything a peer needs besides the workload."""

    model: Any
    tokenizer: Any
    model_spec: str
    dtype: Any  # torch.dtype
    device: str
    engine_config: Any = None  # cbrun EngineConfig
    threads: int | None = None  # CPU threads the user asked for (None: library defaults)
    static_batch_size: int = 32
    vllm_python: str | None = None
    vllm_dtype: str = "auto"  # vLLM's own default for the checkpoint, or a dtype name
    transformers_cb_config: dict = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    dashboard: Callable | None = None  # cbrun only: dashboard(engine) -> context manager
    model_needed_later: bool = True  # a later engine reads the model's weights (runner.model_needed_after)
