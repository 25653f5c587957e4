"""Input processing in front of the core: what callers submit, tokenized and validated, as Requests.

Runs in the caller's thread, before anything reaches the core (vLLM's
`v1/engine/processor.py`): text is tokenized, sampling values are read,
and a request that cannot run is refused here, with the reason in its
`error` (an empty prompt, ids outside the vocabulary, prompt plus
`max_tokens` past the context, more blocks than the whole cache, a
structured-output constraint that does not compile, a bad completion to
score). A refused request still goes to the engine's loop like any other,
which ends it at once: the core, and only the core, ends requests.

The processor reads only what is fixed for the engine's life (the model's
limits, the cache's size) and the grammar compiler, which is thread-safe;
it never touches the core's state.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from cbrun.engine.config import ConfigError
from cbrun.engine.core import EngineCore
from cbrun.engine.grammar import GrammarCompiler
from cbrun.engine.model_spec import ModelSpec, Tokenizer
from cbrun.engine.request import Request, ScoreParams
from cbrun.engine.sampling_params import SamplingParams, StructuredSpec, is_int
from cbrun.lora.adapters import LoRAAdapters

Prompt = str | Sequence[int]


class Processor:
    """Turns a prompt (or a prompt and completions to score) into the Requests of one request id.

    num_blocks: the cache's size; blocks_for(tokens): the blocks a sequence of that many tokens holds
    at most. A request that cannot fit the whole cache is refused here, not left waiting forever.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        spec: ModelSpec,
        grammars: GrammarCompiler,
        num_blocks: int,
        blocks_for: Callable[[int], int],
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = spec.vocab_size
        self.max_context = spec.max_context
        self.grammars = grammars
        self.num_blocks = num_blocks
        self.blocks_for = blocks_for
        self.adapters = adapters  # LoRA adapters by name (loaded on the loop thread; only their names are read)

    @classmethod
    def serving(cls, core: EngineCore, tokenizer: Tokenizer | None) -> Processor:
        """The processor in front of `core`: its model's limits, its cache's size, its grammars and adapters."""
        cache = core.cache
        return cls(tokenizer, core.spec, core.grammars, cache.pool.num_blocks, cache.max_blocks_for, core.adapters)

    def process(
        self, prompt: Prompt, sampling: object, request_id: str, stream: bool = False, lora: str | None = None
    ) -> list[Request]:
        """One Request per sample (`n`), sharing one seed; each carries the reason it is refused, if it is.
        lora: the name of a loaded adapter to run it with."""
        error: str | None = None
        params = SamplingParams()
        try:
            params = as_params(sampling)
        except (ConfigError, TypeError) as exc:
            error = f"invalid sampling parameters: {exc}"
        ids = self.tokenize(prompt)
        if isinstance(ids, str):
            error, ids = error or ids, []
        if error is None:
            error = (
                self.validate(ids, params.max_tokens)
                or self.check_structured(params.structured)
                or self.check_lora(lora)
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return [
            Request(request_id, index, ids, params, seed, 0, stream=stream, error=error, lora=lora)
            for index in range(params.n)
        ]

    def process_many(
        self,
        prompts: Sequence[Prompt],
        sampling: object,
        request_ids: Sequence[str | None] | None,
        loras: str | Sequence[str | None] | None,
        new_id: Callable[[str | None], str],
    ) -> list[list[Request]]:
        """Each prompt's Requests; `sampling` and `loras` are one value for all prompts or a sequence with one
        per prompt (ValueError when a sequence's length differs), `new_id` gives each its request id."""
        count = len(prompts)
        ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * count
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * count
        adapters: list[str | None] = [loras] * count if loras is None or isinstance(loras, str) else list(loras)
        if not len(ids) == len(params) == len(adapters) == count:
            raise ValueError("request_ids, per-prompt sampling and loras must have one entry per prompt")
        return [self.process(p, s, new_id(rid), lora=a) for p, s, rid, a in zip(prompts, params, ids, adapters)]

    def process_score(
        self,
        prompt: Prompt,
        completions: Sequence[Prompt],  # text is refused here, with a message
        request_id: str,
        samples: Sequence[int] | None,
        prompt_logprobs: bool,
        top_logprobs: int,
        lora: str | None = None,
    ) -> list[Request]:
        """One scoring Request per completion (sample `samples[i]`, default i); raises ValueError for
        arguments that are wrong for every completion (the samples, top_logprobs)."""
        samples = list(samples) if samples is not None else list(range(len(completions)))
        if len(samples) != len(completions) or len(set(samples)) != len(samples):
            raise ValueError("samples must give one distinct index per completion")
        if not is_int(top_logprobs) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
        tokenized = self.tokenize(prompt)
        prompt_error = tokenized if isinstance(tokenized, str) else self.check_lora(lora)
        ids: list[int] = [] if isinstance(tokenized, str) else tokenized  # an error is never empty text
        params = SamplingParams(max_tokens=1, top_logprobs=top_logprobs)
        requests = []
        for sample, completion in zip(samples, completions):
            tokens = self.tokenize(completion) if not isinstance(completion, str) else "completion must be token ids"
            error = prompt_error or (tokens if isinstance(tokens, str) else self.validate_score(ids, tokens))
            # without an error the tokens are ids (the isinstance only tells the type checker)
            score = ScoreParams(
                tuple(tokens) if error is None and not isinstance(tokens, str) else (), prompt_logprobs, top_logprobs
            )
            requests.append(Request(request_id, sample, ids, params, 0, 0, score=score, error=error, lora=lora))
        return requests

    def tokenize(self, prompt: Prompt) -> list[int] | str:
        """Token ids of a text or id-list prompt, or why there are none (integral floats are taken as ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return "text prompt given but the engine has no tokenizer"
            return list(self.tokenizer.encode(prompt))
        try:
            return [int(t) if not isinstance(t, bool) and float(t) == int(t) else t for t in prompt]
        except (TypeError, ValueError):
            return "prompt must be text or a list of token ids"

    def validate(self, prompt_ids: list[int], max_tokens: int) -> str | None:
        """Why this prompt cannot run, or None."""
        if not prompt_ids:
            return "empty prompt"
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1})"
        total = len(prompt_ids) + max_tokens
        if total > self.max_context:
            return (
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"the model's context of {self.max_context} tokens"
            )
        needed = self.blocks_for(len(prompt_ids) + 1)
        if needed > self.num_blocks:
            return (
                f"prompt needs {needed} KV-cache blocks but the whole cache has "
                f"{self.num_blocks}; raise num_blocks or shorten the prompt"
            )
        return None

    def validate_score(self, prompt_ids: list[int], completion_ids: list[int]) -> str | None:
        """Why this (prompt, completion) pair cannot be scored, or None."""
        if not completion_ids:
            return "empty completion: nothing to score"
        bad = next((t for t in completion_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"completion token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1})"
        error = self.validate(prompt_ids, len(completion_ids))
        needed = self.blocks_for(len(prompt_ids) + len(completion_ids) - 1)
        if error is None and needed > self.num_blocks:
            error = (
                f"prompt plus completion need {needed} KV-cache blocks but the whole cache has "
                f"{self.num_blocks}; raise num_blocks or shorten them"
            )
        return error

    def check_lora(self, lora: str | None) -> str | None:
        """Why adapter `lora` cannot run, or None (no adapter, or a loaded one)."""
        if lora is None:
            return None
        if self.adapters is None:
            return f"LoRA adapter {lora!r} asked for but LoRA is not enabled (start the engine with enable_lora)"
        if lora not in self.adapters.adapters:
            loaded = ", ".join(sorted(self.adapters.adapters)) or "none"
            return f"unknown LoRA adapter {lora!r} (loaded: {loaded})"
        return None

    def check_structured(self, structured: StructuredSpec | None) -> str | None:
        """Why a structured-output constraint cannot be enforced, or None (compiled once per distinct one)."""
        return None if structured is None else self.grammars.check(structured)


def as_params(sampling: object) -> SamplingParams:
    """SamplingParams from what a caller passed: the params, a dict of their fields, or None (defaults)."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, dict):
        return SamplingParams(**sampling)
    raise TypeError(f"sampling must be SamplingParams or dict, got {type(sampling).__name__}")


def submission_order(group: list[Request]) -> list[int]:
    """Submission order of many prompts: by token ids (a scored completion's included), so that shared
    prefixes are adjacent in the queue."""
    return group[0].all_token_ids if group else []
