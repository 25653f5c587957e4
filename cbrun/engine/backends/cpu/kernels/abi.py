"""The typed seam between the compiled kernels and Python: csrc/cbrun_abi.h, mirrored once.

Everything that crosses it is declared here and nowhere else: the status
codes, the variant, role and mode numbers, the parameter structs
(`ctypes.Structure`s field for field as the header's), and every exported
function's `restype`/`argtypes`, set once when a library is bound. A call
with a wrong argument then raises in ctypes instead of corrupting memory, and
`check` turns a refusing kernel's status into a `KernelError`.
tests/cpu_kernels/test_kernel_abi.py reads the header and checks that this
module agrees with it; `bind` refuses a library whose struct sizes differ.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from enum import IntEnum

import torch


class Status(IntEnum):
    """What an entry point that can refuse its input returns (CB_OK, CB_BAD_ARGS, ...)."""

    OK = 0
    BAD_ARGS = -1
    NO_MEMORY = -2
    NO_VARIANT = -3


class DpVariant(IntEnum):
    """The variants of a bf16 pair-dot kernel, linear and attention alike (CB_DP_*, dp_pairs.h)."""

    SCALAR = 0  # plain C: the reference
    TWIN = 1  # portable vectors under the CPU's flush modes
    ISA = 2  # vdpbf16ps (AVX512-BF16)
    AMX = 3  # tdpbf16ps (AMX-BF16): the linears only


class I8Variant(IntEnum):
    """The variants of the int8 linear kernel (CB_I8_*, linear_int8.c)."""

    SCALAR = 0
    AVX2 = 1
    VNNI = 2
    AMX = 3


class Role(IntEnum):
    """A weight's role in a packed matrix: all of a block, or a gated block's gate or up half (CB_ROLE_*)."""

    PLAIN = 0
    GATE = 1
    UP = 2


class Mode(IntEnum):
    """What a packed linear computes (CB_MODE_*): y = x @ W^T, silu(gate) * up, both sums, or int32 sums."""

    PLAIN = 0
    SILU = 1
    RAW = 2
    INT = 3


class AbiStruct(IntEnum):
    """Which struct `cb_abi_size` measures (CB_ABI_*)."""

    ATTEND = 0
    LINEAR = 1
    DENSE = 2
    RMSNORM = 3
    SAMPLE = 4
    KV_WRITE = 5


# The one variant table: each family of ISA variants by name, fastest last (kernels/loader.py scores them at load).
VARIANTS: dict[str, dict[str, int]] = {
    "dp": {"scalar": DpVariant.SCALAR, "twin": DpVariant.TWIN, "isa": DpVariant.ISA, "amx": DpVariant.AMX},
    "int8": {"scalar": I8Variant.SCALAR, "avx2": I8Variant.AVX2, "vnni": I8Variant.VNNI, "amx": I8Variant.AMX},
}
ROLES: dict[str, int] = {"plain": Role.PLAIN, "gate": Role.GATE, "up": Role.UP}
MODES: dict[str, int] = {"plain": Mode.PLAIN, "silu": Mode.SILU, "raw": Mode.RAW, "int": Mode.INT}

_P, _I64, _I32, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_float


class AttendParams(ctypes.Structure):
    """cb_attend_params: paged_attend_{f32,bf16,bf16dp}'s arguments (attention.c has their shapes)."""

    _fields_ = [
        ("q", _P),
        ("k", _P),
        ("v", _P),
        ("tables", _P),
        ("row_seq", _P),
        ("first_page", _P),
        ("kv_len", _P),
        ("kv_lo", _P),
        ("out", _P),
        ("task_rows", _P),
        ("task_start", _P),
        ("task_shared", _P),
        ("max_pages", _I64),
        ("R", _I64),
        ("S", _I64),
        ("H", _I64),
        ("D", _I64),
        ("Hkv", _I64),
        ("NB", _I64),
        ("P", _I64),
        ("tasks", _I64),
        ("ldq", _I64),
        ("scale", _F32),
        ("variant", _I32),
        ("threads", _I32),
        ("paired_keys", _I32),
    ]


class KvWriteParams(ctypes.Structure):
    """cb_kv_write_params: paged_write's new K/V rows and their slots in the page pool (attention.c)."""

    _fields_ = [
        ("pool", _P),
        ("src", _P),
        ("slots", _P),
        ("T", _I64),
        ("Hkv", _I64),
        ("D", _I64),
        ("slots_per_head", _I64),
        ("head_stride", _I64),
        ("token_stride", _I64),
        ("elem", _I64),
        ("paired_page", _I64),
    ]


class LinearParams(ctypes.Structure):
    """cb_linear_params: a linear over a packed matrix (dp_linear, i8_linear)."""

    _fields_ = [
        ("x", _P),
        ("packed", _P),
        ("bias", _P),
        ("up_bias", _P),
        ("y", _P),
        ("scratch", _P),
        ("row_scales", _P),
        ("ldx", _I64),
        ("N", _I64),
        ("K", _I64),
        ("ldy", _I64),
        ("M", _I64),
        ("x_bf16", _I32),
        ("y_bf16", _I32),
        ("mode", _I32),
        ("variant", _I32),
        ("threads", _I32),
    ]


class DenseParams(ctypes.Structure):
    """cb_dense_params: a linear reading fp32/bf16 weights in place (linear_rows; gated_silu, gate and up)."""

    _fields_ = [
        ("x", _P),
        ("w", _P),
        ("bias", _P),
        ("n", _P),
        ("y", _P),
        ("xp", _P),
        ("ldx", _I64),
        ("ldy", _I64),
        ("M", _I64),
        ("K", _I64),
        ("count", _I32),
        ("x_bf16", _I32),
        ("w_bf16", _I32),
        ("y_bf16", _I32),
        ("threads", _I32),
    ]


class RmsnormParams(ctypes.Structure):
    """cb_rmsnorm_params: rmsnorm_f32's rows, with the residual add (layer_ops.c)."""

    _fields_ = [
        ("x", _P),
        ("delta", _P),
        ("sum_out", _P),
        ("w", _P),
        ("out", _P),
        ("ldx", _I64),
        ("ldd", _I64),
        ("lds", _I64),
        ("ldo", _I64),
        ("T", _I64),
        ("heads", _I64),
        ("D", _I64),
        ("eps", _F32),
        ("threads", _I32),
    ]


class SampleParams(ctypes.Structure):
    """cb_sample_params: sample_rows_f32's logits rows, draws and outputs (sampling.c)."""

    _fields_ = [
        ("logits", _P),
        ("inv_temp", _P),
        ("uniform", _P),
        ("token", _P),
        ("normalizer", _P),
        ("scratch", _P),
        ("N", _I64),
        ("V", _I64),
        ("row_stride", _I64),
        ("threads", _I32),
    ]


# Each parameter struct by its CB_ABI_* number: what `bind` compares with the library's cb_abi_size.
STRUCTS: dict[AbiStruct, type[ctypes.Structure]] = {
    AbiStruct.ATTEND: AttendParams,
    AbiStruct.LINEAR: LinearParams,
    AbiStruct.DENSE: DenseParams,
    AbiStruct.RMSNORM: RmsnormParams,
    AbiStruct.SAMPLE: SampleParams,
    AbiStruct.KV_WRITE: KvWriteParams,
}
_ATTEND = (_INT, [ctypes.POINTER(AttendParams)])
_LINEAR = (_INT, [ctypes.POINTER(LinearParams)])
_DENSE = (_INT, [ctypes.POINTER(DenseParams)])

# Every exported function: (restype, argtypes), declared once when the library is bound.
SIGNATURES = {
    "cb_abi_size": (_I64, [_INT]),
    # attention.c
    "paged_attend_f32": _ATTEND,
    "paged_attend_bf16": _ATTEND,
    "paged_attend_bf16dp": _ATTEND,
    "paged_attend_max_gd": (_I64, []),
    "paged_attend_segment": (_I64, []),
    "paged_attend_tile_max_d": (_I64, []),
    "attend_dp_variant_runs": (_INT, [_INT]),
    "attend_dp_scores": (_INT, [_INT, _P, _P, _I64, _I64, _I64, _F32, _P]),
    "attend_dp_values": (_INT, [_INT, _P, _P, _I64, _I64, _I64, _P]),
    "paged_write": (None, [ctypes.POINTER(KvWriteParams)]),
    # sampling.c
    "sample_rows_f32": (None, [ctypes.POINTER(SampleParams)]),
    "apply_token_masks": (None, [_P, _I64, _P, _P, _I64, _I64, _I64, _INT]),
    "top_p_counts_f32": (None, [_P, _I64, _P, _P, _I64, _I64, _P, _INT]),
    # linear.c
    "linear_rows": _DENSE,
    "linear_max_segments": (_INT, []),
    "gated_silu": _DENSE,
    "linear_vec_width": (_INT, []),
    "linear_panel_rows": (_INT, []),
    # layer_ops.c
    "rmsnorm_f32": (None, [ctypes.POINTER(RmsnormParams)]),
    "rope_f32": (None, [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _INT]),
    "silu_mul_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _INT]),
    # linear_dpbf16.c
    "dp_variant_runs": (_INT, [_INT]),
    "dp_packed_size": (_I64, [_I64, _I64, _INT]),
    "dp_pack_weight": (_INT, [_P, _I64, _I64, _I64, _INT, _I64, _P, _INT]),
    "dp_zero_blocks": (_INT, [_P, _I64, _I64, _INT]),
    "dp_unpack_weight": (_INT, [_P, _I64, _INT, _I64, _P, _I64, _P, _I64, _INT]),
    "dp_linear": _LINEAR,
    "dp_block_outputs": (_INT, []),
    "dp_inner_padded": (_I64, [_I64]),
    "dp_scratch_bytes": (_I64, [_I64, _I64]),
    # linear_int8.c
    "i8_variant_runs": (_INT, [_INT]),
    "i8_inner_fits": (_INT, [_I64]),
    "i8_inner_padded": (_I64, [_I64]),
    "i8_packed_size": (_I64, [_I64, _I64, _INT]),
    "i8_scratch_bytes": (_I64, [_I64, _I64]),
    "i8_pack_weight": (_INT, [_P, _I64, _P, _I64, _I64, _INT, _I64, _P, _INT]),
    "i8_unpack_weight": (_INT, [_P, _I64, _INT, _I64, _P, _I64, _P, _I64, _P, _INT]),
    "i8_quantize_rows": (_INT, [_P, _I64, _INT, _I64, _I64, _P, _P, _INT]),
    "i8_linear": _LINEAR,
    "i8_block_outputs": (_INT, []),
    # lora.c
    "lora_apply": (_INT, [_P, _INT, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _INT, _INT]),
    "lora_max_rank": (_INT, []),
}


class KernelError(RuntimeError):
    """A compiled kernel refused its arguments (a bug in the caller) or ran out of memory."""


_STATUS_TEXT: dict[int, str] = {
    Status.BAD_ARGS: "arguments the kernel cannot handle",
    Status.NO_VARIANT: "this CPU cannot run the variant asked for",
}


def check(status: int, name: str) -> None:
    """Raise a KernelError naming the call unless the kernel returned CB_OK."""
    if status != Status.OK:
        raise KernelError(f"{name}: {_STATUS_TEXT.get(status, 'out of memory')}")


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declare every entry point's signature on a loaded library, after checking that its parameter structs
    have the sizes of this module's (a library built from other headers is refused, never called)."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    for which, struct in STRUCTS.items():
        size = library.cb_abi_size(which)
        if size != ctypes.sizeof(struct):
            raise KernelError(f"{struct.__name__}: {ctypes.sizeof(struct)} bytes here, {size} in the library")
    return library


# -- tensors across the seam ----------------------------------------------------------------------


def ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def optional_ptr(tensor: torch.Tensor | None) -> int | None:
    return ptr(tensor) if tensor is not None else None


def pointers(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() if t is not None else None for t in tensors))


def is_bf16(tensor: torch.Tensor) -> int:
    return int(tensor.dtype == torch.bfloat16)


def unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit stride along K (the kernels take any row stride)."""
    return x if x.stride(1) == 1 else x.contiguous()


def head_rows(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q [R, H, D] as attention reads it, heads D apart with unit stride and rows ldq >= H * D apart, and ldq: q
    itself where it lies so (a view of a step's q|k|v columns), else a copy. A size-1 dim's stride is arbitrary in
    torch (a one-row q may report any row stride), so it is neither trusted nor passed on."""
    rows, heads, dim = q.shape
    in_place = q.stride(2) == 1 and (heads == 1 or q.stride(1) == dim) and (rows < 2 or q.stride(0) >= heads * dim)
    q = q if in_place else q.contiguous()
    return q, q.stride(0) if rows > 1 else heads * dim


def threads() -> int:
    """The threads a call runs on: torch's intra-op count."""
    return torch.get_num_threads()
