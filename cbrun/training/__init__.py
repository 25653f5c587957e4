"""Training beside the engine: a trainer's logprobs with the rollout's bits (exact_logprobs.py)."""

from cbrun.training.engine_forward import EngineForward
from cbrun.training.exact_logprobs import ExactLogprobs, TokenLogprobs

__all__ = ["EngineForward", "ExactLogprobs", "TokenLogprobs"]
