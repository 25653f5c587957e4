"""Which compute backend runs the model: chosen by name once, at engine start, and installed on the model.

The table maps each name to a loader; a loader imports its backend package
only when it is asked for, so a CPU-only install never imports Triton code and
base.py never imports the backends built on it.

    choose_backend(model, name, spec, kernels)  ->  a Backend: CpuBackend | CudaBackend | TorchBackend
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from cbrun.engine.backends.base import Backend, BackendUnavailable, TorchBackend
from cbrun.engine.config import BACKEND_NAMES
from cbrun.engine.model_spec import CausalLM, ModelSpec

log = logging.getLogger("cbrun.engine")


def choose_backend(
    model: CausalLM, name: str, spec: ModelSpec, kernels: str = "portable", quantization: str | None = None
) -> Backend:
    """The backend `name` ("auto", "cpu", "torch", "triton") for the model's device, installed on the model.

    "auto": the compiled kernels on CPU (torch when they cannot be built),
    Triton on CUDA when it is installed (else torch). An explicit name that
    cannot run here raises BackendUnavailable. `kernels` is the CPU backend's
    linear-method policy ("portable" or "fastest"); `quantization` ("int8" or None) runs the model's linears
    in W8A8, which only the compiled CPU kernels do (BackendUnavailable elsewhere, "auto" included).
    """
    if name not in BACKEND_NAMES:  # EngineConfig checks too; this is for direct callers
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {', '.join(BACKEND_NAMES)})")
    device = next(model.parameters()).device
    backend = _LOADERS[name](device, kernels, quantization)
    backend.install(model, spec)
    log.info("compute backend: %s", backend.describe())
    return backend


def _torch(device: torch.device, policy: str, quantization: str | None) -> Backend:
    _no_quantization("torch", quantization)
    return TorchBackend()


def _no_quantization(backend: str, quantization: str | None) -> None:
    if quantization is not None:
        raise BackendUnavailable(
            f"quantization {quantization!r} runs on the compiled CPU kernels only, not on {backend}"
        )


def _cpu(device: torch.device, policy: str, quantization: str | None, required: bool = True) -> Backend:
    """The compiled CPU kernels; when not `required` (auto), the torch reference where they cannot be built."""
    if device.type != "cpu":
        raise BackendUnavailable(f"the cpu backend runs models on the CPU; this model is on {device}")
    from cbrun.engine.backends.cpu.backend import CpuBackend
    from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is not None:
        return CpuBackend(kernels, policy, quantization)
    if required or quantization is not None:
        raise BackendUnavailable(
            "the compiled CPU kernels could not be built or are switched off (CBRUN_KERNELS=torch); see the log for why"
        )
    return TorchBackend()


def _triton(device: torch.device, policy: str, quantization: str | None, required: bool = True) -> Backend:
    """Triton attention on CUDA; when not `required` (auto), the torch reference where Triton cannot run."""
    _no_quantization("triton", quantization)
    from cbrun.engine.backends.cuda.backend import CudaBackend, triton_usable

    usable = triton_usable(device)
    if usable is True:
        return CudaBackend(device)
    if required:
        raise BackendUnavailable(f"the triton backend cannot run here: {usable}")
    return TorchBackend()


def _auto(device: torch.device, policy: str, quantization: str | None) -> Backend:
    """The device's own backend where it can run, else the torch reference."""
    if device.type == "cpu":
        return _cpu(device, policy, quantization, required=False)
    return _triton(device, policy, quantization, required=False)


_LOADERS: dict[str, Callable[[torch.device, str, str | None], Backend]] = {
    "auto": _auto,
    "torch": _torch,
    "cpu": _cpu,
    "triton": _triton,
}
