"""cbrun: batch inference for LLMs with an in-process continuous-batching engine."""

__version__ = "0.1.0"
