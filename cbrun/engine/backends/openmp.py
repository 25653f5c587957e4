"""One OpenMP thread pool per process: free the caller's before the engine thread computes.

OpenMP keeps a pool of worker threads per thread that opens parallel regions.
The caller's thread opens some while it loads the model and the engine core
probes its fused layers; then the engine's own thread steps the model and
opens a second pool. libgomp lets idle workers spin only while the threads
it manages are no more than the CPUs (`gomp_throttled_spin_count_var` in its
wait code); past that, every worker goes to sleep between parallel regions
and each of the thousands of regions in a step waits for a futex wake-up
(docs/performance.md has what that cost). `omp_pause_resource_all` (OpenMP
5.0) frees the calling thread's pool, so the engine thread's pool is the only
one while it runs.

torch's own CPU ops and the compiled kernels share the one OpenMP runtime, so
the torch backend does this in its `before_loop_thread` hook (base.py), and
every backend built on it inherits it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger("cbrun.engine")

_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU, Intel and LLVM OpenMP
_OMP_PAUSE_SOFT = 1


def release_caller_threads() -> bool:
    """Free the calling thread's idle OpenMP workers; False when no OpenMP runtime is loaded or it cannot."""
    path = _loaded_runtime()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all  # the loaded copy: dlopen returns its handle
    except (OSError, AttributeError):
        return False
    pause.restype = ctypes.c_int
    status = pause(ctypes.c_int(_OMP_PAUSE_SOFT))
    if status != 0:
        log.debug("omp_pause_resource_all returned %d", status)
    return status == 0


def _loaded_runtime() -> str | None:
    """The path of the OpenMP runtime mapped into this process (Linux), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(_RUNTIMES):
            return fields[5].strip()
    return None
