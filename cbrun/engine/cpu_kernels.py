"""Optional compiled CPU kernels for the hot path, built once per machine.

- Decode attention reads keys and values in place from the page pool, in one
  pass with an online softmax; the torch path first gathers every row's
  pages into a padded copy (about three times the memory traffic).
- Shared-prefix attention (many rows over the same cached pages) runs both
  products and the softmax per panel of 16 query rows in cache.
- K/V writes copy each new token's rows straight to its slot.
- Sampling computes argmax, log-sum-exp and the inverse-CDF draw of each
  logits row in one parallel pass, where torch needs several full passes.
- Linear layers with few rows (fp32) read their weights in place, where BLAS
  repacks them on every call (see cpu_linear.py); several weights sharing an
  input (q|k|v, gate|up with SiLU) go in one pass.
- RMSNorm (with the residual add) and rotary embeddings for the fused
  decoder layers (fused_layers.py).

It is plain C with OpenMP and vector extensions, built with the local C
compiler in a second or two into the user cache and called through ctypes.
Without a compiler, or with CBRUN_KERNELS=torch, the engine uses the torch
paths, which compute the same results (and are the reference in tests).
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

_SOURCES = Path(__file__).with_name("csrc")  # *.c built into one library, with their shared header
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_kernel: "CpuKernels | None" = None
_tried = False


def _cache_root() -> Path:
    root = os.environ.get("CBRUN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cbrun")
    return Path(root) / "kernels"


def _sources() -> list[Path]:
    return sorted(_SOURCES.glob("*.c"))


def _digest() -> str:
    """Names the build: every source and header, the flags and the platform."""
    content = hashlib.sha256()
    for path in sorted([*_sources(), *_SOURCES.glob("*.h")]):
        content.update(path.name.encode() + path.read_bytes())
    content.update(" ".join(_FLAGS).encode() + sys.platform.encode())
    return content.hexdigest()[:16]


def _compile(sources: list[Path], target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *_FLAGS, *map(str, sources), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders never see half a file


_PANEL_ROWS = 16  # rows of x per packed panel (PANEL in csrc/panel.h)


class CpuKernels:
    """ctypes bindings of the compiled kernels: paged decode attention, K/V writes, sampling, linear
    layers, and the fused decoder layers' norm, rotary and activation."""

    _DECODE = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
    MAX_GROUP = 64  # query heads per kv head (MAX_G in the C source)

    def __init__(self, library: ctypes.CDLL) -> None:
        self.decode_functions = {dtype: getattr(library, name) for dtype, name in self._DECODE.items()}
        self.write_function = library.paged_write
        self.sample_function = library.sample_rows_f32
        self.linear_function = library.linear_f32
        self.gated_function = library.gated_silu_f32
        self.rmsnorm_function = library.rmsnorm_f32
        self.rope_function = library.rope_f32
        self.silu_mul_function = library.silu_mul_f32
        self.shared_prefix_function = library.shared_prefix_f32
        self.prefill_function = library.prefill_attention_f32
        for function in (self.shared_prefix_function, self.prefill_function):
            function.restype = ctypes.c_int  # 0, or -1 when out of memory
        for function in (*self.decode_functions.values(), self.write_function, self.sample_function,
                         self.linear_function, self.gated_function, self.rmsnorm_function, self.rope_function,
                         self.silu_mul_function):
            function.restype = None
        self.max_gd = int(library.paged_decode_max_gd())  # restype set by the loader
        self._local = threading.local()  # per-thread scratch (engines may step in their own threads)

    def supports_decode(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return (dtype in self.decode_functions and head_dim % 8 == 0 and group <= self.MAX_GROUP
                and group * head_dim <= self.max_gd)

    def decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
               kv_len: torch.Tensor, kv_lo: torch.Tensor, first_page: torch.Tensor, scale: float,
               state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [B, H, D] contiguous; pools [H_kv, NB, P, D]; returns [B, H, D].

        `state` (running max [B, H], sum [B, H], unnormalized output [B, H, D], fp32)
        continues each row's softmax over keys before kv_lo attended elsewhere.
        """
        batch, heads, dim = q.shape
        num_kv, num_blocks, page, _ = k_pool.shape
        out = torch.empty_like(q)
        m0, l0, acc0 = (_ptr(t) for t in state) if state is not None else (None, None, None)
        self.decode_functions[q.dtype](
            _ptr(q), _ptr(k_pool), _ptr(v_pool), _ptr(tables), _ptr(kv_len), _ptr(kv_lo), _ptr(first_page),
            _ptr(out), _i64(batch), _i64(heads), _i64(dim), _i64(num_kv), _i64(num_blocks), _i64(page),
            _i64(tables.shape[1]), ctypes.c_float(scale), ctypes.c_int(torch.get_num_threads()), m0, l0, acc0,
        )
        return out

    def shared_prefix(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                      pages: torch.Tensor, scale: float, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
        """Softmax state of q's `rows` over the keys of `pages` (the same for all of them), written into
        `state` = (max [B, H], sum [B, H], unnormalized output [B, H, D]) at those rows.

        fp32 only: q [B, H, D], pools [H_kv, NB, P, D], all contiguous; rows [R], pages [S] int64.
        Returns False if the kernel could not run (out of memory, or an input it does not take);
        the caller then computes the group with the torch path, which rewrites all of its rows.
        """
        tensors = (q, k_pool, v_pool, *state)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or q.shape[-1] < 8:
            return False
        rows, pages = rows.contiguous(), pages.contiguous()
        batch, heads, dim = q.shape
        num_kv, num_blocks, page, _ = k_pool.shape
        top, total, acc = state
        return self.shared_prefix_function(
            _ptr(q), _ptr(k_pool), _ptr(v_pool), _ptr(rows), _i64(rows.numel()), _ptr(pages), _i64(pages.numel()),
            _i64(heads), _i64(num_kv), _i64(num_blocks), _i64(page), _i64(dim), ctypes.c_float(scale),
            _ptr(top), _ptr(total), _ptr(acc), ctypes.c_int(torch.get_num_threads()),
        ) == 0

    def prefill_attention(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, start: int,
                          pages: torch.Tensor | None = None) -> torch.Tensor | None:
        """Causal attention of a chunk's queries q [T, H, D] (positions start .. start + T - 1) over the
        sequence's keys [0, start + T): from the pools `key`, `value` [H_kv, NB, P, D] through `pages`
        [n] int64, or (start 0, pages None) the chunk's own key, value [H_kv, T, D]. fp32; returns
        out [T, H, D], or None when the kernel declines (then the caller uses SDPA).
        """
        tokens, heads, dim = q.shape
        if q.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32 \
                or not q.is_contiguous() or dim < 8 or key.stride(-1) != 1 or key.stride() != value.stride():
            return None
        if pages is not None:
            if not (key.is_contiguous() and value.is_contiguous()):
                return None
            num_kv, num_blocks, page, _ = key.shape
            pages, strides = pages.contiguous(), (0, 0)
        else:
            if start != 0:
                return None
            num_kv, num_blocks, page = key.shape[0], 0, 1
            strides = (key.stride(0), key.stride(1))
        out = torch.empty_like(q)
        status = self.prefill_function(
            _ptr(q), _ptr(key), _ptr(value), _optional_ptr(pages), _i64(num_blocks), _i64(page), _i64(strides[0]),
            _i64(strides[1]), _i64(tokens), _i64(start), _i64(heads), _i64(num_kv), _i64(dim), ctypes.c_float(scale),
            _ptr(out), ctypes.c_int(torch.get_num_threads()),
        )
        return out if status == 0 else None

    def write_kv(self, pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy `new` [H_kv, T, D] (unit stride along D) into `pool` [H_kv, NB, P, D] at flat `slots` [T]."""
        num_kv, num_blocks, page, dim = pool.shape
        if new.stride(-1) != 1 or new.dtype != pool.dtype or not pool.is_contiguous():  # unusual layouts: torch
            pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, new.to(pool.dtype))
            return
        self.write_function(
            _ptr(pool), _ptr(new), _ptr(slots), _i64(new.shape[1]), _i64(num_kv), _i64(dim),
            _i64(num_blocks * page), _i64(new.stride(0)), _i64(new.stride(1)), _i64(pool.element_size()),
        )

    def sample(self, logits: torch.Tensor, inv_temp: torch.Tensor,
               uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of fp32 `logits` [N, V]: (token [N] int64, logsumexp(logits * inv_temp) [N] fp32).

        Rows with a negative `uniform` (float64) take the argmax; the others
        draw from softmax(logits * inv_temp) by inverting the CDF at their number.
        """
        rows, vocab = logits.shape
        threads = torch.get_num_threads()
        token = torch.empty(rows, dtype=torch.int64)
        normalizer = torch.empty(rows, dtype=torch.float32)
        scratch = torch.empty(threads * vocab, dtype=torch.float32)
        self.sample_function(
            _ptr(logits), _i64(rows), _i64(vocab), _i64(logits.stride(0)), _ptr(inv_temp), _ptr(uniform),
            _ptr(token), _ptr(normalizer), _ptr(scratch), ctypes.c_int(threads),
        )
        return token, normalizer

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], reading the weight in place (no repacking)."""
        return self.linear_many(x, [weight], [bias])

    def linear_many(self, x: torch.Tensor, weights: list[torch.Tensor],
                    biases: list[torch.Tensor | None]) -> torch.Tensor:
        """fp32 x [M, K] against several weights [N_i, K] in one pass -> [M, sum N_i], outputs side by side."""
        x = _unit_stride_rows(x)
        rows, inner = x.shape
        widths = [w.shape[0] for w in weights]
        out = torch.empty(rows, sum(widths), dtype=torch.float32)
        count = len(weights)
        self.linear_function(
            _ptr(x), _i64(x.stride(0)), ctypes.c_int(count), _pointers(weights), _pointers(biases),
            (ctypes.c_int64 * count)(*widths), _ptr(out), _i64(out.stride(0)), _i64(rows), _i64(inner),
            _ptr(self._panel_scratch(rows, inner)), ctypes.c_int(torch.get_num_threads()),
        )
        return out

    def gated_silu(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(x @ gate^T + gate_bias) * (x @ up^T + up_bias): fp32 x [M, K], weights [N, K] -> [M, N]."""
        x = _unit_stride_rows(x)
        rows, inner = x.shape
        out = torch.empty(rows, gate.shape[0], dtype=torch.float32)
        self.gated_function(
            _ptr(x), _i64(x.stride(0)), _ptr(gate), _ptr(up), _optional_ptr(gate_bias), _optional_ptr(up_bias),
            _ptr(out), _i64(out.stride(0)), _i64(rows), _i64(gate.shape[0]), _i64(inner),
            _ptr(self._panel_scratch(rows, inner)), ctypes.c_int(torch.get_num_threads()),
        )
        return out

    def _panel_scratch(self, rows: int, inner: int) -> torch.Tensor:
        """Room for the linear kernels' packed copy of x (whole 16-row panels), kept per thread and grown on demand."""
        needed = max(1, rows // _PANEL_ROWS * _PANEL_ROWS * inner)
        scratch = getattr(self._local, "panels", None)
        if scratch is None or scratch.numel() < needed:
            scratch = self._local.panels = torch.empty(needed, dtype=torch.float32)
        return scratch

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for fp32 [T, N] inputs (unit stride along N), in one pass -> [T, N]."""
        tokens, width = gate.shape
        out = torch.empty(tokens, width, dtype=torch.float32)
        self.silu_mul_function(
            _ptr(gate), _i64(gate.stride(0)), _ptr(up), _i64(up.stride(0)), _ptr(out), _i64(out.stride(0)),
            _i64(tokens), _i64(width), ctypes.c_int(torch.get_num_threads()),
        )
        return out

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS norm of each row of D = weight.numel() in fp32 x [T, heads * D] (row stride free).

        With `delta` (same shape), the rows of x + delta are normalized. Returns
        (normed [T, heads * D], the rows that were normalized: x + delta, or x).
        """
        tokens, width = x.shape
        dim = weight.numel()
        out = torch.empty(tokens, width, dtype=torch.float32)
        total = torch.empty_like(out) if delta is not None else x
        self.rmsnorm_function(
            _ptr(x), _i64(x.stride(0)), _optional_ptr(delta), _i64(delta.stride(0) if delta is not None else 0),
            _ptr(total), _i64(total.stride(0)), _ptr(weight), ctypes.c_float(eps), _ptr(out), _i64(out.stride(0)),
            _i64(tokens), _i64(width // dim), _i64(dim), ctypes.c_int(torch.get_num_threads()),
        )
        return out, total

    def rope(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on the first `heads` heads of each fp32 row of x [T, >= heads * D];
        cos, sin [T, D] (rotate-half convention, as transformers' apply_rotary_pos_emb)."""
        tokens = x.shape[0]
        dim = cos.shape[-1]
        self.rope_function(
            _ptr(x), _i64(x.stride(0)), _i64(heads), _i64(dim), _ptr(cos), _ptr(sin), _i64(cos.stride(0)),
            _i64(tokens), ctypes.c_int(torch.get_num_threads()),
        )


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit stride along K (the kernels take any row stride)."""
    return x if x.stride(1) == 1 else x.contiguous()


def _pointers(tensors: list[torch.Tensor | None]):
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() if t is not None else None for t in tensors))


def _optional_ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p | None:
    return _ptr(tensor) if tensor is not None else None


def _ptr(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _i64(value: int) -> ctypes.c_int64:
    return ctypes.c_int64(value)


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when it cannot be built or is switched off."""
    global _kernel, _tried
    if os.environ.get("CBRUN_KERNELS", "").lower() == "torch":
        return None
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        try:
            target = _cache_root() / f"cbrun_cpu-{_digest()}.so"
            if not target.exists():
                _compile(_sources(), target)
            library = ctypes.CDLL(str(target))
            library.paged_decode_max_gd.restype = ctypes.c_int64
            _kernel = CpuKernels(library)
        except Exception as exc:  # no compiler, failed build, unsupported platform
            detail = getattr(exc, "stderr", "") or exc
            log.warning("compiled CPU kernels unavailable (%s); using the torch paths", detail)
        return _kernel
