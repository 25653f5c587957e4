"""Request state, tracked by counters rather than phases.

A request is a list of token ids (prompt, then generated tokens) and a count
of how many of them already have K/V in the cache (`num_computed_tokens`).
It is prefilling while that count is below the prompt length; chunked
prefill, prefix-cache hits, soft reset and resume after offload are all
arithmetic on that one counter.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cbrun.engine.config import SamplingParams


class RequestStatus(enum.Enum):
    PENDING = "pending"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    OFFLOADED = "offloaded"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)


@dataclass
class GenerationOutput:
    """The result of one (request, sample): what users and writers consume.

    logprobs[i] is the log-probability of token_ids[i] under the fp32
    log-softmax of the model's logits divided by the temperature (raw logits
    when greedy), before top-k/top-p/min-p filtering.
    top_logprobs[i] is a list of (token_id, logprob) pairs, most likely first,
    present only when the request asked for top_logprobs > 0.
    """

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class StreamChunk:
    """One generated token as it is produced; the last chunk carries finish_reason."""

    request_id: str
    sample_index: int
    token_id: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """Engine-internal state of one (prompt, sample) sequence."""

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    arrival_order: int
    status: RequestStatus = RequestStatus.PENDING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    stream: bool = False
    stream_text: str = ""  # text already sent to the stream

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling.top_logprobs and self.top_logprobs is None:
            self.top_logprobs = []

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.sample_index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not yet in the cache (the last one yields logits)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    def to_output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=self.generated_token_ids,
            text=self.text,
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "error",
            error=self.error,
            top_logprobs=self.top_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
        )
