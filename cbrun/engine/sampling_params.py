"""What one request asks for: `SamplingParams`, and `StructuredSpec`, a constraint on its output.

Small frozen dataclasses (nano-vllm's sampling_params.py) that validate in
`__post_init__`: a bad value raises ConfigError naming the field where the
parameters are made, in the caller's thread, never inside a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from cbrun.engine.config import ConfigError, check

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
        check(
            self.kind in STRUCTURED_KINDS,
            f"structured kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}",
        )
        object.__setattr__(self, "value", _canonical_value(self.kind, self.value))

    @classmethod
    def from_fields(cls, **fields: Any) -> StructuredSpec | None:
        """The one spec given as `json_schema=...`, `regex=...`, ... (None values ignored); None if none."""
        given = {k: v for k, v in fields.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_KINDS))
        check(not unknown, f"unknown structured output field(s): {', '.join(unknown)}")
        check(len(given) <= 1, f"give one structured output constraint, got {', '.join(sorted(given))}")
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
        check(isinstance(value, (dict, bool)), f"json_schema: must be a JSON object, got {type(value).__name__}")
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        check(isinstance(value, (list, tuple)), f"choice: must be a list of strings, got {type(value).__name__}")
        check(len(value) > 0, "choice: the list of choices is empty")
        check(
            all(isinstance(c, str) and c for c in value),
            f"choice: every choice must be a non-empty string, got {list(value)!r}",
        )
        return tuple(value)
    check(isinstance(value, str) and value != "", f"{kind}: must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for: the engine's own (`cbrun.engine.SamplingParams`).

    Not vLLM's: the vLLM-compatible `cbrun.SamplingParams` (llm/params.py)
    takes vLLM's fields and becomes one of these through its `to_engine`.

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
        check(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer >= 0 and <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
        )
        check(
            is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be a number >= 0, got {self.temperature!r}",
        )
        check(is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        check(
            all(is_int(t) for t in self.stop_token_ids),
            f"stop_token_ids must be integers, got {self.stop_token_ids!r}",
        )
        check(is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(
            is_int(self.top_logprobs) and self.top_logprobs >= 0,
            f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}",
        )
        check(
            self.structured is None or isinstance(self.structured, StructuredSpec),
            f"structured must be a StructuredSpec or a dict, got {type(self.structured).__name__}",
        )
        check(
            isinstance(self.masked_logprobs, bool), f"masked_logprobs must be a boolean, got {self.masked_logprobs!r}"
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON and Python both let True pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool and not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
