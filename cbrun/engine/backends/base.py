"""The compute backend: the one object the engine core wires to run a model on a device.

A backend is chosen once, at engine start, and owns everything device-specific:

- what it installs on the model (the CPU backend's kernel linears and fused
  decoder layers),
- how the step's attention rows are planned (extra per-step tensors its
  kernel wants: the CPU kernel's tasks, the Triton kernel's query blocks),
- the K/V writes and the attention over the page pools,
- the output head's projection and the sampler.

The per-step batch (step/batch.py) then carries tensors only, and the
attention function (step/attention.py) asks the backend that the runner hands
it. The torch backend here is the reference every other backend is tested
against: plain torch ops on any device, gathering each row's pages into a
padded copy. `Backend` names what the engine asks of any backend; the engine
core, the step and the selector hold a backend by that protocol only. The
device backends (cpu/, cuda/) build on the torch backend and import nothing
else of this package; selector.py picks one by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from cbrun.engine.backends import torch_attention
from cbrun.engine.model_spec import CausalLM, ModelSpec
from cbrun.engine.request import Request
from cbrun.engine.step.batch import DecodeLayout, SequenceRows
from cbrun.engine.step.sampler import Sampled, sample
from cbrun.engine.step.scoring import ScoredRows, score_logits


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here (no compiler, no Triton, wrong device); the message says why."""


class Backend(Protocol):
    """What the engine asks of a compute backend, from install to close. TorchBackend is the reference."""

    name: str
    attends_rows: bool  # every query token a row with its own key range (the kernels' layout)

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Patch what the backend runs itself into the model, and decide what applies to it."""
        ...

    def close(self) -> None:
        """Give the model back as it came (apart from its attention implementation)."""
        ...

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[torch.Tensor | int, ...]:
        """Extra per-step tensors the row attention wants for these sequences."""
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
        rows: DecodeLayout,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys -> [R, H, D]."""
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


class TorchBackend:
    """Reference backend: torch ops only, on any device.

    Decodes and short chunks over a cached context are attended row by row
    over their gathered pages with a key bias; other chunks go through SDPA
    per sequence (batch.py lays the step out that way when `attends_rows` is
    False).
    """

    name = "torch"
    attends_rows = False  # every query token a row with its own key range (the kernels' layout)

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Patch what the backend runs itself into the model (nothing for torch)."""

    def close(self) -> None:
        """Give the model back as it came (apart from its attention implementation)."""

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[torch.Tensor | int, ...]:
        """Extra per-step tensors the row attention wants for these sequences (kernel backends only)."""
        return ()

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
        rows: DecodeLayout,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys -> [R, H, D] (the torch path; kernels override)."""
        return torch_attention.decode(query, k_pool, v_pool, rows.per_row(), scale, softcap)

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
