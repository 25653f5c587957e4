"""The compiled CPU kernels, loaded once per process: built (build/kernel_build.py), bound to their typed seam
(kernels/abi.py), their ISA variants scored (kernels/isa_variants.py), then wrapped (kernels.py).

Without a compiler, or with CBRUN_KERNELS=torch, there are none and the engine
uses the torch paths, which compute the same results up to rounding (and are
the reference in tests).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from cbrun.engine.backends.cpu.build import kernel_build
from cbrun.engine.backends.cpu.kernels.abi import bind
from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.kernels.isa_variants import score_variants

log = logging.getLogger("cbrun.engine")

_lock = threading.Lock()
_loaded: list[CpuKernels | None] = []  # the process's kernels once tried: [kernels] or [None]


def build_kernels(defines: tuple[str, ...] = ()) -> CpuKernels:
    """The kernels built with extra `-D` definitions (such as "CBRUN_VEC_WIDTH=16", which forces the linear
    kernels' vector width: tests), cached beside the default build under a name that includes them. Raises
    where the library cannot be built; load_cpu_kernels() is what the engine uses."""
    library = bind(ctypes.CDLL(str(kernel_build.library(defines))))
    return CpuKernels(library, score_variants(library))


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when they cannot be built or are switched off."""
    if os.environ.get("CBRUN_KERNELS", "").lower() == "torch":
        return None
    with _lock:
        if not _loaded:
            try:
                _loaded.append(build_kernels())
            except Exception as exc:  # no compiler, failed build, unsupported platform
                detail = getattr(exc, "stderr", "") or exc
                log.warning("compiled CPU kernels unavailable (%s); using the torch paths", detail)
                _loaded.append(None)
        return _loaded[0]
