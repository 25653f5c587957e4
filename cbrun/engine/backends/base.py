"""The compute backend: the one object the engine core wires to run a model on a device.

A backend is chosen once, at engine start, and owns everything device-specific:

- what it installs on the model (the CPU backend's kernel linears and fused
  decoder layers),
- the step's attention metadata: its own builder lays every step out the way
  its attention reads it (vLLM's metadata builders): the torch reference's
  padded rows and SDPA chunks, or every token a row of its sequence's block
  table with the kernel's own plan of the rows (the CPU kernel's tasks, the
  Triton kernel's query blocks),
- the K/V writes and the attention over the page pools,
- the output head's projection and the sampler.

The per-step batch (step/batch.py) then carries tensors only, and the
attention function (step/attention.py) asks the backend that the runner hands
it. `Backend` names what the engine asks of any backend; the engine core, the
step and the selector hold a backend by that protocol only. The torch backend
here is the reference every other backend is tested against: plain torch ops
on any device (torch_attention.py). The device backends (cpu/, cuda/) are
KernelBackends (kernel_backend.py): each supplies its compiled attention over
the kernel row layout below, and holds this backend for the rest;
selector.py picks one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cbrun.engine.backends import openmp, torch_attention
from cbrun.engine.backends.metadata import AttentionMetadataBuilder, PagedRows, PrefillSeq, RowLayout, SequenceRows
from cbrun.engine.model_spec import CausalLM, ModelSpec
from cbrun.engine.request import Request
from cbrun.engine.sample.sampler import Sampled, sample
from cbrun.engine.sample.scoring import ScoredRows, score_logits
from cbrun.engine.weights import load_into, model_weight_bytes


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here (no compiler, no Triton, wrong device); the message says why."""


class Backend(Protocol):
    """What the engine asks of a compute backend, from install to close. TorchBackend is the reference."""

    name: str
    metadata_builder: AttentionMetadataBuilder  # lays out each step's attention (as decided at install)

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Patch what the backend runs itself into the model, and decide what applies to it."""
        ...

    def close(self, restore: bool = True) -> None:
        """Give the model back as it came (apart from its attention implementation); restore=False: the caller
        discards the model, so weights held in the backend's own layout are freed, not given back."""
        ...

    def load_weights(self, model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy new weights (names of `model.state_dict()`) in, wherever the backend keeps them; all names and
        shapes checked before anything is written. Returns how many were written."""
        ...

    def weight_bytes(self, model: CausalLM) -> int:
        """Bytes held for the model's weights while installed (each storage once)."""
        ...

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store the new tokens' K/V ([H_kv, T, D]) at their flat slots [T] of the pools [H_kv, NB, P, D]."""
        ...

    def attend_rows(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        rows: RowLayout,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys, as `metadata_builder` laid them out -> [R, H, D]."""
        ...

    def project(self, head: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
        """The output head: rows [n, hidden] -> fp32 logits [n, V]."""
        ...

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> Sampled:
        """One token per row of fp32 logits [N, V] for the matching request."""
        ...

    def score(self, logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> ScoredRows:
        """Logprobs of the targets [c] under logits [c, V], bitwise what `sample` reports."""
        ...

    def describe(self) -> str:
        """One line for the log: the backend and what of it applies to this model."""
        ...

    def linear_kernels(self) -> str:
        """What serves the linear layers, for the run summary: the method per weight dtype where the backend
        chose one at install, else the backend's name."""
        ...

    def before_loop_thread(self) -> None:
        """Called in the thread that made the engine, just before the engine's loop thread starts: what the
        process needs before that thread computes."""
        ...


@dataclass
class KernelRows(PagedRows, RowLayout):
    """Every query token of the step a row of its sequence's block table (PagedRows), read in place by a compiled
    kernel, with that kernel's own plan of the rows."""

    plan: tuple[Any, ...]  # the backend's own plan of the rows, tensors and sizes (the CPU tasks, the Triton blocks)


RowPlanner = Callable[[Sequence[SequenceRows], int, bool], tuple[Any, ...]]  # (seqs, page size, windowed)


class KernelMetadataBuilder:
    """The compiled kernels' layout: every token a row, whatever its sequence (one arithmetic for all).

    `plan(seqs, page_size, windowed)` adds the backend's own plan of the rows.
    """

    def __init__(self, plan: RowPlanner) -> None:
        self.plan = plan

    def attends_as_row(self, start: int, count: int) -> bool:
        return True

    def build(
        self, seqs: Sequence[SequenceRows], page_size: int, window: int | None
    ) -> tuple[KernelRows, list[PrefillSeq]]:
        max_pages = max(len(seq.table) for seq in seqs)
        lengths: list[int] = []
        row_seq: list[int] = []
        for index, seq in enumerate(seqs):
            lengths.extend(range(seq.start + 1, seq.start + seq.count + 1))  # causal: keys up to the token's own
            row_seq.extend([index] * seq.count)
        lows = [max(0, n - window) if window is not None else 0 for n in lengths]
        rows = KernelRows(
            tables=torch.tensor(
                [seq.table + [seq.table[0]] * (max_pages - len(seq.table)) for seq in seqs], dtype=torch.long
            ),
            row_seq=torch.tensor(row_seq, dtype=torch.long),
            first_page=torch.tensor([seq.first_page for seq in seqs], dtype=torch.long),
            kv_len=torch.tensor(lengths, dtype=torch.long),
            kv_lo=torch.tensor(lows, dtype=torch.long),
            plan=self.plan(seqs, page_size, window is not None),
        )
        return rows, []


def metadata_builder_for(plan: RowPlanner | None) -> AttentionMetadataBuilder:
    """The layout of a backend whose compiled kernel attends every row with this plan of them, or (None) the
    torch reference's, for a backend whose kernel does not cover the model."""
    return KernelMetadataBuilder(plan) if plan is not None else torch_attention.TorchMetadataBuilder()


class TorchBackend:
    """Reference backend: torch ops only, on any device.

    Decodes and short chunks over a cached context are attended row by row
    over their gathered pages with a key bias; other chunks go through SDPA
    per sequence (torch_attention.TorchMetadataBuilder lays the step out).
    """

    name = "torch"

    def __init__(self) -> None:
        self.metadata_builder = metadata_builder_for(None)

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Patch what the backend runs itself into the model (nothing for torch)."""

    def close(self, restore: bool = True) -> None:
        """Give the model back as it came (apart from its attention implementation)."""

    def load_weights(self, model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy new weights into the model's own tensors (the torch backend keeps nothing of its own)."""
        return load_into(model, tensors)

    def weight_bytes(self, model: CausalLM) -> int:
        return model_weight_bytes(model)

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store the new tokens' K/V ([H_kv, T, D]) at their flat slots [T] of the pools [H_kv, NB, P, D]."""
        torch_attention.write(k_pool, v_pool, key, value, slots)

    def attend_rows(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        rows: RowLayout,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys -> [R, H, D] (the torch path)."""
        assert isinstance(rows, torch_attention.TorchRows)  # laid out by the torch builder
        return torch_attention.decode(query, k_pool, v_pool, rows, scale, softcap)

    def project(self, head: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
        """The output head: rows [n, hidden] -> fp32 logits [n, V]."""
        return F.linear(rows, head.weight, head.bias).float()

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> Sampled:
        """One token per row of fp32 logits [N, V] for the matching request."""
        return sample(logits, requests)

    def score(self, logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> ScoredRows:
        """Logprobs of the targets [c] under logits [c, V], bitwise what `sample` reports."""
        return score_logits(logits, targets, top_k)

    def describe(self) -> str:
        return self.name

    def linear_kernels(self) -> str:
        return self.name

    def before_loop_thread(self) -> None:
        """Free this thread's idle OpenMP workers, so the loop thread's pool is the only one (openmp.py)."""
        openmp.release_caller_threads()
