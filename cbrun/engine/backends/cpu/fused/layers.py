"""Fused decoder layers on CPU: one pass of compiled kernels per layer (fp32).

A stock Llama-style decoder layer runs 40-odd small torch ops per call
(RMSNorm's pow/mean/rsqrt/mul, rotary's slices/cat/neg, SiLU, views,
residual adds) and seven linear calls. At decode sizes the dispatch of those
ops costs more than their arithmetic: about 10 ms of a 100 ms step at 32 rows
on the default model. The fused forward computes the same function in seven
kernel calls:

    norm -> q|k|v (one pass over three weights) -> rotary (in place)
    -> the model's attention function (ours: the paged cache)
    -> o_proj -> residual add + norm -> silu(gate) * up (one pass)
    -> down -> residual add

It applies to layers shaped like Llama's (Llama, Mistral, Qwen2, Qwen3 with
its per-head q/k norms, SmolLM, ...): the structure is checked, and then each
distinct layer is run both ways on random inputs at install time
(fused/probe.py); a layer whose fused result differs from its stock forward
keeps the stock forward. Every
projection goes through the compiled linear kernel, whose sums do not depend
on the number of rows (batch invariance).

Installed per module instance (a `forward` attribute) by the CPU backend,
which removes it at close, like the kernel linears' (linear/held_weights.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cbrun.engine.backends.cpu.fused.probe import INT8_PROBE_TOLERANCE, probe, probe_key, register_probe_attention
from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights
from cbrun.engine.backends.cpu.linear.methods import LayerMethod, LinearMethod, MemberForward
from cbrun.engine.model_spec import CausalLM
from cbrun.lora.step import LORA_KWARG, StepLoRA

if TYPE_CHECKING:
    from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels

# A transformers decoder layer or attention module: its parts (self_attn, mlp, norms; config, scaling,
# sliding_window) are read by name, as the architecture defines them.
Layer = Any

log = logging.getLogger("cbrun.engine")

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_HEAD_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_CACHE_KWARGS = ("cache", "past_key_values")


@dataclass
class Norm:
    """An RMS norm's weight in fp32 (a bf16 weight widened, exactly) and epsilon, read from its module."""

    module: Any  # the norm module (its weight is read by name)
    eps: float
    weight: torch.Tensor = field(init=False)  # [D] fp32

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        self.weight = self.module.weight.detach().float().contiguous()


@dataclass
class LayerPlan:
    """What the fused forward needs of one layer, read once at install."""

    layer: Layer
    attention: Layer
    input_norm: Norm
    post_norm: Norm
    q_norm: Norm | None
    k_norm: Norm | None
    qkv: list[torch.nn.Linear]
    o_proj: torch.nn.Linear
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the layer's weights and hidden states (float32 or bfloat16)
    # the layer methods, made once at install: q|k|v in one pass, o, silu(gate) * up in one pass, down
    qkv_method: LayerMethod | None = None
    o_method: LayerMethod | None = None
    gated_method: LayerMethod | None = None
    down_method: LayerMethod | None = None

    def make_methods(self, method: LinearMethod, kernels: CpuKernels, held: HeldWeights) -> None:
        """Give the plan its layer methods (weights packed or read in place, as the method does); each method
        then holds its linears' weights, and each linear computes as its member of the method."""
        groups: list[tuple[list[torch.nn.Linear], bool]] = [
            (self.qkv, False),
            ([self.o_proj], False),
            ([self.gate, self.up], True),
            ([self.down], False),
        ]
        made = []
        for linears, gated in groups:
            layer = method.make(kernels, [lin.weight for lin in linears], [lin.bias for lin in linears], gated=gated)
            for index, linear in enumerate(linears):
                held.route(linear, MemberForward(layer, index))
                held.hold(linear, layer, index)  # the dense copy goes now: packing streams layer by layer
            made.append(layer)
        self.qkv_method, self.o_method, self.gated_method, self.down_method = made

    def unfuse(self, method: LinearMethod, kernels: CpuKernels, held: HeldWeights) -> None:
        """Give each linear a layer method of its own (the layer keeps the stock forward, which calls them one by
        one), moving its weight out of the fused methods, which are freed."""
        fused = [self.qkv_method, self.o_method, self.gated_method, self.down_method]
        for linear in [*self.qkv, self.o_proj, self.gate, self.up, self.down]:
            owner, index = held.holders[linear]
            own = method.make(kernels, [owner.weight(index)], [linear.bias])
            held.route(linear, own)
            held.hold(linear, own, 0)
        for layer in fused:
            if layer is not None:
                layer.release()
        self.qkv_method = self.o_method = self.gated_method = self.down_method = None

    def refresh_norms(self) -> None:
        """Read the norms' weights again (after new weights were loaded into the model)."""
        for norm in (self.input_norm, self.post_norm, self.q_norm, self.k_norm):
            if norm is not None:
                norm.refresh()


def install_fused_layers(
    model: CausalLM, kernels: CpuKernels | None, method: LinearMethod | None, held: HeldWeights
) -> list[LayerPlan]:
    """Give every decoder layer of `model` that passes its probe the fused forward, its projections
    through layer methods of `method` that hold their weights (`held`); returns the fused layers' plans.

    The probe runs both forwards through a causal attention of our own in plain
    torch ops (`probe_attention`, switched on and back for the probe), so any
    attention implementation may be set when called. Not torch's SDPA: its bf16
    kernel refuses to run under ATEN_CPU_CAPABILITY=avx2 on an AMX CPU, and a
    probe that fails leaves the layers unfused, with other bits.
    Layers alike in everything but their weights (`_probe_key`) share one
    probe: the probe checks the code a layer runs, which the weights do not change.
    A layer that fails it keeps the stock forward, its linears each with a
    method of their own.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if kernels is None or method is None or layers is None or rotary is None:
        return []
    plans = [(layer, plan) for layer in layers if (plan := _plan(layer, method)) is not None]
    for _, plan in plans:
        plan.make_methods(method, kernels, held)
    if not plans:
        return []
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(register_probe_attention())  # a pure function of q, k, v for the probe
    except Exception as exc:  # a model that takes no registered attention: no probe, no fusion
        log.info("fused CPU decoder layers off: %s", exc)
        verified = []
    else:
        try:
            tolerance = INT8_PROBE_TOLERANCE if method.kernel == "int8" else None
            outcomes: dict[tuple, bool] = {}  # one probe per distinct layer: an 8B model's 32 layers probe once
            for layer, plan in plans:
                key = probe_key(layer, held)
                if key not in outcomes:
                    fused = functools.partial(_fused_call, kernels=kernels, stock_forward=layer.forward)
                    outcomes[key] = probe(layer, plan, fused, rotary, tolerance)
            verified = [(layer, plan) for layer, plan in plans if outcomes[probe_key(layer, held)]]
        finally:
            model.set_attn_implementation(previous)
    for _, plan in plans:
        if all(plan is not kept for _, kept in verified):
            plan.unfuse(method, kernels, held)
    for layer, plan in verified:
        held.route(layer, functools.partial(fused_forward, plan, kernels, layer.forward))
    if verified:
        log.info("fused CPU decoder layers: %d of %d", len(verified), len(layers))
    return [plan for _, plan in verified]


def fused_forward(
    plan: LayerPlan,
    kernels: CpuKernels,
    stock_forward: Callable[..., Any],
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The decoder layer's forward: hidden [1, T, hidden] -> [1, T, hidden]."""
    function: Callable[..., Any] | None = ALL_ATTENTION_FUNCTIONS.get_interface(
        plan.attention.config._attn_implementation,
        None,  # type: ignore[arg-type]  # annotated Callable, but a default of None comes back as given
    )
    if (
        function is None
        or position_embeddings is None
        or hidden_states.dtype != plan.dtype
        or hidden_states.shape[0] != 1
        or hidden_states.stride(-1) != 1
        or any(kwargs.get(k) is not None for k in _CACHE_KWARGS)
    ):
        # not the engine's call: the stock forward
        return stock_forward(
            hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs
        )
    assert plan.o_method is not None and plan.gated_method is not None and plan.down_method is not None  # installed
    lora: StepLoRA | None = kwargs.pop(LORA_KWARG, None)  # the step's rows that run LoRA adapters (lora/step.py)
    x = hidden_states[0].float()  # [T, hidden] fp32 (bf16 widens exactly): the residual stream within the layer
    normed, _ = kernels.rmsnorm(x, plan.input_norm.weight, plan.input_norm.eps)
    attended = _attention(plan, kernels, function, normed, position_embeddings, attention_mask, kwargs, lora=lora)
    projected = plan.o_method(attended, torch.float32)  # [T, hidden]
    if lora is not None:
        lora.add(plan.o_proj, attended, projected)
    normed, residual = kernels.rmsnorm(x, plan.post_norm.weight, plan.post_norm.eps, delta=projected)
    gated_method = plan.gated_method
    if lora is not None and lora.adapts(plan.gate, plan.up):  # every row from gate and up sums, deltas in between
        gated = lora.gated(plan.gate, plan.up, normed, gated_method.gated_sums, kernels.silu_mul).to(plan.dtype)
    else:
        gated = gated_method(normed, plan.dtype)  # [T, I]: the down projection reads it in the model's dtype
    down = plan.down_method(gated, torch.float32)  # [T, hidden]
    if lora is not None:
        lora.add(plan.down, gated, down)
    return (residual + down).to(plan.dtype).unsqueeze(0)


def _fused_call(
    plan: LayerPlan, hidden: torch.Tensor, *, kernels: CpuKernels, stock_forward: Callable[..., Any], **kwargs: Any
) -> torch.Tensor:
    """fused_forward with the plan and hidden states first (as the probe calls it)."""
    return fused_forward(plan, kernels, stock_forward, hidden, **kwargs)


def _attention(
    plan: LayerPlan,
    kernels: CpuKernels,
    function: Callable[..., Any],
    normed: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    *,
    lora: StepLoRA | None = None,
) -> torch.Tensor:
    """normed [T, hidden] -> attention output [T, H * D] through the model's attention function."""
    tokens = normed.shape[0]
    heads, kv_heads, dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
    assert plan.qkv_method is not None  # made at install
    qkv = plan.qkv_method(normed, torch.float32)  # [T, (H + 2 H_kv) D] fp32 sums
    if lora is not None:  # each member's columns, before the head norms and rotary: one call for all three
        bounds = [0]
        for linear in plan.qkv:
            bounds.append(bounds[-1] + linear.out_features)
        lora.add_members(plan.qkv, normed, [qkv[:, lo:hi] for lo, hi in itertools.pairwise(bounds)])
    if plan.q_norm is not None:
        assert plan.k_norm is not None  # the head norms come as a pair
        qkv[:, : heads * dim], _ = kernels.rmsnorm(qkv[:, : heads * dim], plan.q_norm.weight, plan.q_norm.eps)
        k_cols = slice(heads * dim, (heads + kv_heads) * dim)
        qkv[:, k_cols], _ = kernels.rmsnorm(qkv[:, k_cols], plan.k_norm.weight, plan.k_norm.eps)
    cos, sin = _rope_tables(position_embeddings)  # [T, D] each
    kernels.rope(qkv, heads + kv_heads, cos, sin)  # q and k heads are adjacent
    qkv = qkv.to(plan.dtype)  # the attention and the KV cache in the model's dtype
    per_head = qkv.view(tokens, heads + 2 * kv_heads, dim).transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
    query = per_head[:, :heads]
    key = per_head[:, heads : heads + kv_heads]
    value = per_head[:, heads + kv_heads :]
    attention = plan.attention
    kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}  # the stock forward's own arguments
    if hasattr(attention, "sliding_window"):
        kwargs["sliding_window"] = attention.sliding_window
    out, _ = function(
        attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs
    )  # [1, T, H, D]
    return out.reshape(tokens, heads * dim)


_last_rope_tables: tuple = (None, None, None)  # (the model's cos, its sin, their fp32 contiguous copies)


def _rope_tables(position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin as fp32 contiguous [T, D] tables.

    Every layer of one forward receives the same two tensors, so they are
    converted once per step, not once per layer. The cache is one tuple,
    replaced whole, so engines stepping in other threads never see half of it.
    """
    global _last_rope_tables
    cos, sin = position_embeddings
    last = _last_rope_tables
    if last[0] is cos and last[1] is sin:
        return last[2]
    tables = (cos[0].float().contiguous(), sin[0].float().contiguous())
    _last_rope_tables = (cos, sin, tables)
    return tables


# -- install-time checks ----------------------------------------------------------


def _plan(layer: Layer, method: LinearMethod) -> LayerPlan | None:
    """The layer's parts when it has exactly a Llama-style layer's structure (fp32 on CPU), else None."""
    if _children(layer) != _LAYER_PARTS:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    attention_parts = _children(attention)
    has_head_norms = attention_parts == _ATTENTION_PARTS | _HEAD_NORMS
    if (attention_parts != _ATTENTION_PARTS and not has_head_norms) or _children(mlp) != _MLP_PARTS:
        return None
    linears = [getattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if not all(method.reads(lin) for lin in linears):
        return None
    dim = getattr(attention, "head_dim", None)
    if (
        not isinstance(dim, int)
        or dim % 2
        or not hasattr(attention, "scaling")
        or not hasattr(getattr(attention, "config", None), "_attn_implementation")
    ):
        return None
    input_norm, post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    head_norms = [_norm(attention.q_norm), _norm(attention.k_norm)] if has_head_norms else [None, None]
    if input_norm is None or post_norm is None or (has_head_norms and None in head_norms):
        return None
    q, k, v, o = linears[:4]
    if q.out_features % dim or k.out_features % dim or k.out_features != v.out_features:
        return None
    return LayerPlan(
        layer=layer,
        attention=attention,
        input_norm=input_norm,
        post_norm=post_norm,
        q_norm=head_norms[0],
        k_norm=head_norms[1],
        qkv=[q, k, v],
        o_proj=o,
        gate=mlp.gate_proj,
        up=mlp.up_proj,
        down=mlp.down_proj,
        num_heads=q.out_features // dim,
        num_kv_heads=k.out_features // dim,
        head_dim=dim,
        dtype=q.weight.dtype,
    )


def _children(module: torch.nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _norm(module: object) -> Norm | None:
    """An RMS norm's weight and epsilon, if it has the usual attributes (its formula is probed later)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not weight.is_contiguous()
        or not isinstance(eps, float)
    ):
        return None
    return Norm(module, eps)
