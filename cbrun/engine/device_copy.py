"""A step's host-built tensors to the accelerator in one copy.

The batch builder makes every index tensor of a step (token ids, positions,
slots, block tables, kv ranges, the backend's row plan) on the host. Sent
one by one, each small tensor would be its own host-to-device transfer, and
a copy from pageable memory makes the host wait for the device's queue: a
synchronisation per tensor per step. Here the int64 tensors are laid end to
end in one pinned buffer, sent with one asynchronous copy, and replaced by
views of the device copy. The torch reference path's masks and biases (bool
and fp32) go the same way, one pinned copy per dtype. On the CPU nothing
moves.
"""

from __future__ import annotations

import dataclasses

import torch


def to_device(batch, device: torch.device):
    """`batch` (a dataclass tree of tensors, lists and nested dataclasses) with its tensors on `device`."""
    if device.type == "cpu":
        return batch
    tensors: list[torch.Tensor] = []
    _collect(batch, tensors)
    moved = _send(tensors, device)
    return _rebuild(batch, moved)


def _collect(value, out: list[torch.Tensor]) -> None:
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
        total = sum(t.numel() for t in group)
        host = torch.empty(total, dtype=dtype, pin_memory=torch.cuda.is_available())  # [total]
        offset = 0
        for tensor in group:
            host[offset: offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()
        remote = host.to(device, non_blocking=True)  # [total]
        offset = 0
        for tensor in group:
            moved[id(tensor)] = remote[offset: offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
    return moved


def _rebuild(value, moved: dict[int, torch.Tensor]):
    if isinstance(value, torch.Tensor):
        return moved.get(id(value), value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _rebuild(getattr(value, f.name), moved) for f in dataclasses.fields(value)
                   if f.init and f.metadata.get("device_copy", True)}
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(_rebuild(item, moved) for item in value)
    if isinstance(value, list):
        return [_rebuild(item, moved) for item in value]
    if isinstance(value, dict):
        return {key: _rebuild(item, moved) for key, item in value.items()}
    return value
