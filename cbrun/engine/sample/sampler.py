"""Vectorized sampling and logprobs for one step's sampled sequences.

Reported logprobs are the fp32 log-softmax of the logits divided by the
request's temperature (raw logits when greedy), before top-k / top-p / min-p
filtering: the model's own distribution at that temperature.

Structured outputs: a constrained row's disallowed tokens are set to -inf
before anything else, so sampling (and greedy) only ever picks allowed
tokens; its logprobs stay the model's (before the mask) unless the request
sets `masked_logprobs`. min_tokens goes through the same mask: while a
request has fewer than `min_tokens` tokens, its stop and EOS ids are added
to its row's mask, with the same rule for logprobs.

Randomness is counter-based: each sampled token uses one uniform number
derived from (seed, sample index, token position) by a 64-bit mixer and
inverts the filtered distribution's CDF. A seeded request therefore draws
the same numbers whatever else is in the batch and however it was scheduled.

On an accelerator everything runs on the logits' device: the per-row
parameters go over in one asynchronous copy each, nothing waits on a value
mid-way, and the chosen ids and their logprobs come back in one copy at the
end (top-k alternatives, when asked for, add one more).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbrun.engine.request import Request
from cbrun.engine.sample.kernels import SamplingKernels
from cbrun.engine.sample.token_masks import apply_masks, without_tokens
from cbrun.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def uniform_for(seed: int, sample_index: int, position: int) -> float:
    """A reproducible number in [0, 1) for one (request stream, token position)."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ sample_index) ^ position)
    return (mixed >> 11) * (1.0 / (1 << 53))


@dataclass
class Sampled:
    """Per sampled row: the chosen token, its logprob and optional alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None


def sample(logits: torch.Tensor, requests: Sequence[Request], kernels: SamplingKernels | None = None) -> Sampled:
    """Choose one token per row of `logits` ([N, V]) for the matching request.

    With compiled kernels (the CPU backend passes its own), argmax, log-sum-exp and plain temperature
    draws take one parallel pass per row; rows with top-k / top-p / min-p
    filters then go through the torch filters. Without them, full-vocabulary
    torch passes are kept few: greedy rows need an argmax and a logsumexp;
    sampled rows add one exp and one cumsum (plus a sort only for top-p).

    Rows of requests with a grammar (structured outputs), or still short of
    their `min_tokens`, first have every token their grammar disallows (and
    their stop and EOS ids) set to -inf, in that row only (the mask is the
    request's own, so batch invariance holds). Their logprobs are the
    model's, before the mask, unless the request asks for `masked_logprobs`.
    """
    logits = logits.float()  # [N, V]
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None or r.held_stop_ids]
    if not constrained:
        return _sample(logits, requests, kernels)
    model_rows = [i for i in constrained if not requests[i].sampling.masked_logprobs]
    raw = logits[model_rows].clone() if model_rows else None  # [m, V] the model's logits, before the mask
    apply_masks(logits, constrained, [_row_mask(requests[i], logits.shape[1]) for i in constrained], kernels)
    picked = _sample(logits, requests, kernels)
    if raw is not None:
        _model_logprobs(picked, raw, model_rows, requests, kernels)
    return picked


def _row_mask(request: Request, vocab_size: int) -> torch.Tensor:
    """The packed mask of what the request may pick next: its grammar's, less its held stop ids."""
    mask = request.grammar.allowed_mask() if request.grammar is not None else None
    held = request.held_stop_ids
    if not held:
        assert mask is not None  # a row is masked for its grammar or for held stop ids
        return mask
    return without_tokens(mask, held, vocab_size)


def _model_logprobs(
    picked: Sampled, raw: torch.Tensor, rows: list[int], requests: Sequence[Request], kernels: SamplingKernels | None
) -> None:
    """Replace the masked rows' logprobs (and alternatives) by the unmasked distribution's,
    computed as `_sample` computes them for a free row, so a token's logprob is the same
    whether or not its request was constrained."""
    params = [requests[i].sampling for i in rows]
    chosen = torch.tensor([picked.token_ids[i] for i in rows])  # [m]
    if kernels is not None and raw.device.type == "cpu":
        inv_temp = torch.tensor([1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params])  # [m]
        _, normalizer = kernels.sample(raw.contiguous(), inv_temp, torch.full((len(rows),), -1.0, dtype=torch.float64))
        values = raw.gather(1, chosen[:, None])[:, 0] * inv_temp - normalizer  # [m]
        top = _top_alternatives(raw * inv_temp[:, None], normalizer[:, None], params)
    else:
        if any(p.temperature not in (0, 1) for p in params):
            raw = raw / _on(raw.device, [p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
        normalizer = torch.logsumexp(raw, dim=-1, keepdim=True)  # [m, 1]
        values = (raw.gather(1, chosen.to(raw.device)[:, None]) - normalizer)[:, 0]
        top = _top_alternatives(raw, normalizer, params)
    for j, value in enumerate(values.double().tolist()):
        picked.logprobs[rows[j]] = value
        if top is not None and picked.top is not None:
            picked.top[rows[j]] = top[j]


def _sample(logits: torch.Tensor, requests: Sequence[Request], kernels: SamplingKernels | None) -> Sampled:
    if kernels is not None and logits.device.type == "cpu":
        return _sample_with_kernel(logits.contiguous(), requests, kernels)
    params = [r.sampling for r in requests]
    device = logits.device
    if any(p.temperature not in (0, 1) for p in params):
        temps = _on(device, [p.temperature if p.temperature > 0 else 1.0 for p in params])  # [N]
        logits = logits / temps[:, None]
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = torch.argmax(logits, dim=-1)  # [N] greedy choice
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = _on(device, random_rows, torch.long)
        row_logprobs = logits[rows] - normalizer[rows]  # [n, V]
        chosen[rows] = _sample_rows(row_logprobs, [requests[i] for i in random_rows])
    token_logprobs = (logits.gather(1, chosen[:, None]) - normalizer)[:, 0]  # [N]
    top = _top_alternatives(logits, normalizer, params)
    return _to_host(chosen, token_logprobs, top)


def _on(device: torch.device, values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host list as a tensor on `device`, sent without making the host wait for the device."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":  # pinned memory is CUDA's; elsewhere a plain copy
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _to_host(chosen: torch.Tensor, token_logprobs: torch.Tensor, top: list[list[tuple[int, float]]] | None) -> Sampled:
    """Ids [N] and their logprobs [N] in one device-to-host copy (float64 holds both exactly)."""
    both = torch.stack([chosen.double(), token_logprobs.double()]).tolist()  # [2, N]
    return Sampled([int(token) for token in both[0]], both[1], top)


def _filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0


def _sample_with_kernel(logits: torch.Tensor, requests: Sequence[Request], kernels: SamplingKernels) -> Sampled:
    params = [r.sampling for r in requests]
    inv_temp = torch.tensor([1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params])  # [N]
    uniform = torch.tensor(
        [  # [N] float64; -1 = argmax (greedy, or drawn below after filtering)
            -1.0 if p.greedy or _filtered(p) else uniform_for(r.seed, r.sample_index, r.num_tokens)
            for r, p in zip(requests, params)
        ],
        dtype=torch.float64,
    )
    chosen, normalizer = kernels.sample(logits, inv_temp, uniform)  # [N], [N]
    filtered_rows = [i for i, p in enumerate(params) if not p.greedy and _filtered(p)]
    if filtered_rows:
        rows = torch.tensor(filtered_rows)
        row_logprobs = logits[rows] * inv_temp[rows, None] - normalizer[rows, None]  # [n, V]
        chosen[rows] = _draw_filtered(row_logprobs, [requests[i] for i in filtered_rows], kernels)
    token_logprobs = logits.gather(1, chosen[:, None])[:, 0] * inv_temp - normalizer  # [N]
    top = None
    if any(p.top_logprobs for p in params):
        top = _top_alternatives(logits * inv_temp[:, None], normalizer[:, None], params)
    return _to_host(chosen, token_logprobs, top)


def _sample_rows(logprobs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Filter ([n, V] log-probs) by top-k, top-p, min-p, then invert the CDF (torch: any device)."""
    device = logprobs.device
    filtered = _filter(logprobs, [r.sampling for r in requests])
    probs = filtered.exp_() if filtered is not logprobs else filtered.exp()  # unnormalized when filtered
    cdf = torch.cumsum(probs, dim=-1)  # [n, V]
    draws = _on(device, [uniform_for(r.seed, r.sample_index, r.num_tokens) for r in requests], cdf.dtype)  # [n]
    target = draws[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    picked = picked.clamp_(max=cdf.shape[-1] - 1)
    # never land on a filtered-out token (possible only at float edges); no host round trip to ask whether
    dead = probs.gather(1, picked[:, None])[:, 0] == 0  # [n]
    return torch.where(dead, probs.argmax(dim=-1), picked)


def _draw_filtered(logprobs: torch.Tensor, requests: list[Request], kernels: SamplingKernels) -> torch.Tensor:
    """The compiled path's filtered draw ([n, V] fp32 log-probs -> [n] token ids): cuts that no CPU moves (top-k's
    k-th value, top-p's cut summed by sampling.c, min-p's threshold from the row's maximum), then the kernel's
    own inverse-CDF draw over the kept tokens. torch's exp, softmax and cumsum vectorize by the CPU's ISA, so
    their last bits (and a seeded draw near a boundary) would differ between an AVX2 and an AVX-512 machine."""
    filtered = _filter(logprobs, [r.sampling for r in requests], kernels).contiguous()
    draws = torch.tensor([uniform_for(r.seed, r.sample_index, r.num_tokens) for r in requests], dtype=torch.float64)
    token, _ = kernels.sample(filtered, torch.ones(len(requests)), draws)
    return token


def _filter(
    logprobs: torch.Tensor, params: Sequence[SamplingParams], kernels: SamplingKernels | None = None
) -> torch.Tensor:
    """[n, V] log-probs with the tokens that top-k, top-p and min-p drop at -inf (a new tensor if any drop)."""
    filtered = logprobs
    if any(p.top_k > 0 for p in params):
        filtered = _apply_top_k(filtered, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        filtered = _apply_top_p(filtered, [p.top_p for p in params], kernels)
    if any(p.min_p > 0 for p in params):
        threshold = _on(logprobs.device, [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])  # [n]
        best = filtered.max(dim=-1, keepdim=True).values
        filtered = filtered.masked_fill(filtered < best + threshold[:, None], float("-inf"))
    return filtered


def _apply_top_k(logprobs: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logprobs.shape[-1]
    k_max = min(max(ks), vocab)
    top = torch.topk(logprobs, k_max, dim=-1).values  # [n, k_max]
    index = _on(logprobs.device, [(min(k, vocab) if k > 0 else k_max) - 1 for k in ks], torch.long)
    kth = top.gather(1, index[:, None])  # [n, 1]
    keep_all = _on(logprobs.device, [k == 0 for k in ks], torch.bool)[:, None]
    return logprobs.masked_fill((logprobs < kth) & ~keep_all, float("-inf"))


def _apply_top_p(logprobs: torch.Tensor, ps: list[float], kernels: SamplingKernels | None = None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p (and every token tied with its last)."""
    sorted_lp = torch.sort(logprobs, dim=-1, descending=True).values  # [n, V]: the same values whatever ties' order
    if kernels is not None and logprobs.device.type == "cpu":
        counts = kernels.top_p_counts(sorted_lp, torch.tensor(ps, dtype=torch.float32))  # [n]
    else:
        probs = torch.softmax(sorted_lp, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # [n, V]
        counts = (mass_before < _on(logprobs.device, ps, probs.dtype)[:, None]).sum(dim=-1).clamp_(min=1)
    kth = sorted_lp.gather(1, (counts - 1)[:, None])  # [n, 1] the last kept value
    return logprobs.masked_fill(logprobs < kth, float("-inf"))


def _top_alternatives(
    logits: torch.Tensor, normalizer: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]] | None:
    wanted = [p.top_logprobs for p in params]
    if not any(wanted):
        return None
    k_max = min(max(wanted), logits.shape[-1])
    top_values, top_indices = torch.topk(logits, k_max, dim=-1)
    values, indices = (top_values - normalizer).tolist(), top_indices.tolist()
    return [list(zip(indices[i][:k], values[i][:k])) for i, k in enumerate(wanted)]
