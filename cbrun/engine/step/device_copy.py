"""A step's host-built tensors to the accelerator in one copy.

The batch builder makes every index tensor of a step (token ids, positions,
slots, block tables, kv ranges, the backend's row plan) on the host. Sent
one by one, each small tensor would be its own host-to-device transfer, and
a copy from pageable memory makes the host wait for the device's queue: a
synchronisation per tensor per step. Here the tensors of each dtype (int64
indices; the Triton plan's int32 blocks; the torch reference path's bool
masks and fp32 biases) are laid end to end in one pinned buffer, sent with
one asynchronous copy, and replaced by views of the device copy. Each view
starts on a 128-byte boundary: Triton compiles a kernel variant per
alignment of its pointer arguments, so offsets that drift from step to step
would recompile it. On the CPU nothing moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")

ALIGN_BYTES = 128  # where each tensor starts in the shared buffer (Triton specializes on pointer alignment)


def to_device(batch: T, device: torch.device) -> T:
    """`batch` (a dataclass tree of tensors, lists and nested dataclasses) with its tensors on `device`."""
    if device.type == "cpu":
        return batch
    tensors: list[torch.Tensor] = []
    _collect(batch, tensors)
    moved = _send(tensors, device)
    return _rebuild(batch, moved)


def _collect(value: object, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            out.append(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            if field.metadata.get("device_copy", True):
                _collect(getattr(value, field.name), out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, out)


def _send(tensors: list[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """id(host tensor) -> its device copy: one pinned buffer and one async copy per dtype."""
    moved: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if id(tensor) not in moved:
            moved[id(tensor)] = tensor  # placeholder: each tensor once
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())  # elements per 128 bytes
        offsets = [0]
        for tensor in group:
            offsets.append(offsets[-1] + -(-tensor.numel() // align) * align)
        host = torch.empty(offsets[-1], dtype=dtype, pin_memory=device.type == "cuda")  # [total]
        for tensor, offset in zip(group, offsets):
            host[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        remote = host.to(device, non_blocking=True)  # [total]
        for tensor, offset in zip(group, offsets):
            moved[id(tensor)] = remote[offset : offset + tensor.numel()].view(tensor.shape)
    return moved


def _rebuild(value: Any, moved: dict[int, torch.Tensor]) -> Any:  # any tree of dataclasses and containers
    if isinstance(value, torch.Tensor):
        return moved.get(id(value), value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _rebuild(getattr(value, f.name), moved)
            for f in dataclasses.fields(value)
            if f.init and f.metadata.get("device_copy", True)
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(_rebuild(item, moved) for item in value)
    if isinstance(value, list):
        return [_rebuild(item, moved) for item in value]
    if isinstance(value, dict):
        return {key: _rebuild(item, moved) for key, item in value.items()}
    return value
