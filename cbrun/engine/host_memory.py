"""The process's heap, tuned for an engine's step: keep big freed blocks for the next step, and give memory
back when the engine lets go of a large part of it.

glibc hands every block over its mmap threshold (at most 32 MB with the dynamic threshold) to the kernel on
free, and maps a fresh one on the next allocation, which the kernel must fault in and zero page by page. A
step frees and allocates the same sizes again and again: each decoder layer's MLP intermediate ([T, I] fp32:
tens of MB for a long prefill chunk), the head's logits. Raising the mmap and trim thresholds once keeps
those blocks in the heap to be reused, as tcmalloc or jemalloc would (what vLLM's CPU guide has users
preload). What the heap keeps is bounded by the step's own peak, and `give_back_memory` (sleep, close)
still returns every free page: malloc_trim ignores the thresholds. torch asks for 64-byte-aligned blocks,
which glibc serves with a little slack, so a freed block fits the next request of its size only when its
neighbours are free too: the first few steps may still grow the heap, after which it settles and every
step reuses its blocks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
KEEP_BELOW = 1 << 30  # blocks under 1 GiB come from the heap and stay there when freed


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_blocks() -> bool:
    """Make glibc keep freed blocks under KEEP_BELOW for reuse instead of unmapping them (see the module's
    docstring); whether it took effect (False on a C library without mallopt, such as musl)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BELOW))
    log.debug("heap keeps freed blocks under %d bytes: %s", KEEP_BELOW, kept)
    return kept


def give_back_memory() -> None:
    """Return freed heap memory to the operating system (glibc keeps freed blocks otherwise)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
