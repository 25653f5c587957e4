"""Teacher-forced logprobs of given tokens, computed exactly as sampling computes them.

`generate` records, for each sampled token, the fp32 log-softmax of the
model's logits at temperature 1 (the sampler's normalizer, then
`logit * 1.0 - normalizer`). Scoring must give the same bits for the same
logits, so it takes the same path: the compiled CPU kernel's normalizer and
argmax when the sampler uses it (a greedy row: inverse temperature 1, no
draw), else torch's `logsumexp` and `argmax` as in `sample`.
`tests/engine/test_score_engine.py` checks the two agree bit for bit.

Logprobs are taken per chunk of rows (see `ModelRunner.score_chunks`), so
memory stays at one [rows, V] block whatever the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.sample.kernels import SamplingKernels


@dataclass
class ScoredRows:
    """Per row: the target's logprob, whether it was the argmax, and optional alternatives."""

    logprobs: list[float]
    greedy: list[bool]
    top: list[list[tuple[int, float]]] | None


def score_logits(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int, kernels: SamplingKernels | None = None
) -> ScoredRows:
    """Logprob of targets[i] ([c] int64) under logits[i] ([c, V]) at temperature 1.

    top_k > 0 adds the top_k most likely (token, logprob) pairs per row, most likely first.
    """
    logits = logits.float()  # [c, V]
    targets = targets.to(logits.device)  # [c]
    rows = logits.shape[0]
    if kernels is not None and logits.device.type == "cpu":
        logits = logits.contiguous()
        inv_temp = torch.ones(rows)  # [c] temperature 1
        no_draw = torch.full((rows,), -1.0, dtype=torch.float64)  # [c] -1 = argmax, as a greedy row
        chosen, normalizer = kernels.sample(logits, inv_temp, no_draw)  # [c], [c]
        token_logprobs = logits.gather(1, targets[:, None])[:, 0] * inv_temp - normalizer  # [c]
        scaled = logits * inv_temp[:, None]
    else:
        normalizer = torch.logsumexp(logits, dim=-1)  # [c]
        chosen = torch.argmax(logits, dim=-1)  # [c]
        token_logprobs = (logits.gather(1, targets[:, None]) - normalizer[:, None])[:, 0]  # [c]
        scaled = logits
    top = None
    if top_k > 0:
        top_values, indices = torch.topk(scaled, min(top_k, logits.shape[-1]), dim=-1)  # [c, k]
        values = (top_values - normalizer[:, None]).tolist()
        top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values)]
    return ScoredRows(token_logprobs.tolist(), (chosen == targets).tolist(), top)
