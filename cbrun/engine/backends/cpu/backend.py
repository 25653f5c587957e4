"""The CPU backend: the compiled kernels, the kernel linears and the fused decoder layers, as one object.

The engine core wires this and nothing else of the CPU path. At install it
routes the model's linear layers through the compiled linear kernel
(linear.py), gives Llama-shaped decoder layers the fused forward
(fused/layers.py) and decides once whether the compiled attention applies
to the model; per step its metadata builder plans the attention tasks, and
the kernels run. The "kernel layout or torch" dispatch of attention is
KernelBackend's (kernel_backend.py); this backend supplies the compiled
attention (CpuAttention) and what else it runs itself, and reaches the torch
reference through `self.reference` where it runs nothing of its own.
Every kernel gives a row the same bits whatever else is in its step (batch
invariance), so what this backend computes for a request never depends on
its neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cbrun.engine.backends.base import BackendUnavailable, KernelRows
from cbrun.engine.backends.cpu.fused.attention_tasks import plan_tasks
from cbrun.engine.backends.cpu.fused.layers import LayerPlan, install_fused_layers
from cbrun.engine.backends.cpu.kernels.cpu_kernels import CpuKernels
from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights
from cbrun.engine.backends.cpu.linear.install import install_linear_methods, linear_shapes
from cbrun.engine.backends.cpu.linear.method_selector import MethodChoice, choose_linear_method
from cbrun.engine.backends.cpu.linear.methods import LayerMethod, LinearMethod, MemberForward
from cbrun.engine.backends.kernel_backend import KernelBackend
from cbrun.engine.backends.metadata import SequenceRows
from cbrun.engine.host_memory import give_back_memory, keep_freed_blocks
from cbrun.engine.model_spec import CausalLM, ModelSpec
from cbrun.engine.request import Request
from cbrun.engine.sample.sampler import Sampled, sample
from cbrun.engine.sample.scoring import ScoredRows, score_logits


class CpuAttention:
    """The compiled paged attention (attention.c) as a KernelBackend runs it."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.paired_keys = False  # whether the key pools hold their pages pair-major (CpuBackend.install decides)

    def covers(self, spec: ModelSpec) -> str:
        kv = spec.kv
        group = spec.num_heads // kv.num_kv_heads
        if spec.softcaps_attention:
            return "the model soft-caps attention scores, which the kernel does not"
        if not self.kernels.supports_attention(kv.dtype, group, kv.head_dim):
            return f"the kernel does not take {kv.dtype} heads of {kv.head_dim} in groups of {group}"
        return ""

    def plan_rows(self, seqs: Sequence[SequenceRows], page_size: int, windowed: bool) -> tuple[torch.Tensor, ...]:
        """The kernel's tasks (rows [R], start [T + 1], shared keys [T]): rows sharing leading pages together."""
        return plan_tasks(seqs, page_size, self.kernels.segment, windowed)  # shared keys in whole segments

    def attend(
        self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: KernelRows, scale: float
    ) -> torch.Tensor:
        """Query rows [H, R, D] over their own keys, read in place -> [R, H, D]."""
        return self.kernels.attend(
            query.transpose(0, 1),  # [R, H, D] rows apart as the step's q|k|v columns lie: read in place
            k_pool,
            v_pool,
            rows,
            rows.plan,
            scale,
            self.paired_keys,
        )


class CpuBackend(KernelBackend):
    """Compiled CPU kernels for linears, fused layers, attention, K/V writes and sampling.

    Attention falls back to the torch reference for models the kernel does
    not cover (soft-capped scores, head shapes past its limits); the linears
    and fused layers still run compiled then.
    """

    name = "cpu"

    def __init__(
        self, kernels: CpuKernels, policy: str = "portable", quantization: str | None = None, keep_dense: bool = False
    ) -> None:
        self.cpu_attention = CpuAttention(kernels)
        super().__init__(self.cpu_attention)  # the torch layout until install finds the attention applies
        self.kernels = kernels
        self.policy = policy  # which linear methods may serve (linear/method_selector.py)
        self.quantization = quantization  # "int8": W8A8 for every linear but the output head (linear/int8.py)
        self.keep_dense = keep_dense  # the methods pack copies; the model keeps its own tensors (HeldWeights)
        self.linears: dict[torch.nn.Linear, LayerMethod | MemberForward] = {}
        self.fused_layers: list[LayerPlan] = []
        self.held: HeldWeights | None = None  # the weights the layer methods hold, while installed
        self.method_choices: list[MethodChoice] = []
        self.attention_brief = ""  # "attention AMX's order on twin (...)" where bf16 attention takes AMX's order

    def install(self, model: CausalLM, spec: ModelSpec) -> None:
        """Choose a linear method per weight dtype (after its self-check), give Llama-shaped decoder layers the
        fused forward and every linear layer its layer method, which from then on holds its weight (one copy,
        packed layer by layer as the checkpoint is read); decide whether the compiled attention applies."""
        head = model.get_output_embeddings() if self.quantization else None
        self.method_choices = [
            choose_linear_method(self.kernels, dtype, shapes, self.policy)
            for dtype in (torch.float32, torch.bfloat16)
            if (shapes := linear_shapes(model, dtype, only=head))
        ]
        methods: dict[torch.dtype, LinearMethod] = {
            c.dtype: c.method for c in self.method_choices if c.method is not None
        }
        self.held = HeldWeights(model, self.keep_dense)
        dtype = _dtype_of(model)
        method = methods.get(dtype) if dtype is not None else None
        if self.quantization == "int8":
            method = self._install_int8(model, head, methods)
        self.fused_layers = install_fused_layers(model, self.kernels, method, self.held)
        self.linears = install_linear_methods(model, self.kernels, methods, self.held)
        give_back_memory()  # the dropped tensors' heap pages
        keep_freed_blocks()  # from now on: a step's big buffers reused, not mapped afresh (host_memory.py)
        self.install_attention(spec)
        # keys written pair-major where a vector variant of AMX's order reads them (no transpose per step)
        self.cpu_attention.paired_keys = self.attends_rows and self.kernels.paired_keys_for(
            spec.kv.dtype, spec.kv.head_dim
        )
        if self.attends_rows and self.kernels.tile_order(spec.kv.dtype, spec.kv.head_dim):
            variant = self.kernels.attend_dp_variant
            self.attention_brief = f"attention AMX's order on {variant} (same bits on every CPU)"

    def _install_int8(
        self, model: CausalLM, head: torch.nn.Module | None, methods: dict[torch.dtype, LinearMethod]
    ) -> LinearMethod:
        """Give the output head its method in the model's dtype, choose the int8 method (after its self-check) and
        make it the method of every other linear, fp32 and bf16 alike; returns it."""
        assert self.held is not None  # made by install first
        if head is not None:
            install_linear_methods(head, self.kernels, methods, self.held)  # the head stays in its dtype
        shapes = sorted(
            {s for dtype in (torch.float32, torch.bfloat16) for s in linear_shapes(model, dtype, skip=head)},
            key=lambda s: (s.inputs, s.outputs),
        )
        choice = choose_linear_method(self.kernels, torch.int8, shapes, self.policy)
        if choice.method is None:
            raise BackendUnavailable(f"int8: {choice.summary()}")
        self.method_choices.append(choice)
        methods.clear()
        methods.update({torch.float32: choice.method, torch.bfloat16: choice.method})
        return choice.method

    def close(self, restore: bool = True) -> None:
        """Give the model its dense weights and its own forwards back (bit for bit, one method at a time), or
        (restore=False) only free the packed weights."""
        if self.held is not None:
            self.held.restore(weights=restore)
        self.linears, self.fused_layers, self.held = {}, [], None

    def load_weights(self, model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> int:
        """New weights straight into the methods that hold them (only the members named are packed again), the
        rest into the model; the fused layers read their norms again."""
        if self.held is None:
            return self.reference.load_weights(model, tensors)
        count = self.held.load(tensors)
        for plan in self.fused_layers:
            plan.refresh_norms()
        return count

    def weight_bytes(self, model: CausalLM) -> int:
        """Bytes held for the model's weights: the methods' packed matrices and every tensor the model keeps."""
        return self.held.nbytes() if self.held is not None else self.reference.weight_bytes(model)

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.kernels.write_kv(k_pool, key, slots, paired=self.cpu_attention.paired_keys)
        self.kernels.write_kv(v_pool, value, slots)

    def project(self, head: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits straight from the kernel's fp32 sums, in one order for every row count."""
        layer = self.linears.get(head)
        if layer is None:
            return self.reference.project(head, rows)
        return layer(rows, torch.float32)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> Sampled:
        return sample(logits, requests, self.kernels)

    def score(self, logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> ScoredRows:
        return score_logits(logits, targets, top_k, self.kernels)

    def linear_kernels(self) -> str:
        """The method serving each weight dtype, and bf16 attention's variant, and whether their bits are the same on
        every CPU."""
        briefs = [choice.brief() for choice in self.method_choices] + [self.attention_brief]
        return "; ".join(b for b in briefs if b) or self.name

    def describe(self) -> str:
        attention = "compiled" if self.attends_rows else "torch"
        methods = "; ".join(c.summary() for c in self.method_choices) or "no linear layers"
        return (
            f"cpu (compiled kernels; {len(self.linears)} linears, {len(self.fused_layers)} fused layers, "
            f"{attention} attention; linear methods: {methods})"
        )


def _dtype_of(model: CausalLM) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (its compute dtype)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
