"""The compiled calls that sampling, scoring and token masks use, as a backend hands them over.

The sampler, scoring and the token masks (token_masks.py) run on torch alone; a
backend with compiled kernels (the CPU backend) passes its kernels object in,
and these are the only calls they make of it. Declared here so that nothing
in sample/ imports a backend.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SamplingKernels(Protocol):
    """One parallel pass per logits row for sampling and scoring, and the packed token masks."""

    def sample(
        self, logits: torch.Tensor, inv_temp: torch.Tensor, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of fp32 `logits` [N, V]: (token [N] int64, logsumexp(logits * inv_temp) [N] fp32); a row
        with a negative `uniform` (float64) takes the argmax, the others invert the CDF at their number."""
        ...

    def top_p_counts(self, sorted_logprobs: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        """Per row of log-probs sorted descending [n, V] fp32 and top_p [n] fp32: how many leading tokens top-p
        keeps [n] int64, summed in an order no CPU changes."""
        ...

    def apply_token_masks(self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
        """Set to -inf, in place, the logits of `rows` [r] (int64) whose bit in `masks` [r, W] (int32) is 0."""
        ...
