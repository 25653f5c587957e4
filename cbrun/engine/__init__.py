"""The continuous-batching engine: no CLI or file code lives here."""

from cbrun.engine.config import ConfigError, EngineConfig
from cbrun.engine.engine import Engine
from cbrun.engine.model_spec import UnsupportedModelError
from cbrun.engine.request import GenerationOutput, RequestStatus, StreamChunk
from cbrun.engine.sampling_params import SamplingParams, StructuredSpec
from cbrun.engine.stats import StatsSnapshot

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
