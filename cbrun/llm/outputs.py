"""vLLM's output types (`RequestOutput`, `CompletionOutput`, `Logprob`) built from the engine's results."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cbrun.engine.model_spec import Tokenizer
from cbrun.engine.request import GenerationOutput
from cbrun.llm.params import SamplingParams

# one position: {token id: Logprob}, the chosen (or prompt) token first, then the alternatives
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    """A token's log-probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt.

    cbrun adds weight_versions (one per token: the version of the weights it was sampled under, 0 at
    start and one more at each update_weights) and weight_version (the last token's), for rollouts that
    a pause in "keep" mode carried across an update.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    lora_request: Any = None
    weight_version: int = 0
    weight_versions: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int | None = None
    metrics: Any = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)


class OutputBuilder:
    """Turns engine results into vLLM's types for one tokenizer and model."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self._pieces: dict[int, str] = {}

    def completion(
        self,
        out: GenerationOutput,
        params: SamplingParams,
        logprobs: list[float] | None = None,
        top: list[list[tuple[int, float]]] | None = None,
    ) -> CompletionOutput:
        """One CompletionOutput; `logprobs`/`top` replace the engine's (raw logprobs rescored)."""
        logprobs = out.logprobs if logprobs is None else logprobs
        top = out.top_logprobs if top is None else top
        positions = None
        if params.logprobs is not None:
            argmax = params.greedy and params.constraint is None  # a constraint's pick need not be the raw argmax
            positions = [
                self.position(token, lp, (top or [])[i] if top else [], argmax)
                for i, (token, lp) in enumerate(zip(out.token_ids, logprobs))
            ]
        return CompletionOutput(
            index=out.sample_index,
            text=self.text(out, params),
            token_ids=list(out.token_ids),
            cumulative_logprob=float(sum(logprobs)) if params.logprobs is not None else None,
            logprobs=positions,
            finish_reason=out.finish_reason,
            stop_reason=self.stop_reason(out, params),
            weight_version=out.weight_version,
            weight_versions=list(out.weight_versions),
        )

    def position(
        self, token: int, logprob: float, alternatives: list[tuple[int, float]], greedy: bool = False
    ) -> PositionLogprobs:
        """{token: Logprob, alternative: Logprob, ...}; the token's rank is known when it is among the
        alternatives or was chosen greedily, else None."""
        ranks = {alt: rank for rank, (alt, _) in enumerate(alternatives, start=1)}
        rank = ranks.get(token, 1 if greedy else None)
        entry = {token: Logprob(logprob, rank, self.piece(token))}
        for alt, value in alternatives:
            entry.setdefault(alt, Logprob(value, ranks[alt], self.piece(alt)))
        return entry

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else ""
        return self._pieces[token]

    def text(self, out: GenerationOutput, params: SamplingParams) -> str:
        """The engine's text, or decoded again for the options it does not apply itself."""
        if not params.detokenize or self.tokenizer is None:
            return ""
        if params.skip_special_tokens and not params.include_stop_str_in_output:
            return out.text
        ids = list(out.token_ids)
        if out.finish_reason == "stop" and ids and self._ended_by_token(ids[-1], params):
            ids = ids[:-1]  # as vLLM: the stop token is not detokenized
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        hits = [(text.find(s), s) for s in params.stop_strings if s in text]
        if hits and out.finish_reason == "stop":
            at, stop = min(hits)
            text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return text

    def stop_reason(self, out: GenerationOutput, params: SamplingParams) -> int | str | None:
        """The stop token id or stop string that ended the completion; None for EOS and length."""
        if out.finish_reason != "stop" or not out.token_ids:
            return None
        last = out.token_ids[-1]
        if last in params.stop_ids:
            return last
        if self._ended_by_token(last, params) or not params.stop_strings:
            return None
        assert self.tokenizer is not None  # stop strings end a completion only where text is decoded
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in params.stop_strings if s in text]
        return min(hits)[1] if hits else None

    def _ended_by_token(self, token: int, params: SamplingParams) -> bool:
        return token in params.stop_ids or (not params.ignore_eos and token in self.eos)

    def prompt_logprobs(self, prompt_ids: list[int], scored: GenerationOutput | None) -> list[PositionLogprobs | None]:
        """[None, {prompt token 1: ...}, ...] from a scoring run of prompt[1:] after prompt[0]."""
        positions: list[PositionLogprobs | None] = [None]
        if scored is None:
            return positions
        top = scored.top_logprobs or [[] for _ in scored.logprobs]
        for token, lp, alternatives in zip(prompt_ids[1:], scored.logprobs, top):
            positions.append(self.position(token, lp, alternatives))
        return positions
