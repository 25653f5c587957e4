"""Optional compiled CPU kernels for the hot path, built once per machine.

- Attention reads keys and values in place from the page pool, in one pass
  with an online softmax, for every query token of a step (decodes and
  prefill chunks alike); rows sharing leading pages run as one task that
  reads those pages once. The torch path first gathers every row's pages
  into a padded copy (about three times the memory traffic).
- K/V writes copy each new token's rows straight to its slot.
- Sampling computes argmax, log-sum-exp and the inverse-CDF draw of each
  logits row in one parallel pass, where torch needs several full passes.
- Linear layers read their weights in place (fp32 or bf16, fp32 sums); weights
  sharing an input (q|k|v, gate|up with SiLU) go in one pass; LoRA deltas too.
- RMSNorm (with the residual add) and rotary embeddings for fused/layers.py.

Every kernel gives a row the same bits whatever else is in the call (batch
invariance; see linear.c and attention.c for how).

The kernels are plain C (csrc/), built at first use (build/kernel_build.py) and
loaded with their ISA variants scored (kernels/loader.py, kernels/isa_variants.py);
every call crosses the typed seam of kernels/abi.py. Without a compiler, or
with CBRUN_KERNELS=torch, the engine uses the torch paths, which compute the
same results up to rounding (and are the reference in tests).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from cbrun.engine.backends.cpu.kernels.abi import (
    VARIANTS,
    AttendParams,
    DenseParams,
    KernelError,
    KvWriteParams,
    RmsnormParams,
    check,
    head_rows,
    is_bf16,
    optional_ptr,
    pointers,
    ptr,
    threads,
    unit_stride_rows,
)
from cbrun.engine.backends.cpu.kernels.int8 import Int8Kernels
from cbrun.engine.backends.cpu.kernels.isa_variants import IsaVariants, attention_variant_runs, dp_scores, dp_values
from cbrun.engine.backends.cpu.kernels.lora import LoraKernels
from cbrun.engine.backends.cpu.kernels.pair_dot import LINEAR_DTYPES, PairDotKernels
from cbrun.engine.backends.cpu.kernels.sampling import SamplingCalls
from cbrun.engine.backends.metadata import PagedRows


class CpuKernels(SamplingCalls):
    """ctypes bindings of the compiled kernels: paged attention, K/V writes, linear layers, and the fused
    decoder layers' norm, rotary and activation; sampling's calls come from SamplingCalls. The packed linears
    and LoRA are parts of their own: `dp` (kernels/pair_dot.py: bf16 pairs), `int8` (kernels/int8.py) and
    `lora` (kernels/lora.py)."""

    _ATTEND: ClassVar[dict[torch.dtype, str]] = {torch.float32: "paged_attend_f32", torch.bfloat16: "paged_attend_bf16"}
    MAX_GROUP = 64  # query heads per kv head (MAX_G in attention.c)

    def __init__(self, library: ctypes.CDLL, variants: IsaVariants) -> None:
        """`library` bound (kernel_abi.bind), `variants` what the load found this CPU runs (kernels/isa_variants.py)."""
        self._lib = library
        self.variants = variants
        self.build_name = Path(library._name).stem  # names the build: sources, flags, compiler, CPU flags
        self.vector_width = int(library.linear_vec_width())  # fp32 lanes of the linear kernels (8 or 16)
        self.panel_rows = int(library.linear_panel_rows())  # rows of x per packed panel (PANEL in panel.h)
        self.attend_functions = {dtype: getattr(library, name) for dtype, name in self._ATTEND.items()}
        self.max_gd = int(library.paged_attend_max_gd())
        self.segment = int(library.paged_attend_segment())  # keys per online-softmax segment
        self.max_segments = int(library.linear_max_segments())
        self.tile_max_dim = int(library.paged_attend_tile_max_d())  # head sizes bf16 attention takes AMX's order at
        self.attend_dp_variant = variants.attention  # bf16 attention in AMX's order (attention_tile.h), chosen at load
        self.dp = PairDotKernels(library, variants)  # linear_dpbf16.c's entry points
        self.int8 = Int8Kernels(library, variants)  # linear_int8.c's entry points
        self.lora = LoraKernels(library)  # lora.c's grouped adapter deltas
        self._local = threading.local()  # per-thread scratch (engines may step in their own threads)

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
        paged: PagedRows,
        tasks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
        paired_keys: bool = False,
    ) -> torch.Tensor:
        """Attention of every query row over its own keys, read in place from the page pools.

        q [R, H, D] with heads D apart and unit stride, its rows any distance apart (a view of the step's fused
        q|k|v columns needs no copy: head_rows); pools [H_kv, NB, P, D] contiguous, q's dtype; `paged`'s tables
        [S, max_pages], row_seq [R], first_page [S], kv_len [R], kv_lo [R] and the task triple (rows [R], start
        [T + 1], shared keys [T]) int64 (see attention.c). Returns out [R, H, D] (contiguous). `paired_keys`: k_pool
        holds its pages' keys pair-major, as write_kv(paired=True) lays them (AMX's order by the twin, the isa or
        the reference; see paired_keys_for).
        """
        tables, row_seq, first_page, kv_len, kv_lo = (
            paged.tables,
            paged.row_seq,
            paged.first_page,
            paged.kv_len,
            paged.kv_lo,
        )
        rows, heads, dim = q.shape
        num_kv, num_blocks, page, _ = k_pool.shape
        q, ldq = head_rows(q)  # [R, H, D], rows ldq apart
        if (
            q.dtype not in self.attend_functions
            or k_pool.dtype != q.dtype
            or v_pool.dtype != q.dtype
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())
            or v_pool.shape != k_pool.shape
        ):
            raise KernelError("attend: the pools must be contiguous, and q and the pools of one supported dtype")
        longs = (tables, row_seq, first_page, kv_len, kv_lo, *tasks)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in longs):
            raise KernelError("attend: index tensors must be contiguous int64")
        task_rows, task_start, task_shared = tasks
        out = q.new_empty(rows, heads, dim)
        amx_order = self.tile_order(q.dtype, dim)
        if paired_keys and not (amx_order and self.attend_dp_variant != "amx"):
            raise KernelError("attend: paired keys are read only by bf16 attention in AMX's order, not on tiles")
        function = self._lib.paged_attend_bf16dp if amx_order else self.attend_functions[q.dtype]
        params = AttendParams(
            q=ptr(q),
            k=ptr(k_pool),
            v=ptr(v_pool),
            tables=ptr(tables),
            row_seq=ptr(row_seq),
            first_page=ptr(first_page),
            kv_len=ptr(kv_len),
            kv_lo=ptr(kv_lo),
            out=ptr(out),
            task_rows=ptr(task_rows),
            task_start=ptr(task_start),
            task_shared=ptr(task_shared),
            max_pages=tables.shape[1],
            R=rows,
            S=tables.shape[0],
            H=heads,
            D=dim,
            Hkv=num_kv,
            NB=num_blocks,
            P=page,
            tasks=task_shared.numel(),
            ldq=ldq,
            scale=scale,
            variant=VARIANTS["dp"][self.attend_dp_variant] if amx_order else 0,
            threads=threads(),
            paired_keys=int(paired_keys),
        )
        status = function(ctypes.byref(params))
        check(status, "attend")
        return out

    def paired_keys_for(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether an engine's key pools should hold their pages pair-major: bf16 attention in AMX's order by a
        vector variant reads VEC keys' pair p side by side in place, where key rows would be transposed every
        step; the tiles read key rows."""
        return self.tile_order(dtype, head_dim) and self.attend_dp_variant in ("twin", "isa")

    def tile_order(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention of this dtype and head size computes AMX's order (bf16, whole 32-element blocks); the
        rest keeps the fp32 chains of the other kernels."""
        return dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= self.tile_max_dim

    def dp_attention_runs(self, variant: str) -> bool:
        """Whether this CPU runs a variant of the AMX-order attention (isa_variants.ATTENTION_VARIANTS)."""
        return attention_variant_runs(self._lib, variant)

    def attend_dp_scores(self, variant: str, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Scores [G, n] of q [G, D] against keys [n, D] by one variant of the AMX-order attention (isa_variants.py)."""
        return dp_scores(self._lib, variant, q, keys, scale)

    def attend_dp_values(self, variant: str, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Value sums [G, D] of values [n, D] weighted by weights [G, n] (rounded to bf16) by one variant."""
        return dp_values(self._lib, variant, weights, values)

    def write_kv(self, pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, paired: bool = False) -> None:
        """Copy `new` [H_kv, T, D] (unit stride along D) into `pool` [H_kv, NB, P, D] at flat `slots` [T]; with
        `paired` (a bf16 key pool for attend(paired_keys=True)) each page's keys pair-major."""
        num_kv, num_blocks, page, dim = pool.shape
        if paired:
            if pool.dtype != torch.bfloat16 or dim % 2 or not pool.is_contiguous():
                raise KernelError("write_kv: paired keys need a contiguous bf16 pool of an even head size")
            if new.stride(-1) != 1 or new.dtype != pool.dtype:
                new = new.to(pool.dtype).contiguous()
        elif new.stride(-1) != 1 or new.dtype != pool.dtype or not pool.is_contiguous():  # unusual layouts: torch
            pool.view(num_kv, num_blocks * page, dim).index_copy_(1, slots, new.to(pool.dtype))
            return
        params = KvWriteParams(
            pool=ptr(pool),
            src=ptr(new),
            slots=ptr(slots),
            T=new.shape[1],
            Hkv=num_kv,
            D=dim,
            slots_per_head=num_blocks * page,
            head_stride=new.stride(0),
            token_stride=new.stride(1),
            elem=pool.element_size(),
            paired_page=page if paired else 0,
        )
        self._lib.paged_write(ctypes.byref(params))

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
        x = unit_stride_rows(x)
        rows, inner = x.shape
        _check_linear_operands(x, weights, biases, inner)
        widths = [w.shape[0] for w in weights]
        out = torch.empty(rows, sum(widths), dtype=out_dtype or x.dtype)
        check(self._dense(self._lib.linear_rows, x, weights, biases, out), "linear")
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
        x = unit_stride_rows(x)
        rows, inner = x.shape
        _check_linear_operands(x, [gate, up], [gate_bias, up_bias], inner)
        if gate.shape != up.shape:
            raise KernelError("gated_silu: gate and up weights differ in shape")
        out = torch.empty(rows, gate.shape[0], dtype=x.dtype)
        check(self._dense(self._lib.gated_silu, x, [gate, up], [gate_bias, up_bias], out), "gated_silu")
        return out

    def _dense(
        self,
        function: Callable[..., int],
        x: torch.Tensor,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        out: torch.Tensor,
    ) -> int:
        """linear_rows or gated_silu (`function`) on x [M, K], weights [N_s, K] and biases [N_s] (or None) into
        out (rows unit-stride) through one cb_dense_params; returns the kernel's status."""
        rows, inner = x.shape
        count = len(weights)
        w, b = pointers(weights), pointers(biases)  # [count] each: held here until the call returns
        n = (ctypes.c_int64 * count)(*(weight.shape[0] for weight in weights))  # [count]
        params = DenseParams(
            x=ptr(x),
            w=ctypes.addressof(w),
            bias=ctypes.addressof(b),
            n=ctypes.addressof(n),
            y=ptr(out),
            xp=ptr(self._panel_scratch(rows, inner)),
            ldx=x.stride(0),
            ldy=out.stride(0),
            M=rows,
            K=inner,
            count=count,
            x_bf16=is_bf16(x),
            w_bf16=is_bf16(weights[0]),
            y_bf16=is_bf16(out),
            threads=threads(),
        )
        return int(function(ctypes.byref(params)))

    def _panel_scratch(self, rows: int, inner: int) -> torch.Tensor:
        """Room for the linear kernels' packed copy of x (16-row panels), kept per thread and grown on demand."""
        needed = max(1, -(-rows // self.panel_rows) * self.panel_rows * inner)
        scratch = getattr(self._local, "panels", None)
        if scratch is None or scratch.numel() < needed:
            scratch = self._local.panels = torch.empty(needed, dtype=torch.float32)
        return scratch

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for fp32 [T, N] inputs (unit stride along N), in one pass -> [T, N]."""
        tokens, width = gate.shape
        out = torch.empty(tokens, width, dtype=torch.float32)
        self._lib.silu_mul_f32(
            ptr(gate),
            gate.stride(0),
            ptr(up),
            up.stride(0),
            ptr(out),
            out.stride(0),
            tokens,
            width,
            threads(),
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
        params = RmsnormParams(
            x=ptr(x),
            delta=optional_ptr(delta),
            sum_out=ptr(total),
            w=ptr(weight),
            out=ptr(out),
            ldx=x.stride(0),
            ldd=delta.stride(0) if delta is not None else 0,
            lds=total.stride(0),
            ldo=out.stride(0),
            T=tokens,
            heads=width // dim,
            D=dim,
            eps=eps,
            threads=threads(),
        )
        self._lib.rmsnorm_f32(ctypes.byref(params))
        return out, total

    def rope(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on the first `heads` heads of each fp32 row of x [T, >= heads * D];
        cos, sin [T, D] (rotate-half convention, as transformers' apply_rotary_pos_emb)."""
        tokens = x.shape[0]
        dim = cos.shape[-1]
        self._lib.rope_f32(ptr(x), x.stride(0), heads, dim, ptr(cos), ptr(sin), cos.stride(0), tokens, threads())


def _check_linear_operands(x: torch.Tensor, weights: list[torch.Tensor], biases: list, inner: int) -> None:
    """Raise unless x and the weights are fp32/bf16 CPU tensors the kernel can read as they lie."""
    dtype = weights[0].dtype
    if x.dtype not in LINEAR_DTYPES or dtype not in LINEAR_DTYPES:
        raise KernelError(f"linear: dtypes {x.dtype} x {dtype} (the kernel takes float32 and bfloat16)")
    if len(biases) != len(weights):
        raise KernelError("linear: one bias (or None) per weight")
    for w, b in zip(weights, biases):
        if w.dtype != dtype or w.dim() != 2 or w.shape[1] != inner or not w.is_contiguous() or w.device.type != "cpu":
            raise KernelError(f"linear: weight {tuple(w.shape)} {w.dtype} does not fit x [.., {inner}] {x.dtype}")
        if b is not None and (b.dtype != dtype or b.shape != (w.shape[0],) or not b.is_contiguous()):
            raise KernelError(f"linear: bias {tuple(b.shape)} {b.dtype} does not fit weight {tuple(w.shape)}")
