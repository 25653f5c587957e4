"""A backend whose device supplies a compiled paged attention: the "kernel layout or torch" dispatch, once.

At install the device's attention kernel says whether it covers the model
(`covers`: "" or why not). Where it does, every step is laid out as kernel
rows (base.KernelRows, with the kernel's own plan of them) and attended by the
kernel; where it does not (soft-capped scores, head shapes past its limits, a
GPU where it fails its probe), the torch reference's layout and attention run.
The CPU and CUDA backends hand their kernel to this class and add only what
they run themselves (the CPU's linears, fused layers, K/V writes and
sampler); everything else is the torch reference's, reached through the
`reference` it holds, never through a base class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from cbrun.engine.backends.base import KernelRows, TorchBackend, metadata_builder_for
from cbrun.engine.backends.metadata import RowLayout, SequenceRows
from cbrun.engine.model_spec import CausalLM, ModelSpec
from cbrun.engine.request import Request
from cbrun.engine.sample.sampler import Sampled
from cbrun.engine.sample.scoring import ScoredRows


class PagedAttentionKernel(Protocol):
    """A device's compiled attention over the page pools, as a KernelBackend runs it."""

    def covers(self, spec: ModelSpec) -> str:
        """ "" when the kernel computes this model's attention, else why not (one line for the log)."""
        ...

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[Any, ...]:
        """The kernel's own plan of a step's rows (KernelRows.plan)."""
        ...

    def attend(
        self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: KernelRows, scale: float
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys, read in place -> [R, H, D]."""
        ...


class KernelBackend:
    """The Backend protocol over a device's attention kernel and the torch reference for the rest."""

    name = "kernels"

    def __init__(self, attention: PagedAttentionKernel) -> None:
        self.attention = attention
        self.reference = TorchBackend()  # what runs where the device supplies nothing (or its kernel cannot)
        self.metadata_builder = self.reference.metadata_builder  # the torch layout until install decides
        self.attends_rows = False  # whether the compiled attention covers the model (install decides)
        self.why_not = ""  # why attention stays on the torch path, when it does

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Install the device's attention (a backend that installs more on the model calls install_attention)."""
        self.install_attention(spec)

    def install_attention(self, spec: ModelSpec) -> None:
        """Decide whether the device's attention covers the model, and lay steps out for the one that runs."""
        self.why_not = self.attention.covers(spec)
        self.attends_rows = not self.why_not
        self.metadata_builder = metadata_builder_for(self.attention.plan_rows if self.attends_rows else None)

    def attend_rows(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        rows: RowLayout,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys -> [R, H, D]: the kernel for its layout, else torch."""
        if not isinstance(rows, KernelRows):  # a model the kernel does not cover: the torch layout and path
            return self.reference.attend_rows(query, k_pool, v_pool, rows, scale, softcap)
        assert not softcap  # the kernel layout is chosen only for models that do not cap (install)
        return self.attention.attend(query, k_pool, v_pool, rows, scale)

    def close(self, restore: bool = True) -> None:
        self.reference.close(restore)

    def load_weights(self, model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> int:
        return self.reference.load_weights(model, tensors)

    def weight_bytes(self, model: CausalLM) -> int:
        return self.reference.weight_bytes(model)

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.reference.write_kv(k_pool, v_pool, key, value, slots)

    def project(self, head: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
        return self.reference.project(head, rows)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> Sampled:
        return self.reference.sample(logits, requests)

    def score(self, logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> ScoredRows:
        return self.reference.score(logits, targets, top_k)

    def describe(self) -> str:
        return f"{self.name} ({'compiled' if self.attends_rows else 'torch'} attention)"

    def linear_kernels(self) -> str:
        return self.name

    def before_loop_thread(self) -> None:
        self.reference.before_loop_thread()
