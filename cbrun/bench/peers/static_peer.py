"""Peer `hf-static`: `model.generate` over left-padded static batches, the baseline every user starts from.

Requests are taken in workload order in batches of `--static-batch-size`.
A batch generates as many tokens as its longest request asks for (that waste
is the cost of static batching), and only each request's real output tokens
are counted: its requested length under ignore-EOS (EOS suppressed with
`min_new_tokens`), else up to and including its first EOS. TTFT is measured
per batch: the time its first token came out, from the start of the pass.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from transformers import StoppingCriteria

from cbrun.bench.peers import PeerContext
from cbrun.bench.result import PeerResult
from cbrun.bench.workload import Workload

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig


def run(ctx: PeerContext, workload: Workload, warmup: Workload) -> PeerResult:
    _run_pass(ctx, warmup, "hf-static warm-up")
    result = _run_pass(ctx, workload, "hf-static")
    result.notes.append(f"static batches of {ctx.static_batch_size}, left-padded")
    result.details["static_batch_size"] = ctx.static_batch_size
    return result


def _run_pass(ctx: PeerContext, workload: Workload, label: str) -> PeerResult:
    import torch

    n = workload.n
    prompts = [p for p in workload.prompts for _ in range(n)]  # prompt-major, sample-minor
    lens = [o for o in workload.output_lens for _ in range(n)]
    pad_id, eos_ids = _pad_and_eos(ctx)
    size = ctx.static_batch_size
    counts = [0] * workload.num_prompts
    ttfts: list[float] = []
    torch.manual_seed(workload.seed)
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        batch, batch_lens = prompts[first : first + size], lens[first : first + size]
        input_ids, mask = _left_pad(batch, pad_id, ctx.model.device)
        clock = _FirstTokenClock()
        with torch.inference_mode():
            out = ctx.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=_generation_config(workload, max(batch_lens), pad_id, eos_ids),
                stopping_criteria=[clock],
            )
        generated = out[:, input_ids.shape[1] :].tolist()  # [batch, new_tokens]
        for j, tokens in enumerate(generated):
            counts[(first + j) // n] += _real_tokens(tokens, batch_lens[j], eos_ids, workload.ignore_eos)
        if clock.first_time is not None:
            ttfts.extend([clock.first_time - start] * len(batch))
        ctx.progress.update(label, min(first + size, len(prompts)), len(prompts), force=first + size >= len(prompts))
    wall = time.perf_counter() - start
    return PeerResult(
        "hf-static",
        wall_s=wall,
        num_requests=workload.num_prompts,
        num_input_tokens=workload.num_input_tokens,
        output_counts=counts,
        ttfts=ttfts,
    )


def _real_tokens(tokens: list[int], requested: int, eos_ids: set[int], ignore_eos: bool) -> int:
    """Tokens this request really produced: its length under ignore-EOS, else up to its first EOS."""
    tokens = tokens[:requested]
    if ignore_eos:
        return len(tokens)
    for k, t in enumerate(tokens):
        if t in eos_ids:
            return k + 1
    return len(tokens)


def _pad_and_eos(ctx: PeerContext) -> tuple[int, set[int]]:
    eos = getattr(getattr(ctx.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = ctx.tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    pad = ctx.tokenizer.pad_token_id
    if pad is None:
        pad = min(eos_ids) if eos_ids else 0
    return pad, eos_ids


def _left_pad(batch: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _generation_config(workload: Workload, max_new: int, pad_id: int, eos_ids: set[int]) -> GenerationConfig:
    """Every sampling field set explicitly, so the model's own generation defaults (top-k 50 ...) do not leak in."""
    from transformers import GenerationConfig

    sampling = workload.temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=max_new if workload.ignore_eos else 0,
        do_sample=sampling,
        temperature=workload.temperature if sampling else 1.0,
        top_k=0 if sampling else None,
        top_p=1.0,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids) or None,
        num_beams=1,
    )


class _FirstTokenClock(StoppingCriteria):
    """A stopping criterion that never stops: `generate` calls it after each new token, so its first call times TTFT."""

    def __init__(self) -> None:
        self.first_time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        if self.first_time is None:
            self.first_time = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
