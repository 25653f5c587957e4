"""The continuous-batching engine: no CLI or file code lives here."""

from cbrun.engine.config import ConfigError, EngineConfig, SamplingParams, StatsSnapshot, StructuredSpec
from cbrun.engine.engine import Engine
from cbrun.engine.model_spec import UnsupportedModelError
from cbrun.engine.request import GenerationOutput, RequestStatus, StreamChunk

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "RequestStatus",
    "SamplingParams",
    "StatsSnapshot",
    "StreamChunk",
    "StructuredSpec",
    "UnsupportedModelError",
]
