"""vLLM's `SamplingParams`, field for field, and what it becomes for cbrun's engine.

Every field vLLM's offline API takes is accepted by name. Those cbrun does
not implement raise `UnsupportedFieldError` naming the field as soon as they
hold anything but their neutral default; nothing is silently ignored.
Unknown names raise TypeError, as a dataclass does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from cbrun.engine.sampling_params import SamplingParams as EngineSampling, StructuredSpec

_SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy

# field -> (neutral value, why cbrun cannot honour another)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "best_of": (None, "cbrun has no best-of ranking; sample n and rank them yourself"),
    "presence_penalty": (0.0, "cbrun's sampler has no repetition penalties"),
    "frequency_penalty": (0.0, "cbrun's sampler has no repetition penalties"),
    "repetition_penalty": (1.0, "cbrun's sampler has no repetition penalties"),
    "bad_words": (None, "cbrun's sampler cannot ban words"),
    "logit_bias": (None, "cbrun's sampler has no logit bias"),
    "allowed_token_ids": (None, "cbrun's sampler cannot restrict the vocabulary"),
    "logits_processors": (None, "cbrun runs no user logits processors"),
    "truncate_prompt_tokens": (None, "cbrun does not truncate prompts"),
    "spaces_between_special_tokens": (True, "cbrun decodes with the tokenizer's default spacing"),
    "output_kind": (None, "cbrun's LLM returns final outputs only"),
    "extra_args": (None, "cbrun takes no extra sampling arguments"),
}


class UnsupportedFieldError(ValueError):
    """A vLLM option cbrun does not implement was given a value; the message names it."""


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint (also its older name, GuidedDecodingParams): give one of
    json (a schema, dict or JSON text), json_object, regex, choice, grammar (Lark or GBNF)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        for name, neutral in (
            ("backend", None),
            ("whitespace_pattern", None),
            ("structural_tag", None),
            ("disable_any_whitespace", False),
            ("disable_additional_properties", False),
        ):
            if getattr(self, name) != neutral:
                raise UnsupportedFieldError(
                    f"StructuredOutputsParams.{name} is not supported by cbrun "
                    f"(its grammar engine is llguidance, as configured); leave it at {neutral!r}"
                )

    def to_spec(self) -> StructuredSpec | None:
        return StructuredSpec.from_fields(
            json_schema=self.json,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
        )


GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """Sampling parameters for text generation, as vLLM's offline API takes them.

    `cbrun.SamplingParams`; `to_engine` makes the engine's own `cbrun.engine.SamplingParams`
    (engine/sampling_params.py, imported here as `EngineSampling`), which the CLI and `Engine` take.

    n: samples per prompt. temperature: 0 (or below 1e-5) is greedy.
    top_p, top_k (0 or -1: off), min_p, seed (per request; else drawn from the LLM's seed).
    max_tokens: new tokens at most (None: up to the context length). stop: strings that end a
    completion (cut from the text unless include_stop_str_in_output); stop_token_ids: ids that do.
    ignore_eos: keep going past EOS. min_tokens: no EOS, stop id or stop string ends a completion
    before it has this many tokens. logprobs: K alternatives per generated token (0: the
    sampled token only; -1: the whole vocabulary). prompt_logprobs: the same for every prompt
    token (teacher-forced scoring of the prompt). detokenize, skip_special_tokens: how `text` is made.
    structured_outputs (or guided_decoding): a StructuredOutputsParams the output must satisfy.
    Logprobs are vLLM's default kind: the log-softmax of the model's raw logits (temperature 1),
    before any filtering.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: Any = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of == self.n:
            self.best_of = None  # vLLM's own default: best_of = n
        for name, (neutral, why) in UNSUPPORTED.items():
            if getattr(self, name) != neutral:
                raise UnsupportedFieldError(
                    f"SamplingParams.{name} is not supported by cbrun ({why}); leave it at {neutral!r}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"SamplingParams.{name} must be None, -1 (whole vocabulary) or an integer >= 0, got {value!r}"
                )
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, StructuredOutputsParams(**value))
            elif value is not None and not isinstance(value, StructuredOutputsParams):
                raise TypeError(
                    f"SamplingParams.{name} must be cbrun.StructuredOutputsParams or a dict, got {type(value).__name__}"
                )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(
                f"SamplingParams.min_tokens must be an integer >= 0 and <= max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens!r}"
            )
        self.to_engine(max_tokens=1, vocab_size=1)  # the engine's own checks, named by field

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def to_engine(self, max_tokens: int, vocab_size: int, seed: int | None = None) -> EngineSampling:
        """The engine's parameters for one prompt (its max_tokens and seed decided by the caller;
        min_tokens is cut to it, as vLLM stops at the context's end whatever min_tokens says)."""
        return EngineSampling(
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            temperature=0.0 if self.greedy else self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed if self.seed is not None else seed,
            stop=tuple(self.stop_strings),
            stop_token_ids=tuple(self.stop_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            top_logprobs=_count(self.logprobs, vocab_size),
            structured=self.constraint.to_spec() if self.constraint is not None else None,
        )

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as __post_init__ leaves it, a list (the field's type is what callers may pass)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def stop_ids(self) -> list[int]:
        """`stop_token_ids` as a list (None given: none)."""
        return list(self.stop_token_ids or [])

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        value = self.structured_outputs or self.guided_decoding
        assert not isinstance(value, dict)  # __post_init__ made it a StructuredOutputsParams
        return value

    def clone(self) -> SamplingParams:
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})


def _count(k: int | None, vocab_size: int) -> int:
    """vLLM's logprobs count: None and 0 ask for no alternatives, -1 for the whole vocabulary."""
    if k is None:
        return 0
    return vocab_size if k == -1 else k


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
