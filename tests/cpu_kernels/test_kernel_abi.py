"""The typed seam: kernels/abi.py mirrors csrc/cbrun_abi.h exactly, and a loaded library agrees with both."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from cbrun.engine.backends.cpu.kernels import abi as kernel_abi
from cbrun.engine.backends.cpu.kernels.abi import (
    AbiStruct,
    AttendParams,
    DenseParams,
    DpVariant,
    I8Variant,
    KernelError,
    KvWriteParams,
    LinearParams,
    Mode,
    RmsnormParams,
    Role,
    SampleParams,
    Status,
    check,
)
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

HEADER = Path(kernel_abi.__file__).parents[1] / "csrc" / "cbrun_abi.h"
# The header's prefix of each group of numbers, and the Python enum that mirrors it.
GROUPS = {"CB_DP_": DpVariant, "CB_I8_": I8Variant, "CB_ROLE_": Role, "CB_MODE_": Mode, "CB_ABI_": AbiStruct}
C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _header() -> str:
    return re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)


def _defines() -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"#define (CB_\w+) \(?(-?\d+)\)?", _header())}


def _struct_fields(name: str) -> list[tuple[str, type]]:
    """(field, ctypes type) of the header's `typedef struct {...} name;`, in order (every pointer a void*, an
    array of pointers such as `const void* const* w` too: its last word is the field's name)."""
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + ";", _header())
    assert body is not None, name
    fields: list[tuple[str, type]] = []
    for declaration in filter(None, (d.strip() for d in body.group(1).split(";"))):
        base = re.match(r"(?:const\s+)?(\w+)", declaration)
        assert base is not None, declaration
        for declarator in declaration[base.end() :].split(","):
            field = re.findall(r"\w+", declarator)[-1]
            fields.append((field, ctypes.c_void_p if "*" in declarator else C_TYPES[base.group(1)]))
    return fields


def test_every_number_of_the_header_is_mirrored_once_in_the_abi_module():
    defines = _defines()
    statuses = {name: value for name, value in defines.items() if not name.startswith(tuple(GROUPS))}
    assert statuses == {f"CB_{member.name}": member.value for member in Status}
    for prefix, enum in GROUPS.items():
        mirrored = {f"{prefix}{member.name}": member.value for member in enum}
        assert {name: value for name, value in defines.items() if name.startswith(prefix)} == mirrored, prefix


def test_the_variant_table_names_every_variant_of_the_header():
    assert sorted(kernel_abi.VARIANTS["dp"].values()) == sorted(DpVariant)
    assert sorted(kernel_abi.VARIANTS["int8"].values()) == sorted(I8Variant)
    assert sorted(kernel_abi.ROLES.values()) == sorted(Role) and sorted(kernel_abi.MODES.values()) == sorted(Mode)


# Each parameter struct of the header, and its mirror.
STRUCTS = [
    (AttendParams, "cb_attend_params"),
    (LinearParams, "cb_linear_params"),
    (KvWriteParams, "cb_kv_write_params"),
    (DenseParams, "cb_dense_params"),
    (RmsnormParams, "cb_rmsnorm_params"),
    (SampleParams, "cb_sample_params"),
]


@pytest.mark.parametrize(("struct", "name"), STRUCTS)
def test_each_parameter_struct_has_the_headers_fields_in_its_order(struct, name):
    assert [(field, kind) for field, kind in struct._fields_] == _struct_fields(name)


def test_every_struct_of_the_header_is_mirrored_and_measured():
    assert sorted(re.findall(r"\}\s*(cb_\w+_params);", _header())) == sorted(name for _, name in STRUCTS)
    assert set(kernel_abi.STRUCTS) == set(AbiStruct)
    assert set(kernel_abi.STRUCTS.values()) == {struct for struct, _ in STRUCTS}


def test_a_status_other_than_ok_raises_with_its_meaning():
    check(Status.OK, "call")
    with pytest.raises(KernelError, match="call: arguments the kernel cannot handle"):
        check(Status.BAD_ARGS, "call")
    with pytest.raises(KernelError, match="call: this CPU cannot run the variant"):
        check(Status.NO_VARIANT, "call")
    with pytest.raises(KernelError, match="call: out of memory"):
        check(Status.NO_MEMORY, "call")


def test_the_loaded_library_has_the_struct_sizes_of_python():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the compiled kernels are unavailable here")
    assert kernels._lib.cb_abi_size(AbiStruct.ATTEND) == ctypes.sizeof(AttendParams)
    assert kernels._lib.cb_abi_size(AbiStruct.LINEAR) == ctypes.sizeof(LinearParams)
    for which, struct in kernel_abi.STRUCTS.items():
        assert kernels._lib.cb_abi_size(which) == ctypes.sizeof(struct), struct.__name__
