"""Optional compiled CPU kernel for paged decode attention, built once per machine.

The kernel reads keys and values in place from the page pool, where the
pure-torch path first gathers every sequence's pages into a padded copy
(about three times the memory traffic). It is plain C with OpenMP, built
with the local C compiler in a second or two into the user cache and called
through ctypes. Without a compiler, or with CBRUN_KERNELS=torch, the engine
uses the torch path, which computes the same attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("cbrun.engine")

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_kernel: "DecodeKernel | None" = None
_tried = False


def _cache_root() -> Path:
    root = os.environ.get("CBRUN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cbrun")
    return Path(root) / "kernels"


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders never see half a file


class DecodeKernel:
    """ctypes binding of paged_decode_{f32,bf16}."""

    _DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}

    def __init__(self, library: ctypes.CDLL) -> None:
        self.functions = {dtype: getattr(library, name) for dtype, name in self._DTYPES.items()}
        for function in self.functions.values():
            function.restype = None
        self.max_gd = int(library.paged_decode_max_gd())  # restype set by the loader

    def supports(self, dtype: torch.dtype, group_dim: int) -> bool:
        return dtype in self.functions and group_dim <= self.max_gd

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 kv_len: torch.Tensor, kv_lo: torch.Tensor, first_page: torch.Tensor, max_len: int,
                 scale: float) -> torch.Tensor:
        """q [B, H, D] contiguous; pools [H_kv, NB, P, D]; returns [B, H, D]."""
        batch, heads, dim = q.shape
        num_kv, num_blocks, page, _ = k_pool.shape
        threads = torch.get_num_threads()
        out = torch.empty_like(q)
        scratch = torch.empty(threads * (heads // num_kv) * max(max_len, 1), dtype=torch.float32)
        pointer = ctypes.c_void_p
        i64 = ctypes.c_int64
        self.functions[q.dtype](
            pointer(q.data_ptr()), pointer(k_pool.data_ptr()), pointer(v_pool.data_ptr()),
            pointer(tables.data_ptr()), pointer(kv_len.data_ptr()), pointer(kv_lo.data_ptr()),
            pointer(first_page.data_ptr()), pointer(out.data_ptr()), pointer(scratch.data_ptr()),
            i64(batch), i64(heads), i64(dim), i64(num_kv), i64(num_blocks), i64(page), i64(tables.shape[1]),
            i64(max_len), ctypes.c_float(scale), ctypes.c_int(threads),
        )
        return out


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled kernel, or None when it cannot be built or is switched off."""
    global _kernel, _tried
    if os.environ.get("CBRUN_KERNELS", "").lower() == "torch":
        return None
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        try:
            source = _SOURCE.read_bytes()
            digest = hashlib.sha256(source + " ".join(_FLAGS).encode() + sys.platform.encode()).hexdigest()[:16]
            target = _cache_root() / f"paged_decode-{digest}.so"
            if not target.exists():
                _compile(_SOURCE, target)
            library = ctypes.CDLL(str(target))
            library.paged_decode_max_gd.restype = ctypes.c_int64
            _kernel = DecodeKernel(library)
        except Exception as exc:  # no compiler, failed build, unsupported platform
            detail = getattr(exc, "stderr", "") or exc
            log.warning("compiled CPU attention kernel unavailable (%s); using the torch path", detail)
        return _kernel
