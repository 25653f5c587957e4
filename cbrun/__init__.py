"""cbrun: batch inference for LLMs with an in-process continuous-batching engine."""

__version__ = "0.1.0"

_LLM_API = (
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "UnsupportedFieldError",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "LoRARequest",
)
__all__ = ["__version__", *_LLM_API]


def __getattr__(name: str) -> object:
    """`from cbrun import LLM, SamplingParams` (vLLM's offline API), imported on first use so that
    `import cbrun` stays light for the command line."""
    if name == "LoRARequest":
        from cbrun.lora.request import LoRARequest

        return LoRARequest
    if name in _LLM_API:
        import cbrun.llm

        return getattr(cbrun.llm, name)
    raise AttributeError(f"module 'cbrun' has no attribute {name!r}")
