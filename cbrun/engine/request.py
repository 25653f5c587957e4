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
from typing import TYPE_CHECKING

from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.grammar import GrammarState


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


@dataclass(kw_only=True)
class GenerationOutput:
    """The result of one (request, sample): what users and writers consume.

    logprobs[i] is the log-probability of token_ids[i] under the fp32
    log-softmax of the model's logits divided by the temperature (raw logits
    when greedy), before top-k/top-p/min-p filtering.
    top_logprobs[i] is a list of (token_id, logprob) pairs, most likely first,
    present only when the request asked for top_logprobs > 0.
    structured_complete: None without a constraint; else whether the output
    completed its grammar (False: cut by max_tokens or a stop string, not valid).
    With a constraint, logprobs are the model's before the grammar mask unless
    the request set `masked_logprobs`.
    weight_versions[i] is the version of the weights token_ids[i] was sampled under (0 at start,
    one more at each `update_weights`): they differ only where a pause in "keep" mode spanned an
    update. weight_version is the last token's (the version at the end when there is none).
    finish_reason "abort": ended by `Engine.abort` or a pause in "abort" mode, with what it had.

    Scoring requests (`Engine.add_score_request`) fill the same fields for the
    given completion: token_ids is the completion, logprobs its teacher-forced
    logprobs at temperature 1, is_greedy whether every token was the argmax,
    prompt_logprobs (when asked) one per prompt token with None for the first.
    """

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | "cancelled" | "error"
    error: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    is_greedy: bool | None = None  # scoring only
    prompt_logprobs: list[float | None] | None = None  # scoring with prompt logprobs only
    structured_complete: bool | None = None  # with a constraint: did the output complete its grammar?
    weight_versions: list[int] = field(default_factory=list)  # one per token (scoring: per logprob)
    weight_version: int = 0
    lora: str | None = None  # the LoRA adapter it ran, by name (None: the base model)

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
    """One generated token as it is produced; the last chunk carries finish_reason and the whole result."""

    request_id: str
    sample_index: int
    token_id: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    weight_version: int | None = None  # the weights' version the token was sampled under
    top_logprobs: list[tuple[int, float]] | None = None  # the token's alternatives, when the request asked
    output: GenerationOutput | None = None  # the last chunk: the sample's result, as get_result would give it


@dataclass(frozen=True)
class ScoreParams:
    """What a scoring request wants: logprobs of a given completion, not new tokens.

    The request runs as a prefill of prompt + completion[:-1] that keeps the
    logits of every position from `Request.score_from` on (the last completion
    token predicts nothing that is asked for, so it is never computed).
    """

    completion_token_ids: tuple[int, ...]
    prompt_logprobs: bool = False
    top_logprobs: int = 0


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
    score: ScoreParams | None = None  # set for a scoring (teacher-forced, prefill-only) request
    prompt_logprobs: list[float] | None = None  # scoring: logprob of prompt token i + 1, per position i
    is_greedy: bool = True  # scoring: every completion token so far was the argmax
    grammar: GrammarState | None = None  # structured outputs: the matcher and next-token mask
    stop_ids: tuple[int, ...] = ()  # ids that end it (stop_token_ids, EOS unless ignore_eos), set when added
    weight_versions: list[int] = field(default_factory=list)  # the weights' version of each token (or logprob)
    weight_version: int = 0  # the last token's version, or the version at its end without one (set at finish)
    lora: str | None = None  # the LoRA adapter it runs (by name), or None: the base model
    cache_salt: bytes | None = None  # roots its prefix-cache hash chain: its adapter's K/V is not the base model's

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
            if self.score is not None:
                self.all_token_ids.extend(self.score.completion_token_ids[:-1])
        if self.score is not None:
            if self.score.top_logprobs and self.top_logprobs is None:
                self.top_logprobs = []
            if self.score.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = []
        elif self.sampling.top_logprobs and self.top_logprobs is None:
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
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not yet in the cache (the last one yields logits)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def held_stop_ids(self) -> tuple[int, ...]:
        """Ids barred from the next token: its stop ids while fewer than `min_tokens` tokens exist."""
        return self.stop_ids if self.num_generated < self.sampling.min_tokens else ()

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    # -- status while alive (EngineCore.finish alone ends a request) -------------
    def mark_running(self) -> None:
        """Scheduled for a step: PREFILLING while more than one token lacks its K/V, else DECODING."""
        self.status = RequestStatus.PREFILLING if self.is_prefilling else RequestStatus.DECODING

    def mark_offloaded(self) -> None:
        """Preempted with its K/V copied to the swap pool: it comes back without recompute."""
        self.status = RequestStatus.OFFLOADED

    def restart(self) -> None:
        """Preempted by soft reset: nothing of it is cached, so it waits to be computed again from token 0
        (its generated tokens stay in the sequence)."""
        self.num_computed_tokens = 0
        self.status = RequestStatus.PENDING

    # -- scoring ------------------------------------------------------------------
    @property
    def score_from(self) -> int:
        """First position whose logits a scoring request needs: 0 with prompt logprobs, else
        the last prompt token (it predicts the first completion token)."""
        assert self.score is not None
        return 0 if self.score.prompt_logprobs else self.num_prompt_tokens - 1

    @property
    def next_score_position(self) -> int:
        """The first position not scored yet; positions before it are never scored again
        (after a soft reset they are recomputed for their K/V only)."""
        return self.score_from + len(self.prompt_logprobs or ()) + len(self.logprobs)

    @property
    def score_done(self) -> bool:
        return self.score is not None and self.num_computed_tokens >= self.num_tokens

    def score_target(self, position: int) -> int:
        """The token that the logits at `position` are scored against (the next one)."""
        assert self.score is not None
        nxt = position + 1
        if nxt < self.num_prompt_tokens:
            return self.prompt_token_ids[nxt]
        return self.score.completion_token_ids[nxt - self.num_prompt_tokens]

    @property
    def prefix_match_ids(self) -> list[int]:
        """Tokens the prefix cache may serve, plus one: the last is always computed.

        A scoring request needs the logits of every position from
        `next_score_position` on, so blocks holding such a position are not taken
        from the cache even when they are there.
        """
        if self.score is None:
            return self.all_token_ids
        return self.all_token_ids[: self.next_score_position + 1]

    @property
    def is_fresh(self) -> bool:
        """Nothing produced yet (its first admission, or a reset before any output)."""
        if self.score is not None:
            return not self.logprobs and not self.prompt_logprobs
        return self.num_generated == 0

    def to_output(self) -> GenerationOutput:
        if self.score is not None:
            return self._score_output()
        return self._generation_output()

    def _score_output(self) -> GenerationOutput:
        assert self.score is not None
        prompt = None if self.prompt_logprobs is None else [None, *self.prompt_logprobs]
        return GenerationOutput(
            request_id=self.request_id,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.score.completion_token_ids),
            text="",
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "error",
            error=self.error,
            top_logprobs=self.top_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            is_greedy=self.is_greedy if self.error is None else None,
            prompt_logprobs=prompt,
            weight_versions=list(self.weight_versions),
            weight_version=self.weight_version,
            lora=self.lora,
        )

    def _generation_output(self) -> GenerationOutput:
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
            structured_complete=None if self.grammar is None else self.grammar.accepting,
            weight_versions=list(self.weight_versions),
            weight_version=self.weight_version,
            lora=self.lora,
        )
