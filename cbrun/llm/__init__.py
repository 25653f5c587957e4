"""vLLM's offline Python API (`LLM`, `SamplingParams`, `RequestOutput`, ...) over cbrun's engine."""

from cbrun.llm.llm import LLM
from cbrun.llm.outputs import CompletionOutput, Logprob, RequestOutput
from cbrun.llm.params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams, UnsupportedFieldError

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedFieldError",
]
