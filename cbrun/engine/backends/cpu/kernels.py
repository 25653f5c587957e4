"""Optional compiled CPU kernels for the hot path, built once per machine.

- Attention reads keys and values in place from the page pool, in one pass
  with an online softmax, for every query token of a step (decodes and
  prefill chunks alike); rows sharing leading pages run as one task that
  reads those pages once. The torch path first gathers every row's pages
  into a padded copy (about three times the memory traffic).
- K/V writes copy each new token's rows straight to its slot.
- Sampling computes argmax, log-sum-exp and the inverse-CDF draw of each
  logits row in one parallel pass, where torch needs several full passes.
- Linear layers (fp32 or bf16 weights, fp32 accumulation) read their weights
  in place; several weights sharing an input (q|k|v, gate|up with SiLU) go in
  one pass.
- RMSNorm (with the residual add) and rotary embeddings for the fused
  decoder layers (fused_layers.py).

Every kernel gives a row the same bits whatever else is in the call (batch
invariance; see linear.c and attention.c for how).

It is plain C with OpenMP and vector extensions, built with the local C
compiler (-march=native) in a few seconds into the user cache and called
through ctypes. The library's name includes a digest of the sources, the
flags, the compiler's version and the CPU's feature flags, so a library
built on another CPU (a shared home directory) is never loaded where it
could stop the process on an illegal instruction. Without a compiler, or
with CBRUN_KERNELS=torch, the engine uses the torch paths, which compute the
same results up to rounding (and are the reference in tests).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch

from cbrun.user_cache import cache_dir

log = logging.getLogger("cbrun.engine")

_SOURCES = Path(__file__).with_name("csrc")  # *.c built into one library, with their shared header
# CBRUN_KERNEL_MARCH builds for another target than this CPU (e.g. x86-64-v3: AVX2 only), for a cluster's
# lowest common ISA or to check that an AVX2 build gives the same bits here
_MARCH = os.environ.get("CBRUN_KERNEL_MARCH") or "native"
_FLAGS = ["-O3", f"-march={_MARCH}", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# GCC's tuning for some CPUs (Zen: avoid-fma-max-bits) keeps reduction chains as a multiply and an add instead
# of a fused multiply-add, so a kernel's sums would round differently on an AMD and an Intel machine (measured:
# the fp32 attention differed between -march=znver3 and -march=sapphirerapids builds). Form FMAs everywhere.
_GCC_FLAGS = ["--param=avoid-fma-max-bits=0"]
# Reported, not fatal, at a user's build; tests/test_linear_methods.py builds every source with -Werror.
_WARNINGS = ["-Wall", "-Wextra", "-Wno-psabi"]
_lock = threading.Lock()
_kernel: CpuKernels | None = None
_tried = False


def _cache_root() -> Path:
    return cache_dir() / "kernels"


def _sources() -> list[Path]:
    return sorted(_SOURCES.glob("*.c"))


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return compiler


def _flags(compiler: str) -> list[str]:
    """The build's flags for this compiler. GCC gets its FMA-forming parameter; clang contracts only within a
    statement (-ffp-contract=on), since its "fast" fuses across statements and would change rotary's and the
    softmax's roundings (GCC's "fast" fuses within expressions, which is what the kernels are written for)."""
    if _is_gcc(compiler):
        return [*_FLAGS, *_GCC_FLAGS]
    return [flag if flag != "-ffp-contract=fast" else "-ffp-contract=on" for flag in _FLAGS]


@functools.cache
def _is_gcc(compiler: str) -> bool:
    """GCC (not clang, which also defines __GNUC__): its --version names the Free Software Foundation."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def _compiler_version(compiler: str) -> str:
    """The compiler's own description of itself (`cc --version`'s first line)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def cpu_flags() -> str:
    """The CPU's feature flags, sorted (Linux /proc/cpuinfo; elsewhere the machine and processor names).

    -march=native bakes these into the library: a build for AVX-512 loaded on
    an AVX2-only CPU dies of SIGILL with no message, so they key the cache.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return f"{platform.machine()} {platform.processor()}"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere the processor name, empty when the platform has none).

    Beside `cpu_flags` so that `cbrun info` and the bench report read the CPU in one place.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def _digest(compiler: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Names the build: every source and header, the flags, the compiler, the CPU and the platform."""
    content = hashlib.sha256()
    for path in sorted([*_sources(), *_SOURCES.glob("*.h")]):
        content.update(path.name.encode() + path.read_bytes())
    content.update(" ".join(_flags(compiler)).encode() + sys.platform.encode())
    content.update(_compiler_version(compiler).encode() + cpu_flags().encode())
    if extra_flags:  # none: the default build's name, as before
        content.update(b"\0extra\0" + "\0".join(extra_flags).encode())
    return content.hexdigest()[:16]


def _compile(compiler: str, sources: list[Path], target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *_flags(compiler), *_WARNINGS, *extra_flags, *map(str, sources), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        if result.stderr.strip():  # a compiler we have not seen warns: say so (tests build with -Werror)
            log.warning("the CPU kernels built with warnings:\n%s", result.stderr.strip()[-4000:])
        os.replace(built, target)  # atomic: concurrent builders never see half a file


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# paged_attend_{f32,bf16}: q, k, v, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, R, S, H, D, H_kv, NB,
# P, scale, task rows, task starts, task shared keys, tasks, threads (attention.c).
_ATTEND_ARGS = [
    _P,
    _P,
    _P,
    _P,
    _I64,
    _P,
    _P,
    _P,
    _P,
    _P,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _F32,
    _P,
    _P,
    _P,
    _I64,
    _INT,
]

# Every exported function: (restype, argtypes), declared once when the library is loaded.
_SIGNATURES = {
    "paged_attend_f32": (_INT, _ATTEND_ARGS),
    "paged_attend_max_gd": (_I64, []),
    "paged_attend_segment": (_I64, []),
    "paged_write": (None, [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64]),
    "sample_rows_f32": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _INT]),
    "linear_rows": (_INT, [_P, _I64, _INT, _INT, _P, _P, _INT, _P, _P, _I64, _INT, _I64, _I64, _P, _INT]),
    "linear_max_segments": (_INT, []),
    "gated_silu": (_INT, [_P, _I64, _INT, _P, _P, _P, _P, _INT, _P, _I64, _INT, _I64, _I64, _I64, _P, _INT]),
    "rmsnorm_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _F32, _P, _I64, _I64, _I64, _I64, _INT]),
    "rope_f32": (None, [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _INT]),
    "silu_mul_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT]),
    "dp_variant_runs": (_INT, [_INT]),
    "dp_packed_size": (_I64, [_I64, _I64, _INT]),
    "dp_pack_weight": (_INT, [_P, _I64, _I64, _I64, _INT, _I64, _P, _INT]),
    "dp_zero_blocks": (_INT, [_P, _I64, _I64, _INT]),
    "dp_unpack_weight": (_INT, [_P, _I64, _INT, _I64, _P, _I64, _P, _I64, _INT]),
    "dp_linear": (_INT, [_P, _I64, _INT, _P, _I64, _I64, _INT, _P, _P, _P, _I64, _INT, _I64, _P, _INT, _INT]),
    "dp_block_outputs": (_INT, []),
    "linear_vec_width": (_INT, []),
    "linear_panel_rows": (_INT, []),
    "apply_token_masks": (None, [_P, _I64, _P, _P, _I64, _I64, _I64, _INT]),
    # int8 linears (linear_int8.c), wrapped by int8_kernels.py
    "i8_variant_runs": (_INT, [_INT]),
    "i8_inner_fits": (_INT, [_I64]),
    "i8_inner_padded": (_I64, [_I64]),
    "i8_packed_size": (_I64, [_I64, _I64, _INT]),
    "i8_scratch_bytes": (_I64, [_I64, _I64]),
    "i8_pack_weight": (_INT, [_P, _I64, _P, _I64, _I64, _INT, _I64, _P, _INT]),
    "i8_unpack_weight": (_INT, [_P, _I64, _INT, _I64, _P, _I64, _P, _I64, _P, _INT]),
    "i8_quantize_rows": (_INT, [_P, _I64, _INT, _I64, _I64, _P, _P, _INT]),
    "i8_linear": (_INT, [_P, _I64, _INT, _P, _I64, _I64, _INT, _P, _P, _P, _I64, _INT, _I64, _P, _P, _INT, _INT]),
    "i8_block_outputs": (_INT, []),
}
_SIGNATURES["paged_attend_bf16"] = _SIGNATURES["paged_attend_f32"]
_SIGNATURES["paged_attend_bf16dp"] = (_INT, [*_ATTEND_ARGS, _INT])  # + the score variant
_SIGNATURES["attend_dp_scores"] = (_INT, [_INT, _P, _P, _I64, _I64, _I64, _F32, _P])
_SIGNATURES["dpa_variant_runs"] = (_INT, [_INT])
# Variants of a bf16 pair-dot kernel (dp_pairs.h): the plain-C reference, the portable twin, vdpbf16ps.
DP_VARIANTS = {"scalar": 0, "twin": 1, "isa": 2}
_LINEAR_DTYPES = (torch.float32, torch.bfloat16)


class KernelError(RuntimeError):
    """A compiled kernel refused its arguments (a bug in the caller) or ran out of memory."""


def _check(status: int, name: str) -> None:
    if status == -1:
        raise KernelError(f"{name}: arguments the kernel cannot handle")
    if status == -3:
        raise KernelError(f"{name}: this CPU cannot run the variant asked for")
    if status != 0:
        raise KernelError(f"{name}: out of memory")


class CpuKernels:
    """ctypes bindings of the compiled kernels: paged attention, K/V writes, sampling, linear layers,
    and the fused decoder layers' norm, rotary and activation."""

    _ATTEND: ClassVar[dict[torch.dtype, str]] = {torch.float32: "paged_attend_f32", torch.bfloat16: "paged_attend_bf16"}
    MAX_GROUP = 64  # query heads per kv head (MAX_G in attention.c)

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
        self._lib = library
        self.build_name = Path(library._name).stem  # names the build: sources, flags, compiler, CPU flags
        self.vector_width = int(library.linear_vec_width())  # fp32 lanes of the linear kernels (8 or 16)
        self.panel_rows = int(library.linear_panel_rows())  # rows of x per packed panel (PANEL in panel.h)
        self.attend_functions = {dtype: getattr(library, name) for dtype, name in self._ATTEND.items()}
        self.max_gd = int(library.paged_attend_max_gd())
        self.segment = int(library.paged_attend_segment())  # keys per online-softmax segment
        self.max_segments = int(library.linear_max_segments())
        self.dp_block_outputs = int(library.dp_block_outputs())  # outputs per packed block (DP_BLOCK)
        self._local = threading.local()  # per-thread scratch (engines may step in their own threads)
        from cbrun.engine.backends.cpu.attention_variant import choose_attention_dp_variant

        self.attend_dp_variant = choose_attention_dp_variant(self)  # bf16 scores on pair dots (attention.c)

    def supports_attention(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return (
            dtype in self.attend_functions
            and head_dim % 8 == 0
            and group <= self.MAX_GROUP
            and group * head_dim <= self.max_gd
        )

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        row_seq: torch.Tensor,
        first_page: torch.Tensor,
        kv_len: torch.Tensor,
        kv_lo: torch.Tensor,
        tasks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Attention of every query row over its own keys, read in place from the page pools.

        q [R, H, D] contiguous; pools [H_kv, NB, P, D] contiguous, q's dtype; tables [S, max_pages],
        row_seq [R], first_page [S], kv_len [R], kv_lo [R] and the task triple (rows [R], start
        [T + 1], shared keys [T]) int64 (see attention.c). Returns out [R, H, D].
        """
        rows, heads, dim = q.shape
        num_kv, num_blocks, page, _ = k_pool.shape
        if (
            q.dtype not in self.attend_functions
            or k_pool.dtype != q.dtype
            or v_pool.dtype != q.dtype
            or not (q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous())
            or v_pool.shape != k_pool.shape
        ):
            raise KernelError("attend: q and the pools must be contiguous and of one supported dtype")
        longs = (tables, row_seq, first_page, kv_len, kv_lo, *tasks)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in longs):
            raise KernelError("attend: index tensors must be contiguous int64")
        task_rows, task_start, task_shared = tasks
        out = torch.empty_like(q)
        pair_dots = q.dtype == torch.bfloat16 and dim % 32 == 0  # bf16 scores as vdpbf16ps computes them
        function = self._lib.paged_attend_bf16dp if pair_dots else self.attend_functions[q.dtype]
        extra = (DP_VARIANTS[self.attend_dp_variant],) if pair_dots else ()
        status = function(
            _ptr(q),
            _ptr(k_pool),
            _ptr(v_pool),
            _ptr(tables),
            tables.shape[1],
            _ptr(row_seq),
            _ptr(first_page),
            _ptr(kv_len),
            _ptr(kv_lo),
            _ptr(out),
            rows,
            tables.shape[0],
            heads,
            dim,
            num_kv,
            num_blocks,
            page,
            scale,
            _ptr(task_rows),
            _ptr(task_start),
            _ptr(task_shared),
            task_shared.numel(),
            torch.get_num_threads(),
            *extra,
        )
        _check(status, "attend")
        return out

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Scores [G, n] of q [G, D] against keys [n, D] (bf16, D a multiple of 32, n <= the segment) by one
        variant of attention.c's pair-dot scores: what the load check and the tests compare."""
        heads, dim = q.shape
        count = keys.shape[0]
        if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or keys.shape[1] != dim:
            raise KernelError("attend_dp_scores: q [G, D] and keys [n, D] must be bf16")
        q, keys = q.contiguous(), keys.contiguous()
        out = torch.empty(heads, count, dtype=torch.float32)
        status = self._lib.attend_dp_scores(
            DP_VARIANTS[variant], _ptr(q), _ptr(keys), heads, count, dim, scale, _ptr(out)
        )
        _check(status, "attend_dp_scores")
        return out

    def dp_attention_runs(self, variant: str) -> bool:
        """Whether this CPU runs a variant of the pair-dot scores (the instruction needs AVX512-BF16)."""
        return bool(self._lib.dpa_variant_runs(DP_VARIANTS[variant]))

    def write_kv(self, pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy `new` [H_kv, T, D] (unit stride along D) into `pool` [H_kv, NB, P, D] at flat `slots` [T]."""
        num_kv, num_blocks, page, dim = pool.shape
        if new.stride(-1) != 1 or new.dtype != pool.dtype or not pool.is_contiguous():  # unusual layouts: torch
            pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, new.to(pool.dtype))
            return
        self._lib.paged_write(
            _ptr(pool),
            _ptr(new),
            _ptr(slots),
            new.shape[1],
            num_kv,
            dim,
            num_blocks * page,
            new.stride(0),
            new.stride(1),
            pool.element_size(),
        )

    def sample(
        self, logits: torch.Tensor, inv_temp: torch.Tensor, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of fp32 `logits` [N, V]: (token [N] int64, logsumexp(logits * inv_temp) [N] fp32).

        Rows with a negative `uniform` (float64) take the argmax; the others
        draw from softmax(logits * inv_temp) by inverting the CDF at their number.
        """
        rows, vocab = logits.shape
        threads = torch.get_num_threads()
        token = torch.empty(rows, dtype=torch.int64)
        normalizer = torch.empty(rows, dtype=torch.float32)
        scratch = torch.empty(threads * vocab, dtype=torch.float32)
        self._lib.sample_rows_f32(
            _ptr(logits),
            rows,
            vocab,
            logits.stride(0),
            _ptr(inv_temp),
            _ptr(uniform),
            _ptr(token),
            _ptr(normalizer),
            _ptr(scratch),
            threads,
        )
        return token, normalizer

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in `out_dtype` (default x's), reading the
        weight in place; fp32 or bf16 operands, fp32 accumulation in one order for every M."""
        return self.linear_many(x, [weight], [bias], out_dtype)

    def linear_many(
        self,
        x: torch.Tensor,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [M, K] against several weights [N_i, K] (one dtype) in one pass -> [M, sum N_i], side by side."""
        if not 1 <= len(weights) <= self.max_segments:
            raise KernelError(f"linear: {len(weights)} weights in one call (the kernel takes 1 to {self.max_segments})")
        x = _unit_stride_rows(x)
        rows, inner = x.shape
        _check_linear_operands(x, weights, biases, inner)
        widths = [w.shape[0] for w in weights]
        out = torch.empty(rows, sum(widths), dtype=out_dtype or x.dtype)
        count = len(weights)
        status = self._lib.linear_rows(
            _ptr(x),
            x.stride(0),
            _is_bf16(x),
            count,
            _pointers(weights),
            _pointers(biases),
            _is_bf16(weights[0]),
            (ctypes.c_int64 * count)(*widths),
            _ptr(out),
            out.stride(0),
            _is_bf16(out),
            rows,
            inner,
            _ptr(self._panel_scratch(rows, inner)),
            torch.get_num_threads(),
        )
        _check(status, "linear")
        return out

    def gated_silu(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu(x @ gate^T + gate_bias) * (x @ up^T + up_bias): x [M, K], weights [N, K] -> [M, N] in x's dtype."""
        x = _unit_stride_rows(x)
        rows, inner = x.shape
        _check_linear_operands(x, [gate, up], [gate_bias, up_bias], inner)
        if gate.shape != up.shape:
            raise KernelError("gated_silu: gate and up weights differ in shape")
        out = torch.empty(rows, gate.shape[0], dtype=x.dtype)
        status = self._lib.gated_silu(
            _ptr(x),
            x.stride(0),
            _is_bf16(x),
            _ptr(gate),
            _ptr(up),
            _optional_ptr(gate_bias),
            _optional_ptr(up_bias),
            _is_bf16(gate),
            _ptr(out),
            out.stride(0),
            _is_bf16(out),
            rows,
            gate.shape[0],
            inner,
            _ptr(self._panel_scratch(rows, inner)),
            torch.get_num_threads(),
        )
        _check(status, "gated_silu")
        return out

    def _panel_scratch(self, rows: int, inner: int) -> torch.Tensor:
        """Room for the linear kernels' packed copy of x (16-row panels), kept per thread and grown on demand."""
        needed = max(1, -(-rows // self.panel_rows) * self.panel_rows * inner)
        scratch = getattr(self._local, "panels", None)
        if scratch is None or scratch.numel() < needed:
            scratch = self._local.panels = torch.empty(needed, dtype=torch.float32)
        return scratch

    # -- bf16 pair-dot linears (linear_dpbf16.c) --------------------------------------------------

    DP_VARIANTS: ClassVar[dict[str, int]] = {"scalar": 0, "twin": 1, "isa": 2}  # DP_SCALAR, DP_TWIN, DP_ISA

    def dp_variant_runs(self, variant: str) -> bool:
        """Whether this CPU can run the variant ("isa": the CPU reports AVX512-BF16)."""
        return bool(self._lib.dp_variant_runs(self.DP_VARIANTS[variant]))

    # roles of a weight in a packed matrix (linear_dpbf16.c): all of it, or a gated matrix's gate or up half
    DP_ROLES: ClassVar[dict[str, int]] = {"plain": 0, "gate": 1, "up": 2}

    def dp_packed(self, outputs: int, inner: int, gated: bool = False) -> torch.Tensor:
        """An empty packed matrix (zeros): `outputs` outputs of `inner` inputs (gated: that many gate and up rows)."""
        size = self._lib.dp_packed_size(outputs, inner, int(gated))
        packed = torch.empty(size, dtype=torch.int16)
        blocks = size // ((inner + inner % 2) * self.dp_block_outputs)
        _check(self._lib.dp_zero_blocks(_ptr(packed), blocks, inner, torch.get_num_threads()), "dp_packed")
        return packed  # zeros, each block first touched by the thread that computes it

    def dp_pack_into(
        self, packed: torch.Tensor, inner: int, weight: torch.Tensor, role: str = "plain", first: int = 0
    ) -> None:
        """Write bf16 `weight` [n, K] (rows unit-stride) as outputs first .. first + n - 1 of `role` into `packed`."""
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.shape[1] != inner
            or weight.stride(1) != 1
            or weight.device.type != "cpu"
        ):
            raise KernelError(
                f"dp_pack: weight {tuple(weight.shape)} {weight.dtype} is not a bf16 CPU matrix of {inner} columns"
            )
        status = self._lib.dp_pack_weight(
            _ptr(weight),
            weight.stride(0),
            weight.shape[0],
            inner,
            self.DP_ROLES[role],
            first,
            _ptr(packed),
            torch.get_num_threads(),
        )
        _check(status, "dp_pack")

    def dp_unpack(
        self,
        packed: torch.Tensor,
        inner: int,
        role: str = "plain",
        first: int = 0,
        count: int = 0,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Outputs of `role` back out of `packed`, bit for bit, as bf16 rows [count, K]: first .. first + count - 1,
        or the outputs `ids` (int64 [T]: a tied head's embedding lookup) when given."""
        if ids is not None:
            if ids.dtype != torch.int64 or not ids.is_contiguous():
                raise KernelError("dp_unpack: ids must be contiguous int64")
            count = ids.numel()
        out = torch.empty(count, inner, dtype=torch.bfloat16)
        status = self._lib.dp_unpack_weight(
            _ptr(packed),
            inner,
            self.DP_ROLES[role],
            first,
            _optional_ptr(ids),
            count,
            _ptr(out),
            inner,
            torch.get_num_threads(),
        )
        _check(status, "dp_unpack")
        return out

    def dp_pack(self, weight: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 weight [N, K] (gated: gate [N, K] and up [N, K]) -> its packed blocks, flat int16."""
        if up is not None and up.shape != weight.shape:
            raise KernelError("dp_pack: gate and up weights differ in shape")
        rows, inner = weight.shape
        packed = self.dp_packed(rows, inner, gated=up is not None)
        if up is None:
            self.dp_pack_into(packed, inner, weight)
        else:
            self.dp_pack_into(packed, inner, weight, "gate")
            self.dp_pack_into(packed, inner, up, "up")
        return packed

    def dp_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        outputs: int,
        inner: int,
        variant: str,
        bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        gated: bool | str = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [M, K] (bf16, or fp32 rounded to bf16) @ packed W^T (+ fp32 bias) -> [M, N] in `out_dtype`
        (default x's); gated: silu(x @ Wg^T + bias) * (x @ Wu^T + up_bias); gated="raw": both sums (+ biases)
        side by side, [M, 2N]. See linear_dpbf16.c."""
        x = _unit_stride_rows(x)
        rows, width = x.shape
        if width != inner or x.dtype not in _LINEAR_DTYPES or packed.dtype != torch.int16:
            raise KernelError(f"dp_linear: x [{rows}, {width}] {x.dtype} does not fit a packed [{outputs}, {inner}]")
        for b in (bias, up_bias):
            if b is not None and (b.dtype != torch.float32 or b.shape != (outputs,) or not b.is_contiguous()):
                raise KernelError(f"dp_linear: bias {tuple(b.shape)} {b.dtype} is not fp32 [{outputs}]")
        mode = 2 if gated == "raw" else int(bool(gated))
        out = torch.empty(rows, outputs * (2 if mode == 2 else 1), dtype=out_dtype or x.dtype)
        if out.dtype not in _LINEAR_DTYPES:
            raise KernelError(f"dp_linear: output dtype {out.dtype}")
        padded = inner + inner % 2
        scratch = self._dp_scratch(rows * padded)
        status = self._lib.dp_linear(
            _ptr(x),
            x.stride(0),
            _is_bf16(x),
            _ptr(packed),
            outputs,
            inner,
            mode,
            _optional_ptr(bias),
            _optional_ptr(up_bias),
            _ptr(out),
            out.stride(0),
            _is_bf16(out),
            rows,
            _ptr(scratch),
            self.DP_VARIANTS[variant],
            torch.get_num_threads(),
        )
        _check(status, "dp_linear")
        return out

    def apply_token_masks(self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
        """In place: logits [N, V] fp32 (unit stride along V) get -inf at every token a row's packed mask
        (masks [r, W] int32, bit t % 32 of word t / 32) disallows, in rows [r] int64 only."""
        if (
            logits.dtype != torch.float32
            or logits.stride(1) != 1
            or masks.dtype != torch.int32
            or not masks.is_contiguous()
            or rows.dtype != torch.int64
            or masks.shape[0] != rows.numel()
        ):
            raise KernelError("apply_token_masks: fp32 logits with unit stride, int32 masks [r, W], int64 rows [r]")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
            raise KernelError("apply_token_masks: a row index outside the logits")
        self._lib.apply_token_masks(
            _ptr(logits),
            logits.stride(0),
            _ptr(rows),
            _ptr(masks),
            rows.numel(),
            masks.shape[1],
            logits.shape[1],
            torch.get_num_threads(),
        )

    def _dp_scratch(self, elements: int) -> torch.Tensor:
        """Room for dp_linear's bf16 copy of x, kept per thread and grown on demand."""
        scratch = getattr(self._local, "dp_rows", None)
        if scratch is None or scratch.numel() < max(1, elements):
            scratch = self._local.dp_rows = torch.empty(max(1, elements), dtype=torch.int16)
        return scratch

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for fp32 [T, N] inputs (unit stride along N), in one pass -> [T, N]."""
        tokens, width = gate.shape
        out = torch.empty(tokens, width, dtype=torch.float32)
        self._lib.silu_mul_f32(
            _ptr(gate),
            gate.stride(0),
            _ptr(up),
            up.stride(0),
            _ptr(out),
            out.stride(0),
            tokens,
            width,
            torch.get_num_threads(),
        )
        return out

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS norm of each row of D = weight.numel() in fp32 x [T, heads * D] (row stride free).

        With `delta` (same shape), the rows of x + delta are normalized. Returns
        (normed [T, heads * D], the rows that were normalized: x + delta, or x).
        """
        tokens, width = x.shape
        dim = weight.numel()
        out = torch.empty(tokens, width, dtype=torch.float32)
        total = torch.empty_like(out) if delta is not None else x
        self._lib.rmsnorm_f32(
            _ptr(x),
            x.stride(0),
            _optional_ptr(delta),
            delta.stride(0) if delta is not None else 0,
            _ptr(total),
            total.stride(0),
            _ptr(weight),
            eps,
            _ptr(out),
            out.stride(0),
            tokens,
            width // dim,
            dim,
            torch.get_num_threads(),
        )
        return out, total

    def rope(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on the first `heads` heads of each fp32 row of x [T, >= heads * D];
        cos, sin [T, D] (rotate-half convention, as transformers' apply_rotary_pos_emb)."""
        tokens = x.shape[0]
        dim = cos.shape[-1]
        self._lib.rope_f32(
            _ptr(x), x.stride(0), heads, dim, _ptr(cos), _ptr(sin), cos.stride(0), tokens, torch.get_num_threads()
        )


def _check_linear_operands(x: torch.Tensor, weights: list[torch.Tensor], biases: list, inner: int) -> None:
    """Raise unless x and the weights are fp32/bf16 CPU tensors the kernel can read as they lie."""
    dtype = weights[0].dtype
    if x.dtype not in _LINEAR_DTYPES or dtype not in _LINEAR_DTYPES:
        raise KernelError(f"linear: dtypes {x.dtype} x {dtype} (the kernel takes float32 and bfloat16)")
    if len(biases) != len(weights):
        raise KernelError("linear: one bias (or None) per weight")
    for w, b in zip(weights, biases):
        if w.dtype != dtype or w.dim() != 2 or w.shape[1] != inner or not w.is_contiguous() or w.device.type != "cpu":
            raise KernelError(f"linear: weight {tuple(w.shape)} {w.dtype} does not fit x [.., {inner}] {x.dtype}")
        if b is not None and (b.dtype != dtype or b.shape != (w.shape[0],) or not b.is_contiguous()):
            raise KernelError(f"linear: bias {tuple(b.shape)} {b.dtype} does not fit weight {tuple(w.shape)}")


def _is_bf16(tensor: torch.Tensor) -> int:
    return int(tensor.dtype == torch.bfloat16)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit stride along K (the kernels take any row stride)."""
    return x if x.stride(1) == 1 else x.contiguous()


def _pointers(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() if t is not None else None for t in tensors))


def _optional_ptr(tensor: torch.Tensor | None) -> int | None:
    return _ptr(tensor) if tensor is not None else None


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def build_kernels(defines: tuple[str, ...] = ()) -> CpuKernels:
    """The kernels built with extra `-D` definitions (such as "CBRUN_VEC_WIDTH=16", which forces the linear
    kernels' vector width: tests), cached beside the default build under a name that includes them. Raises
    where the library cannot be built; load_cpu_kernels() is what the engine uses."""
    compiler = _compiler()
    flags = tuple(f"-D{define}" for define in defines)
    target = _cache_root() / f"cbrun_cpu-{_digest(compiler, flags)}.so"
    if not target.exists():
        _compile(compiler, _sources(), target, flags)
    return CpuKernels(ctypes.CDLL(str(target)))


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
            compiler = _compiler()
            target = _cache_root() / f"cbrun_cpu-{_digest(compiler)}.so"
            if not target.exists():
                _compile(compiler, _sources(), target)
            _kernel = CpuKernels(ctypes.CDLL(str(target)))
        except Exception as exc:  # no compiler, failed build, unsupported platform
            detail = getattr(exc, "stderr", "") or exc
            log.warning("compiled CPU kernels unavailable (%s); using the torch paths", detail)
        return _kernel
