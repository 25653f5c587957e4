"""vLLM's Python API (`LLM`, `AsyncLLM`, `SamplingParams`, `RequestOutput`, ...) over cbrun's engine."""

from cbrun.llm.async_llm import AsyncLLM
from cbrun.llm.llm import LLM
from cbrun.llm.outputs import CompletionOutput, Logprob, RequestOutput
from cbrun.llm.params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams, UnsupportedFieldError

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedFieldError",
]
