"""New weights into a running model, and weights parked while the engine sleeps.

`read_weights` turns what an RL trainer hands over (a state dict, (name,
tensor) pairs as vLLM's `load_weights` takes, a checkpoint directory or a
safetensors file) into one name -> tensor mapping. `load_into` puts it into
the model, after checking every name and shape first, so a bad update changes
nothing: a tensor the model can read as it is (same dtype, device and layout)
is taken, not copied; others are copied, converting dtype and device. `WeightStash` moves
the parameters out of the model (to a file, or to a dict the caller owns)
and back, for a level-2 sleep.

The engine core calls these with its compute backend closed, so that
whatever the backend derived from the weights (packed copies, fused layer
plans) is rebuilt from the new ones.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

import torch

WeightSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike
StashTarget = str | os.PathLike | MutableMapping | None  # where a level-2 sleep parks the weights (WeightStash)


def read_weights(source: WeightSource) -> dict[str, torch.Tensor]:
    """Name -> tensor from a mapping, (name, tensor) pairs, a safetensors file, a .bin/.pt
    state dict, or a checkpoint directory (every *.safetensors file in it, else pytorch_model*.bin)."""
    if isinstance(source, (str, os.PathLike)):
        return _read_path(Path(source))
    pairs = source.items() if isinstance(source, Mapping) else source
    out = {}
    for entry in pairs:
        if not (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], torch.Tensor)
        ):
            raise TypeError(
                "weights must map parameter names to tensors (a state dict or (name, tensor) pairs), "
                f"got an entry {type(entry).__name__}"
            )
        out[entry[0]] = entry[1]
    return out


def _read_path(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin file in this directory")
        out: dict[str, torch.Tensor] = {}
        for file in files:
            out.update(_read_path(file))
        return out
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return read_weights(state)


def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Put `tensors` into the model's parameters and buffers of the same names; returns how many were given.

    Every name and shape is checked before anything is written. Names not
    given keep their values (a partial update is allowed). A tensor the
    model can use as it is, is taken, not copied (`place`).
    """
    targets = checked_targets(model, tensors)
    with torch.no_grad():
        for target, value in distinct_updates(targets, tensors):
            place(target, value)
    return len(tensors)


def distinct_updates(
    targets: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, new value) for each name given, each pair once: a tied weight's two names (embedding and
    head) given the same tensor, as `state_dict()` gives them, are one update."""
    pairs: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, value in tensors.items():
        target = targets[name]
        pairs.setdefault((id(target), value.data_ptr(), tuple(value.stride())), (target, value))
    return list(pairs.values())


def shareable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `value` can stand for `target` as it is: same dtype, device, shape and layout (contiguous)."""
    return (
        value.dtype == target.dtype
        and value.device == target.device
        and value.shape == target.shape
        and value.is_contiguous()
        and target.is_contiguous()
    )


def place(target: torch.Tensor, value: torch.Tensor) -> None:
    """Give the model tensor `target` the values of `value` without a copy where it can: nothing when it already
    is that memory, `value`'s memory taken (shared) when `shareable`, else copied (converting dtype, device).

    A taken tensor is read in place from then on: an in-process trainer's state dict shares its parameters'
    memory with the engine, and changes the engine's weights when it steps; `update_weights` again after
    changing them (the prefix cache is dropped then), and do not change them while requests run."""
    if value.data_ptr() == target.data_ptr() and shareable(target, value):
        return
    if shareable(target, value):
        target.data = value.detach()
    else:
        target.copy_(value)


def checked_targets(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name (`model.state_dict()`'s names, the tensors themselves), once
    every name in `tensors` is known and every shape matches; raises KeyError or ValueError naming the first
    that does not, before anything is written."""
    targets = model.state_dict(keep_vars=True)  # name -> the Parameter or buffer itself
    unknown = [name for name in tensors if name not in targets]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise KeyError(f"not a weight of this model: {shown} (names are those of model.state_dict())")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} does not match the model's {tuple(targets[name].shape)}"
            )
    return targets


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes behind the model's parameters and buffers, each storage once (tied weights count once); a
    tensor with no memory behind it (all strides 0: a weight a backend holds in its own layout) counts 0."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.dim() and all(stride == 0 for stride in tensor.stride()):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class WeightStash:
    """The model's parameters while the engine sleeps at level 2: in a safetensors file, or in a dict
    the caller named (the tensors are handed over as they are, no copy)."""

    def __init__(self, model: torch.nn.Module, target: StashTarget) -> None:
        self.model = model
        params = dict(model.named_parameters())  # tied weights once
        self.buffer: MutableMapping | None = None
        self.path: Path | None = None
        self._owns_file = False
        if isinstance(target, MutableMapping):
            self.buffer = target
            for name, param in params.items():
                target[name] = param.data
        else:
            self.path, self._owns_file = _stash_path(target)
            from safetensors.torch import save_file

            save_file({name: param.data.contiguous() for name, param in params.items()}, str(self.path))
        for param in params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def restore(self) -> None:
        """Put every parameter back, bit for bit; a file this stash created is deleted."""
        if self.buffer is not None:
            saved = {name: self.buffer.pop(name) for name in dict(self.model.named_parameters())}
        else:
            from safetensors.torch import load_file

            saved = load_file(str(self.path))
        for name, param in self.model.named_parameters():
            param.data = saved[name]
        if self._owns_file:
            assert self.path is not None  # a stash owns only a file it wrote
            self.path.unlink(missing_ok=True)


def _stash_path(target: str | os.PathLike | None) -> tuple[Path, bool]:
    """Where a level-2 sleep writes the weights: the file or directory named, else a private temp file."""
    if target is None:
        handle, name = tempfile.mkstemp(prefix="cbrun-weights-", suffix=".safetensors")
        os.close(handle)
        return Path(name), True
    path = Path(target)
    if path.is_dir():
        return path / "cbrun-sleep-weights.safetensors", True
    return path, False
