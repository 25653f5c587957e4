"""Benchmark workloads: the prompts and output lengths every engine receives.

A workload is plain data (token ids and lengths), so every peer gets exactly
the same requests. Random workloads follow `vllm bench throughput`: lengths
are drawn uniformly from [L(1-r), L(1+r)], prompts are token ids of the
model's vocabulary (special tokens excluded), and an optional shared prefix
of `prefix_len` tokens precedes every prompt. Everything comes from one seeded
generator, so a given seed yields the same workload on every run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cbrun.engine.sampling_params import StructuredSpec

WARMUP_PROMPTS = 8
WARMUP_MAX_OUTPUT = 16


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Requests for one timed pass: prompt i asks for output_lens[i] tokens, n samples each."""

    prompts: list[list[int]]
    output_lens: list[int]
    n: int = 1
    ignore_eos: bool = True
    temperature: float = 1.0
    seed: int = 0
    source: str = "random"
    structured: list[StructuredSpec | None] | None = None  # one constraint or None per prompt (structured outputs)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("prompts and output_lens must have the same length")
        if self.structured is not None and len(self.structured) != len(self.prompts):
            raise ValueError("structured must give one constraint (or None) per prompt")

    @property
    def is_structured(self) -> bool:
        return self.structured is not None and any(s is not None for s in self.structured)

    def constraint(self, index: int) -> StructuredSpec | None:
        """Prompt `index`'s StructuredSpec, or None."""
        return self.structured[index] if self.structured is not None else None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_distinct_prompt_tokens(self) -> int:
        """Prompt tokens left to compute when every shared prefix is computed once (the prompts' trie
        size): what an engine with ideal prefix caching prefills. A shared system prompt or a
        --prefix-len prefix counts once, not once per prompt."""
        root: dict = {}
        count = 0
        for prompt in self.prompts:
            node = root
            for token in prompt:
                child = node.get(token)
                if child is None:
                    child = node[token] = {}
                    count += 1
                node = child
        return count

    @property
    def max_output_tokens(self) -> int:
        """Output tokens if every request runs to its length (exact when ignore_eos)."""
        return self.n * sum(self.output_lens)

    @property
    def max_total_len(self) -> int:
        """Longest prompt + output of any request (what the context must hold)."""
        return max((len(p) + o for p, o in zip(self.prompts, self.output_lens)), default=0)

    def request_seed(self, index: int) -> int:
        """Per-prompt sampling seed, so seeded engines are reproducible run to run."""
        return self.seed + index


def draw_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> list[int]:
    """`count` lengths uniform in [L(1-r), L(1+r)] (integers, at least 1), as vLLM draws them."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def usable_token_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Token ids a random prompt may use: inside both the tokenizer's and the model's vocabulary, no special tokens."""
    limit = min(len(tokenizer), vocab_size) if tokenizer is not None else vocab_size
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids = np.array([i for i in range(limit) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("the vocabulary has no usable (non-special) token ids")
    return ids


def random_workload(
    token_ids: np.ndarray,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    n: int = 1,
    ignore_eos: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Seeded random prompts: a shared prefix of `prefix_len` tokens, then a random part of drawn length."""
    _check_workload_args(num_prompts, input_len, output_len, range_ratio, prefix_len, n)
    rng = np.random.default_rng(seed)
    prefix = rng.choice(token_ids, size=prefix_len).tolist() if prefix_len else []
    input_lens = draw_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = draw_lengths(rng, output_len, range_ratio, num_prompts)
    prompts = [prefix + rng.choice(token_ids, size=length).tolist() for length in input_lens]
    return Workload(
        prompts=prompts,
        output_lens=output_lens,
        n=n,
        ignore_eos=ignore_eos,
        temperature=temperature,
        seed=seed,
        source="random",
    )


def warmup_workload(workload: Workload, token_ids: np.ndarray) -> Workload:
    """A few short random requests, different from the timed ones so they leave no useful prefix-cache entries."""
    count = min(WARMUP_PROMPTS, workload.num_prompts)
    mean_len = max(1, workload.num_input_tokens // max(1, workload.num_prompts))
    rng = np.random.default_rng(workload.seed + 7919)
    prompts = [rng.choice(token_ids, size=mean_len).tolist() for _ in range(count)]
    output_lens = [min(WARMUP_MAX_OUTPUT, max(workload.output_lens))] * count
    structured = (
        None if workload.structured is None else [workload.structured[i % workload.num_prompts] for i in range(count)]
    )
    return replace(workload, prompts=prompts, output_lens=output_lens, n=1, source="warmup", structured=structured)


def _check_workload_args(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int, n: int
) -> None:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {prefix_len}")
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
