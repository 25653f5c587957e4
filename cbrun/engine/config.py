"""Engine and per-request configuration: small validated dataclasses.

`EngineConfig` holds hardware and scheduling knobs that are fixed for the
engine's lifetime; `SamplingParams` holds what each request may choose.
Both validate in `__post_init__` so a bad value fails where it is created,
with a message naming the field, never deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

SchedulerName = Literal["fifo", "prefill-first"]
BackendName = Literal["auto", "cpu", "triton", "torch"]
BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)
KernelPolicy = Literal["portable", "fastest"]
KERNEL_POLICIES: tuple[str, ...] = get_args(KernelPolicy)


class ConfigError(ValueError):
    """A configuration or sampling value is out of range; the message names it."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class EngineConfig:
    """Knobs fixed for an engine's lifetime.

    page_size: tokens of K and V one cache page holds per layer. 16 by
        default: prefix caching shares whole pages, so short shared prompts
        (chat templates, repeated questions) only hit with small pages, and
        the CPU decode kernel runs as fast at 16 as at 64 (measured; see README).
    num_blocks: pages in the pool; None sizes the pool from free memory
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
        (cpu/method_selector.py): "portable" (the same bits on every CPU:
        vdpbf16ps or its exact twin for bf16) or "fastest" (also methods
        whose bits are this CPU's own, such as oneDNN on fixed blocks, when
        a timed trial shows them faster; still batch-invariant).
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

    def __post_init__(self) -> None:
        _check(self.page_size >= 4, f"page_size must be at least 4, got {self.page_size}")
        _check(
            self.num_blocks is None or self.num_blocks >= 1,
            f"num_blocks must be at least 1, got {self.num_blocks}",
        )
        _check(self.prefault_blocks >= 0, f"prefault_blocks must be >= 0, got {self.prefault_blocks}")
        _check(self.max_batch_tokens >= 1, f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        _check(
            self.max_requests_per_batch >= 1,
            f"max_requests_per_batch must be >= 1, got {self.max_requests_per_batch}",
        )
        _check(
            self.scheduler in ("fifo", "prefill-first"),
            f"scheduler must be 'fifo' or 'prefill-first', got {self.scheduler!r}",
        )
        if self.safety_margin is None:
            self.safety_margin = 0.15 if self.scheduler == "fifo" else 0.0
        _check(0.0 <= self.safety_margin < 1.0, f"safety_margin must be in [0, 1), got {self.safety_margin}")
        _check(
            self.backend in BACKEND_NAMES, f"backend must be one of {', '.join(BACKEND_NAMES)}, got {self.backend!r}"
        )
        _check(self.cpu_offload_space >= 0, f"cpu_offload_space must be >= 0, got {self.cpu_offload_space}")
        _check(
            self.kernels in KERNEL_POLICIES,
            f"kernels must be one of {', '.join(KERNEL_POLICIES)}, got {self.kernels!r}",
        )
        _check(
            0.0 < self.max_memory_percent <= 1.0,
            f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}",
        )


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on what a request may generate (structured outputs).

    kind: "json_schema" (value: the schema, a dict or JSON text), "json_object"
    (any JSON object; no value), "regex" (the pattern the whole output must
    match), "choice" (value: the allowed strings) or "grammar" (Lark or GBNF
    text). The value is kept in a canonical form (a schema as sorted, compact
    JSON; choices as a tuple) so equal constraints are one cache key: the
    engine compiles each distinct spec once (engine/grammar.py). Whether the
    schema or pattern compiles is the engine's check, since it needs the
    tokenizer; this class checks only the shape.
    """

    kind: str
    value: Any = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            f"structured kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}",
        )
        object.__setattr__(self, "value", _canonical_value(self.kind, self.value))

    @classmethod
    def from_fields(cls, **fields: Any) -> StructuredSpec | None:
        """The one spec given as `json_schema=...`, `regex=...`, ... (None values ignored); None if none."""
        given = {k: v for k, v in fields.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_KINDS))
        _check(not unknown, f"unknown structured output field(s): {', '.join(unknown)}")
        _check(len(given) <= 1, f"give one structured output constraint, got {', '.join(sorted(given))}")
        if not given:
            return None
        kind, value = next(iter(given.items()))
        return cls(kind, "" if kind == "json_object" else value)

    def describe(self) -> str:
        """A short label for messages and logs."""
        text = self.value if isinstance(self.value, str) else json.dumps(list(self.value))
        return f"{self.kind}" + (f" {text[:60]!r}" if text else "")


def _canonical_value(kind: str, value: Any) -> Any:
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"json_schema: not valid JSON: {exc}") from None
        _check(isinstance(value, (dict, bool)), f"json_schema: must be a JSON object, got {type(value).__name__}")
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        _check(isinstance(value, (list, tuple)), f"choice: must be a list of strings, got {type(value).__name__}")
        _check(len(value) > 0, "choice: the list of choices is empty")
        _check(
            all(isinstance(c, str) and c for c in value),
            f"choice: every choice must be a non-empty string, got {list(value)!r}",
        )
        return tuple(value)
    _check(isinstance(value, str) and value != "", f"{kind}: must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for.

    temperature 0 means greedy. top_k 0 and top_p 1.0 and min_p 0.0 are "off".
    seed None lets the engine pick one; a request's random stream depends only
    on its seed, its sample index and the token position, never on the batch.
    n > 1 produces n samples of the same prompt; sample i draws from the stream of
    (seed, i), so each sample is reproducible on its own.
    top_logprobs K > 0 returns the K most likely alternatives at each position.
    structured: a constraint the output must satisfy (StructuredSpec, or a dict
    such as {"json_schema": {...}}); None generates freely.
    masked_logprobs: with a constraint, report logprobs (and top alternatives)
    of the masked distribution the token was drawn from instead of the
    model's own (the default, as vLLM's raw logprobs); RL importance ratios
    need the masked one.
    min_tokens: the request may not stop (EOS, stop_token_ids, stop strings)
    before it has generated this many tokens: its stop and EOS ids are
    masked from the logits until then (vLLM's min_tokens). Logprobs stay the
    model's, before that mask, unless `masked_logprobs` is set. A grammar
    that completes still ends the request.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    top_logprobs: int = 0
    structured: StructuredSpec | None = None
    masked_logprobs: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        structured: object = self.structured  # callers may pass the fields as a dict
        if isinstance(structured, dict):
            object.__setattr__(self, "structured", StructuredSpec.from_fields(**structured))
        stop: object = self.stop  # callers may pass one string
        if isinstance(stop, str):
            object.__setattr__(self, "stop", (stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer >= 0 and <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be a number >= 0, got {self.temperature!r}",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        _check(
            all(_is_int(t) for t in self.stop_token_ids),
            f"stop_token_ids must be integers, got {self.stop_token_ids!r}",
        )
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            _is_int(self.top_logprobs) and self.top_logprobs >= 0,
            f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}",
        )
        _check(
            self.structured is None or isinstance(self.structured, StructuredSpec),
            f"structured must be a StructuredSpec or a dict, got {type(self.structured).__name__}",
        )
        _check(
            isinstance(self.masked_logprobs, bool), f"masked_logprobs must be a boolean, got {self.masked_logprobs!r}"
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


@dataclass
class StatsSnapshot:
    """A point-in-time view of the engine, polled by dashboards and benchmarks."""

    steps: int = 0
    pending: int = 0
    prefilling: int = 0
    decoding: int = 0
    offloaded: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_free: int = 0
    peak_blocks_used: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    scored_tokens: int = 0  # positions whose logprob a scoring request kept
    offloads: int = 0
    restores: int = 0
    soft_resets: int = 0
    decode_batch_tokens: int = 0
    decode_steps: int = 0
    elapsed_s: float = 0.0
    busy_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.computed_prompt_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def kv_occupancy(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_tokens / self.decode_steps if self.decode_steps else 0.0
