"""The engine's configuration: `EngineConfig`, a small validated dataclass fixed for the engine's life.

What each request chooses is `SamplingParams` (sampling_params.py); what the
engine reports is `StatsSnapshot` (stats.py). Both configurations validate in
`__post_init__`, so a bad value fails where it is created, with a message
naming the field (`ConfigError`), never deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

SchedulerName = Literal["fifo", "prefill-first"]
BackendName = Literal["auto", "cpu", "triton", "torch"]
BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)
KernelPolicy = Literal["portable", "fastest"]
KERNEL_POLICIES: tuple[str, ...] = get_args(KernelPolicy)
Quantization = Literal["int8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


class ConfigError(ValueError):
    """A configuration or sampling value is out of range; the message names it."""


def check(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


@dataclass
class EngineConfig:
    """Knobs fixed for an engine's lifetime.

    page_size: tokens of K and V one cache page holds per layer. 16 by
        default: prefix caching shares whole pages, so short shared prompts
        (chat templates, repeated questions) only hit with small pages, and
        the CPU decode kernel runs as fast at 16 as at 64 (docs/performance.md).
    num_blocks: blocks in the pool (a block is one page in every layer:
        cache/kv_cache.py); None sizes the pool from free memory
        (`max_memory_percent` of available RAM on CPU, of free memory on GPU).
    max_batch_tokens: query tokens per forward pass (the token budget).
    max_requests_per_batch: sequences per forward pass (bounds the logits tensor).
    scheduler: "fifo" (decodes first) or "prefill-first".
    safety_margin: fraction of the cache kept free for running decodes; while
        free capacity is below it no new prefill starts. None picks the
        scheduler's default (FIFO 0.15, prefill-first 0.0); 0 disables.
    allow_block_sharing: prefix caching across requests (full attention only).
    cpu_offload_space: GiB of CPU swap pool for preempted requests' KV pages;
        0 disables offloading (preemption then recomputes: soft reset).
    max_memory_percent: share of available memory the cache may take when
        `num_blocks` is None.
    prefault_blocks: cache blocks whose memory is touched at start, so the
        first requests do not pay page faults mid-run (what preallocating
        engines pay at start-up). 0: the pool stays lazy; its resident memory
        follows the working set.
    backend: what computes the model (backend.py): "auto" (the compiled
        kernels on CPU, Triton on CUDA, the torch reference where neither
        can run), "cpu", "triton" or "torch" (the reference).
    kernels: which linear methods the CPU backend may choose at load
        (cpu/linear/method_selector.py): "portable" (the same bits on every CPU:
        for bf16, AMX's tile order on the tiles, on vdpbf16ps or on vector
        FMAs, the fastest that passes here) or "fastest" (also methods
        whose bits are this CPU's own, such as oneDNN on fixed blocks, when
        a timed trial shows them faster; still batch-invariant).
    quantization: None (the default: the model's own dtype) or "int8": W8A8
        on the CPU kernels, every linear layer but the output head with int8
        weights (per output channel, quantized at load) and int8 activations
        (per token, at every call), exact int32 sums; the head, embeddings,
        norms, attention and KV cache stay in the model's dtype
        (cpu/linear/int8.py).
    enable_lora: hold LoRA adapters that requests name (cbrun/lora/): each
        adapted linear adds scaling * B(A(x)) on the rows of the requests
        running that adapter, in fp32, row by row; other rows are untouched.
    max_lora_rank: the largest rank an adapter may have (vLLM's default, 16).
    max_loras: how many adapters may be loaded at once (None: no bound); any
        number of them run in one step.
    lora_modules: adapters loaded at start, as (name, PEFT directory) pairs
        (vLLM's --lora-modules; the CLI's --lora NAME=PATH); implies enable_lora.
    """

    page_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 1024
    max_requests_per_batch: int = 256
    scheduler: SchedulerName = "fifo"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    cpu_offload_space: float = 0.0
    max_memory_percent: float = 0.5
    prefault_blocks: int = 0
    backend: BackendName = "auto"
    kernels: KernelPolicy = "portable"
    quantization: Quantization | None = None
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check(self.page_size >= 4, f"page_size must be at least 4, got {self.page_size}")
        check(
            self.num_blocks is None or self.num_blocks >= 1,
            f"num_blocks must be at least 1, got {self.num_blocks}",
        )
        check(self.prefault_blocks >= 0, f"prefault_blocks must be >= 0, got {self.prefault_blocks}")
        check(self.max_batch_tokens >= 1, f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        check(
            self.max_requests_per_batch >= 1,
            f"max_requests_per_batch must be >= 1, got {self.max_requests_per_batch}",
        )
        check(
            self.scheduler in ("fifo", "prefill-first"),
            f"scheduler must be 'fifo' or 'prefill-first', got {self.scheduler!r}",
        )
        if self.safety_margin is None:
            self.safety_margin = 0.15 if self.scheduler == "fifo" else 0.0
        check(0.0 <= self.safety_margin < 1.0, f"safety_margin must be in [0, 1), got {self.safety_margin}")
        check(self.backend in BACKEND_NAMES, f"backend must be one of {', '.join(BACKEND_NAMES)}, got {self.backend!r}")
        check(self.cpu_offload_space >= 0, f"cpu_offload_space must be >= 0, got {self.cpu_offload_space}")
        check(
            self.kernels in KERNEL_POLICIES,
            f"kernels must be one of {', '.join(KERNEL_POLICIES)}, got {self.kernels!r}",
        )
        check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.quantization!r}",
        )
        check(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        self.lora_modules = tuple((str(name), str(path)) for name, path in self.lora_modules)
        names = [name for name, _ in self.lora_modules]
        check(all(names), "lora_modules: every adapter needs a name")
        check(len(set(names)) == len(names), f"lora_modules: an adapter name is given twice ({', '.join(names)})")
        self.enable_lora = self.enable_lora or bool(self.lora_modules)
        check(self.max_loras is None or self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        check(
            0.0 < self.max_memory_percent <= 1.0,
            f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}",
        )
