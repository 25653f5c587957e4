"""The model's linear layers on CPU: each nn.Linear computes through its layer method, made once at load.

The backend chooses one linear method per weight dtype (method_selector.py)
and this module gives every plain nn.Linear the method of its dtype: the
method packs the layer's weights once (or reads them in place) and computes
the layer for any number of rows in one order, so a request's projections are
the same bits alone or in a step of a thousand rows (batch invariance). BLAS
GEMMs cannot promise that: they pick their blocking over K by the shape of the
call and switch kernels with M.

The patch is per module instance (a `forward` attribute), installed by the
backend for the engine's lifetime and removed by `uninstall`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cbrun.engine.backends.cpu.kernels import CpuKernels
from cbrun.engine.backends.cpu.linear_methods import LayerMethod, LinearMethod
from cbrun.engine.backends.cpu.self_check import Shape


def linear_shapes(model: torch.nn.Module, dtype: torch.dtype) -> list[Shape]:
    """The distinct (N, K) of the model's plain CPU linears of `dtype`: what a method's self-check runs at."""
    shapes = {
        Shape(m.out_features, m.in_features)
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == dtype and m.weight.device.type == "cpu"
    }
    return sorted(shapes, key=lambda s: (s.inputs, s.outputs))


def install_linear_methods(
    model: torch.nn.Module, kernels: CpuKernels, methods: dict[torch.dtype, LinearMethod]
) -> dict[torch.nn.Linear, LayerMethod]:
    """Route every nn.Linear whose dtype has a method through a layer method of it; returns them by module.
    (A plain output head is projected by the backend itself, to fp32 logits, with the same layer method.)"""
    layers: dict[torch.nn.Linear, LayerMethod] = {}
    for module in model.modules():
        dtype = getattr(getattr(module, "weight", None), "dtype", None)
        method = methods.get(dtype) if dtype is not None else None  # (no method is keyed None)
        if method is not None and method.reads(module):
            layer = method.make(kernels, [module.weight], [module.bias])
            module.forward = layer  # type: ignore[method-assign, assignment]  # per instance; called as module(x): x [..., K] -> [..., N]
            layers[module] = layer
    return layers


def uninstall(modules: Iterable[torch.nn.Module]) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
