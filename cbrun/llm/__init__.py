"""vLLM's offline Python API (`LLM`, `SamplingParams`, `RequestOutput`, ...) over cbrun's engine."""

from cbrun.llm.llm import LLM
from cbrun.llm.outputs import CompletionOutput, Logprob, RequestOutput
from cbrun.llm.params import SamplingParams, UnsupportedFieldError

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "UnsupportedFieldError"]
