"""The model's linear layers on CPU: each nn.Linear computes through its layer method, made once at load.

The backend chooses one linear method per weight dtype (linear/method_selector.py)
and this module gives every plain nn.Linear the method of its dtype: the
method packs the layer's weights once (or reads them in place) and computes
the layer for any number of rows in one order, so a request's projections are
the same bits alone or in a step of a thousand rows (batch invariance). BLAS
GEMMs cannot promise that: they pick their blocking over K by the shape of the
call and switch kernels with M.

The patch is per module instance (a `forward` attribute), installed by the
backend for the engine's lifetime; the method then holds the weight (the
module's dense copy is dropped, linear/held_weights.py), and the backend's close
gives both back.
"""

from __future__ import annotations

import torch

from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights
from cbrun.engine.backends.cpu.linear.methods import LayerMethod, LinearMethod, MemberForward
from cbrun.engine.backends.cpu.linear.self_check import Shape


def linear_shapes(
    model: torch.nn.Module, dtype: torch.dtype, only: torch.nn.Module | None = None, skip: torch.nn.Module | None = None
) -> list[Shape]:
    """The distinct (N, K) of the model's plain CPU linears of `dtype` (only the module `only`, or all but `skip`,
    when given): what a method's self-check runs at."""
    modules = [only] if only is not None else [m for m in model.modules() if m is not skip]
    shapes = {
        Shape(m.out_features, m.in_features)
        for m in modules
        if type(m) is torch.nn.Linear and m.weight.dtype == dtype and m.weight.device.type == "cpu"
    }
    return sorted(shapes, key=lambda s: (s.inputs, s.outputs))


def install_linear_methods(
    model: torch.nn.Module, kernels: CpuKernels, methods: dict[torch.dtype, LinearMethod], held: HeldWeights
) -> dict[torch.nn.Linear, LayerMethod | MemberForward]:
    """Route every nn.Linear whose dtype has a method, and that no fused layer holds already, through a layer
    method of it, which then holds its weight (linear/held_weights.py); returns every routed linear's forward by
    module, the fused layers' members included. (A plain output head is projected by the backend itself, to
    fp32 logits, with the same layer method.)"""
    for module in model.modules():
        if module in held.holders:
            continue
        dtype = getattr(getattr(module, "weight", None), "dtype", None)
        method = methods.get(dtype) if dtype is not None else None  # (no method is keyed None)
        if method is not None and method.reads(module):
            layer = method.make(kernels, [module.weight], [module.bias])
            held.route(module, layer)  # per instance; called as module(x): x [..., K] -> [..., N]
            held.hold(module, layer, 0)
    return {module: forward for module, forward in held.forwards.items() if isinstance(module, torch.nn.Linear)}
