"""Shared helpers for engine tests: references computed with stock transformers."""

from __future__ import annotations

import random

import torch

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model


def load_pair(spec: str, dtype: str = "float32"):
    """Two copies of a model: one for the engine (its attention gets switched), one as reference."""
    engine_model, tokenizer = load_model(spec, dtype=dtype)
    reference_model, _ = load_model(spec, dtype=dtype)
    return engine_model, reference_model, tokenizer


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def spread(count: int, low: int, high: int) -> list[int]:
    """`count` integers from low to high inclusive, evenly spread, shuffled deterministically."""
    values = [low + round(i * (high - low) / (count - 1)) for i in range(count)]
    random.Random(count * 31 + high).shuffle(values)
    return values


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' model.generate, one prompt at a time, greedy."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """fp32 log-softmax of a plain forward over prompt + completion, at each completion token."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0].float()  # [L, V]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [len(completion), V]
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def run_engine(model, tokenizer, prompts, max_tokens, config: EngineConfig, **sampling) -> list:
    """Greedy (unless overridden) results in prompt order."""
    with Engine(model, tokenizer, config) as engine:
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=m, **{"temperature": 0.0, **sampling}), request_id=f"p{i}")
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        results = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in ids)}
    return [results[i] for i in ids]


def run_requests(model, tokenizer, requests, config: EngineConfig, preempts: str | None = None) -> dict:
    """requests: (id, prompt ids, SamplingParams); returns {id: [(tokens, logprobs) per sample]}.

    `preempts` names a stats counter ("soft_resets", "offloads") that must have counted.
    """
    with Engine(model, tokenizer, config) as engine:
        for request_id, prompt, sampling in requests:
            engine.add_request(prompt, sampling, request_id=request_id)
        outputs = [engine.get_result(timeout=600) for _ in range(sum(r[2].n for r in requests))]
        stats = engine.stats()
    if preempts:
        assert getattr(stats, preempts) > 0, preempts
    results: dict = {}
    for out in outputs:
        assert out.finish_reason in ("length", "stop"), out.error
        results.setdefault(out.request_id, {})[out.sample_index] = (list(out.token_ids), list(out.logprobs))
    return {key: [value[i] for i in sorted(value)] for key, value in results.items()}
