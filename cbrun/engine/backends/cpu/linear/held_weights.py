"""One copy of the weights: while the CPU backend is installed, its layer methods hold the linear weights.

A layer method that packs (bf16 pair-dot, oneDNN) keeps its weights in the
layout its kernel reads. Keeping the model's own tensors beside those packs
would hold every weight twice (three times where a fused layer packed its
linears again), so each module's dense tensor is dropped as soon as its
method holds it: the parameter keeps its shape and dtype but no memory, and,
where it lay in a memory-mapped checkpoint, the pages it was read from are
given back to the OS at once, so loading streams tensor by tensor and the
peak stays near one copy.

While installed, the packs are the weights: `load` writes new values
straight into them (only the members named; a linear read in place takes
the new tensor itself where it can, weights.place), `nbytes` counts what the engine
holds, and `restore` gives the model its dense tensors back, bit for bit,
method by method (each pack freed as soon as its members are out, so the
peak stays one copy plus one layer).

A tied output head (its weight is also a plain `nn.Embedding`'s table) keeps
one table: the embedding looks its rows up in the head's packed matrix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Mapping
from typing import Any

import torch

from cbrun.engine.backends.cpu.linear.int8 import PREQUANTIZED
from cbrun.engine.backends.cpu.linear.methods import LayerMethod
from cbrun.engine.weights import checked_targets, distinct_updates, model_weight_bytes, place

_MADV_DONTNEED = 4


class HeldWeights:
    """The model's linear modules whose weights a layer method holds, and what was dropped for them.

    keep_dense: the model's tensors stay as they are (a trainer's parameters, which its optimizer updates):
    the methods pack copies, nothing is dropped and no page is given back (cbrun/training).
    """

    def __init__(self, model: torch.nn.Module, keep_dense: bool = False) -> None:
        self.model = model
        self.keep_dense = keep_dense
        self.holders: dict[torch.nn.Linear, tuple[LayerMethod, int]] = {}  # module -> (method, member)
        self.forwards: dict[torch.nn.Module, Any] = {}  # modules whose forward this install replaced, and by what
        self._users = _parameter_users(model)  # id(parameter) -> the modules that use it
        self._mapped = _file_mappings()

    def route(self, module: torch.nn.Module, forward: Any) -> None:
        """Make `forward` the module's forward (per instance) until `restore`."""
        module.forward = forward
        self.forwards[module] = forward

    def hold(self, module: torch.nn.Linear, method: LayerMethod, member: int) -> None:
        """`module`'s weight is member `member` of `method` from now on: where the method keeps its own copy, the
        module's dense tensor is dropped (a tied plain embedding then reads its rows from the method)."""
        self.holders[module] = (method, member)
        if not method.owns_weights or self.keep_dense:
            return
        weight = module.weight
        others = [m for m in self._users.get(id(weight), []) if m is not module]
        if others and (not method.serves_rows or any(type(m) is not torch.nn.Embedding for m in others)):
            return  # read elsewhere in a way the method cannot serve: keep the dense copy
        for embedding in others:
            self.route(embedding, functools.partial(_lookup, method, member))
        self._drop(weight)

    def _drop(self, parameter: torch.Tensor) -> None:
        old = parameter.data
        parameter.data = torch.zeros((), dtype=old.dtype).expand(old.shape)  # the shape, and no memory behind it
        _release_pages(old, self._mapped)

    def restore(self, weights: bool = True) -> None:
        """Give every module its dense weight back (read out of its method, bit for bit) and its own forward;
        each method's storage is freed as soon as its members are out. weights=False: the model is being
        discarded; the methods' storage is freed and the dropped weights stay empty."""
        by_method: dict[int, list[tuple[torch.nn.Linear, int]]] = {}
        methods: dict[int, LayerMethod] = {}
        for module, (method, member) in self.holders.items():
            by_method.setdefault(id(method), []).append((module, member))
            methods[id(method)] = method
        for key, members in by_method.items():
            method = methods[key]
            if method.owns_weights and weights:
                for module, member in members:
                    if module.weight.stride() == (0, 0):  # dropped (a kept tied copy is still whole)
                        dense = method.weight(member)
                        module.weight.data = dense
                        if hasattr(dense, PREQUANTIZED):  # an int8 method's weight keeps its int8 form beside it
                            setattr(module.weight, PREQUANTIZED, getattr(dense, PREQUANTIZED))
            method.release()
        for routed in self.forwards:
            routed.__dict__.pop("forward", None)
        self.holders, self.forwards = {}, {}

    def load(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Put new weights (name -> tensor, names of `model.state_dict()`) in: a held linear's weight packed
        straight into its method, anything else into the model (weights.place: taken where it can be read as
        it is, else copied), and a linear read in place reads it from there. Every name and shape is checked
        before anything is written; names not given keep their values, a tensor given twice (a tied weight's
        two names) goes in once. Returns how many names were given."""
        targets = checked_targets(self.model, tensors)  # a dropped weight keeps its shape: checked as any other
        owners: dict[int, tuple[LayerMethod, int, str]] = {}
        for module, (method, member) in self.holders.items():
            owners[id(module.weight)] = (method, member, "weight")
            if module.bias is not None:
                owners[id(module.bias)] = (method, member, "bias")
        with torch.no_grad():
            for target, value in distinct_updates(targets, tensors):
                owner = owners.get(id(target))
                if owner is not None and owner[2] == "weight" and owner[0].owns_weights and target.stride() == (0, 0):
                    owner[0].load(owner[1], weight=value)  # packed from the new tensor: the only copy
                    continue
                place(target, value)
                if owner is not None:  # the method reads the model's tensor (in place), or keeps its own of it
                    method, member, part = owner
                    method.load(member, **{part: target.detach()})
        return len(tensors)

    def nbytes(self) -> int:
        """Bytes of weights held: the methods' own storage plus every model tensor with memory behind it."""
        methods = {id(method): method for method, _ in self.holders.values()}
        return sum(method.nbytes for method in methods.values()) + model_weight_bytes(self.model)


def _lookup(method: LayerMethod, member: int, input_ids: torch.Tensor) -> torch.Tensor:
    """A plain nn.Embedding's forward over the table a tied head's method holds: ids [...] -> [..., K]."""
    ids = input_ids.reshape(-1).to(torch.int64).contiguous()
    return method.rows(member, ids).view(*input_ids.shape, -1)


def _parameter_users(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    users: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                users.setdefault(id(parameter), []).append(module)
    return users


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's memory that map a file (a safetensors checkpoint, read in place)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/") and not fields[5].startswith("/dev/"):
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((low, high))
    except OSError:
        pass
    return ranges


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _release_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Give back the pages of a dropped tensor that lies in a file mapping (a checkpoint read in place): the file
    keeps its data, our resident set drops it. Only the whole pages inside the tensor's bytes; nothing else is
    read from them (the tensor was dropped). Anonymous memory is freed with its last reference instead."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in mapped):
        return
    libc = _libc()
    if libc is None:
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
