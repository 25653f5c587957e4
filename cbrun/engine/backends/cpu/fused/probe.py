"""The install-time probe of a fused decoder layer: does the fused forward compute what the layer's own does?

Both forwards run on random inputs through `probe_attention`, a causal attention in plain torch ops registered
for the probe (not torch's SDPA, whose bf16 kernel refuses to run under ATEN_CPU_CAPABILITY=avx2 on AMX CPUs:
a failed probe leaves a layer unfused, with other bits). Layers equal in everything but their weights
(`probe_key`) run the same code, so they share one probe: an 8B model's 32 layers probe once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

# A transformers decoder layer (its modules and settings are read generically).
Layer = Any

log = logging.getLogger("cbrun.engine")

# a decode-sized step and a prefill-sized one: past the kernels' row blocks (8, 16, 32), small enough that a probe
# at 8B shapes takes a second (the kernels' own invariance at every row count is the self-check's)
_PROBE_TOKENS = (5, 67)
# relative to the output's largest magnitude: fp32 sums in another order; bf16 rounds at other points than the
# stock forward (which rounds after every op) but a wrong formula still misses by O(1)
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
# int8 (either dtype): the stock forward's norms round the rows at other points, and a row's quantized values move
# by one step where a value lies near a rounding edge; a wrong formula still misses by O(1)
INT8_PROBE_TOLERANCE = 4e-2


PROBE_ATTENTION = "cbrun_probe"


def probe_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention in plain torch ops, for the probe: query [B, H, T, D], key and value [B, H_kv, T, D] ->
    [B, T, H, D]; scores and softmax in fp32, any number of query heads per KV head. A sliding window passed
    in kwargs is not applied (as SDPA without a mask): the two forwards pass it differently (the stock one from
    the config, the fused one from the module), and the engine's own attention applies the model's window."""
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1).float()  # [B, H, T, D]
    values = value.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(query.float(), keys.transpose(-1, -2)) * scaling  # [B, H, T, T]
    tokens = query.shape[2]
    position = torch.arange(tokens)
    hidden = position[None, :] > position[:, None]  # [T, T] keys after the query
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values).to(query.dtype)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def register_probe_attention() -> str:
    ALL_ATTENTION_FUNCTIONS.register(PROBE_ATTENTION, probe_attention)
    return PROBE_ATTENTION


def probe_key(layer: Layer, held: HeldWeights) -> tuple:
    """What decides the function a layer computes, apart from its weights: each submodule's class and any forward
    set on the instance (by kind where it is a layer method `held` routed), its parameters' shapes and dtypes, and
    its plain settings (eps, scaling, sliding window, attention type, ...; the layer index aside). Layers with
    equal keys run the same code."""
    key = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted(
                (attr, value)
                for attr, value in vars(module).items()
                if attr != "layer_idx" and (value is None or isinstance(value, (bool, int, float, str)))
            )
        )
        forward = module.__dict__.get("forward")
        own_forward = type(forward) if held.forwards.get(module) is forward else id(forward) if forward else None
        parameters = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters(recurse=False))
        key.append((name, type(module), own_forward, settings, parameters))
    return tuple(key)


@torch.inference_mode()
def probe(
    layer: Layer,
    plan: Any,
    fused: Callable[..., torch.Tensor],
    rotary: Callable[..., Any],
    tolerance: float | None = None,
) -> bool:
    """Whether `fused(plan, hidden, ...)` (the fused forward) reproduces the layer's stock forward on random inputs,
    through the attention set on the model (`probe_attention` while installing), within `tolerance` of the
    output's largest magnitude (default: the layer dtype's)."""
    generator = torch.Generator().manual_seed(0)
    hidden = plan.input_norm.weight.numel()
    for tokens in _PROBE_TOKENS:
        x = torch.randn(1, tokens, hidden, generator=generator).to(plan.dtype)
        positions = torch.arange(3, 3 + tokens).unsqueeze(0)
        embeddings = rotary(x, positions)
        try:
            expected = layer(x, position_ids=positions, position_embeddings=embeddings)
            got = fused(plan, x, position_ids=positions, position_embeddings=embeddings)
        except Exception as exc:  # an unexpected signature or shape: keep the stock forward
            log.info("fused layer probe failed for %s: %s", type(layer).__name__, exc)
            return False
        expected = expected[0] if isinstance(expected, tuple) else expected
        scale = expected.abs().max().item() or 1.0
        allowed = (tolerance or _PROBE_TOLERANCE[plan.dtype]) * scale
        if not torch.allclose(got.float(), expected.float(), rtol=0, atol=allowed):
            log.info(
                "fused layer differs from %s's forward (max error %.3g); keeping the stock one",
                type(layer).__name__,
                (got - expected).abs().max().item(),
            )
            return False
    return True
