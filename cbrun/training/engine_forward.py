"""The engine's forward on a trainer's model: each token's logprob with the rollout's bits.

`score` gives bitwise the logprobs `generate` recorded, because both take
one path: the CPU backend's layer methods (f32, or bf16 in AMX's tile order
on whichever method serves: tiles, vdpbf16ps or vector FMAs), the fused decoder layers (norms,
rotary and the residual stream in fp32), the compiled paged attention, the
head projected to fp32 logits and the sampler's normalizer. Every one of
them gives a row the same bits whatever else is in the call. So a trainer
gets the rollout's numbers by running that same path over its sequences:

    sequences [a0 a1 a2 a3] [b0 b1]          (prompt + completion, any lengths)
    flat      [a0 a1 a2 a3 b0 b1]            (1, T) as an engine step lays a prefill out
    positions [ 0  1  2  3  0  1]
    pages     a: blocks 0..     b: its own blocks after a's (a scratch pool, page size as the engine's)
    scored    [a0 a1 a2 | b0]   -> logprob of a1 a2 a3 | b1   (each position predicts the next token)

`EngineForward` installs the CPU backend on the trainer's model once, in a
lending mode (`keep_dense`): the layer methods hold copies in their kernels'
layout and the model keeps its own parameters, which its optimizer updates.
(A trainer that keeps fp32 weights for a bf16 engine gets a private bf16
copy instead, loaded from its weights on every call as the engine loads them.)
Outside a call the model's own forwards are back in place, so the trainer's
ordinary forward and backward run stock transformers. Each call first packs
the current parameters again (the engine's `update_weights` path), so what
it computes is what an engine holding these weights computes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from cbrun.engine.backends.cpu.backend import CpuBackend
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import SequenceRows
from cbrun.engine.cache.kv_store import KVStore
from cbrun.engine.model_spec import CausalLM, read_model_spec
from cbrun.engine.step.attention import register as register_attention
from cbrun.engine.step.batch import GroupLayout, PagedBatch
from cbrun.engine.step.model_runner import ModelRunner
from cbrun.lora.adapters import LoRAAdapters, fp32_linear_of
from cbrun.lora.peft_files import AdapterError, AdapterWeights

DEFAULT_PAGE_SIZE = 16  # the engine's default (EngineConfig.page_size): attention splits its key segments at pages
_ADAPTER = "trainer"  # the name the trainer's adapter is held under (the engine's names do not enter the bits)


class EngineForward:
    """Teacher-forced logprobs of token sequences on `model`, computed exactly as the engine computes them.

    `model` stays the caller's: its parameters are never dropped or moved. `dtype`: the engine's, when it
    is not the model's (fp32 master weights for a bf16 engine): the arithmetic then runs on a private copy
    in that dtype, loaded from the model's current weights on every call through the engine's own
    `update_weights` path (the same rounding). `page_size` must be the engine's (the attention's key segments
    split at page boundaries); `kernels` the engine's linear-method policy ("portable", the default, gives the
    same bits on every x86 CPU).
    """

    def __init__(
        self,
        model: CausalLM,
        page_size: int = DEFAULT_PAGE_SIZE,
        kernels: str = "portable",
        dtype: torch.dtype | None = None,
    ) -> None:
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ValueError(f"the engine's arithmetic runs on the CPU; this model is on {device}")
        compiled = load_cpu_kernels()
        if compiled is None:
            raise RuntimeError("the compiled CPU kernels are unavailable (no C compiler, or CBRUN_KERNELS=torch)")
        self.source = model  # the trainer's model, whose current weights every call computes with
        self.lending = dtype is None or dtype == model_dtype(model)  # else a private copy in the engine's dtype
        self.model = model if dtype is None or self.lending else _copy_in(model, dtype)
        self.page_size = page_size
        self.spec = read_model_spec(self.model, None)
        self.attention = register_attention()
        self.backend = CpuBackend(compiled, kernels, keep_dense=self.lending)
        self.backend.install(self.model, self.spec)
        assert self.backend.held is not None  # installed
        self.held = self.backend.held
        self.routes = dict(self.held.forwards)  # module -> the forward the engine gives it
        self._route(False)
        grouped = getattr(self.backend.kernels, "lora", None)
        self.max_lora_rank = grouped.max_rank if grouped is not None else 0
        self.adapters = LoRAAdapters(self.model, self.max_lora_rank, 1, fp32_linear_of(self.backend), grouped)
        if not self.backend.attends_rows:
            self.close()
            raise ValueError(
                f"{model.config.model_type}: the compiled attention does not cover this model (soft-capped scores "
                "or its head shape), so the engine itself is not batch-invariant on it"
            )
        self.runner = ModelRunner(self.model, self.backend, self.adapters)

    def logprobs(self, sequences: Sequence[Sequence[int]], adapter: AdapterWeights | None = None) -> list[torch.Tensor]:
        """For each sequence of n >= 1 token ids, fp32 [n - 1]: the logprob of tokens 1..n-1, each given
        the tokens before it, at temperature 1, bit for bit what `generate` reports and `score` gives
        (under LoRA `adapter` on every token: what an engine holding it gives requests that name it; the
        engine's grouped LoRA call serves ranks up to `max_lora_rank`, an engine's max_lora_rank up to it)."""
        lengths = [len(s) for s in sequences]
        if not lengths:
            return []
        if any(n < 1 for n in lengths):
            raise ValueError("every sequence needs at least one token")
        targets = torch.tensor([t for s in sequences for t in list(s)[1:]], dtype=torch.long)  # [sum n - 1]
        values: list[float] = []
        self._hold(adapter)
        with self.engine_arithmetic():
            batch = self._batch(sequences)
            if adapter is not None:
                batch.lora = self.adapters.step({_ADAPTER: range(batch.num_rows)}, batch.num_rows)
            step = self.runner.forward(batch)
            for start, logits in self.runner.score_chunks(step):  # [c, V] fp32, as score's chunks
                chunk = targets[start : start + logits.shape[0]]
                values.extend(self.backend.score(logits, chunk, 0).logprobs)
        flat = torch.tensor(values, dtype=torch.float32)  # fp32 -> Python float -> fp32: exact
        return list(flat.split([n - 1 for n in lengths]))

    @contextmanager
    def engine_arithmetic(self) -> Iterator[None]:
        """The model computes as the engine does inside: the current parameters packed again, the engine's
        forwards routed in, its attention switched on, eval mode (no dropout); all given back on exit."""
        model = self.model
        training = model.training
        previous = model.config._attn_implementation
        self._refresh()
        self._route(True)
        model.eval()
        model.set_attn_implementation(self.attention)
        try:
            yield
        finally:
            model.set_attn_implementation(previous)
            self._route(False)
            model.train(training)

    def close(self) -> None:
        """Free the packed copies (and the private copy in the engine's dtype); the model is left as it came."""
        self.adapters.close()  # its hooks off the model
        self._route(True)  # the backend's restore takes the routes off itself
        self.backend.close(restore=self.lending)  # a private copy is dropped whole: nothing to give back

    def _hold(self, adapter: AdapterWeights | None) -> None:
        """Hold `adapter`'s current A and B as an engine's update_lora loads them (fp32, the scaling folded into B
        once), or none."""
        if adapter is None:
            self.adapters.remove(_ADAPTER)
            return
        rank = max((a.shape[0] for a, _ in adapter.pairs.values()), default=0)
        if rank > self.max_lora_rank:
            raise AdapterError(
                f"LoRA rank {rank} is over {self.max_lora_rank}, the most the engine's grouped LoRA call computes"
            )
        self.adapters.load(_ADAPTER, adapter)

    def _refresh(self) -> None:
        """Give the methods the model's current weights, as an engine's `update_weights` does: lending, each
        linear packed again from its parameter (a method that reads in place takes the parameter's tensor
        itself) and the fused layers' norms read again; with a copy in the engine's dtype, the trainer's whole
        state dict loaded into it through the backend (rounded as the engine rounds it)."""
        if not self.lending:
            self.backend.load_weights(self.model, self.source.state_dict())
            return
        for module, (method, member) in self.held.holders.items():
            bias = module.bias.detach() if module.bias is not None else None
            method.load(member, weight=module.weight.detach(), bias=bias)  # in-place methods: the tensor, no copy
        for plan in self.backend.fused_layers:
            plan.refresh_norms()

    def _route(self, on: bool) -> None:
        for module, forward in self.routes.items():
            if on:
                module.forward = forward
            else:
                module.__dict__.pop("forward", None)

    def _batch(self, sequences: Sequence[Sequence[int]]) -> PagedBatch:
        """Every sequence a fresh prefill from position 0 in its own pages of a scratch pool; every position
        but each sequence's last kept for scoring."""
        page = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        score_rows: list[int] = []
        seqs: list[SequenceRows] = []
        blocks = 0
        for sequence in sequences:
            count = len(sequence)
            table = list(range(blocks, blocks + -(-count // page)))
            blocks += len(table)
            seqs.append(SequenceRows(len(ids), 0, count, table, 0))
            score_rows.extend(range(len(ids), len(ids) + count - 1))
            slots.extend(table[p // page] * page + p % page for p in range(count))
            ids.extend(int(t) for t in sequence)
            positions.extend(range(count))
        store = KVStore(self.spec.kv, blocks, page, torch.device("cpu"))
        groups = {}
        for group in sorted(set(self.spec.layer_groups)):
            window = self.spec.sliding_window if group == "sliding" else None
            rows, prefills = self.backend.metadata_builder.build(seqs, page, window)
            groups[group] = GroupLayout(torch.tensor(slots, dtype=torch.long), rows, prefills)
        return PagedBatch(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([positions], dtype=torch.long),
            logits_indices=torch.zeros(0, dtype=torch.long),
            sampled=[],
            num_decode=0,
            num_rows=len(ids),
            groups=groups,
            store=store,
            layer_groups=self.spec.layer_groups,
            score_indices=torch.tensor(score_rows, dtype=torch.long),
        )


def model_dtype(model: Any) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (what the engine computes in)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _copy_in(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """`model`'s architecture in `dtype`, holding its weights rounded to `dtype` and its buffers as they are (the
    rotary tables stay fp32, as in a model loaded in `dtype`); built on the meta device, so the model's own
    tensors are never copied whole in their dtype. Its config is its own (the attention is switched on it)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        copy_ = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
    copy_.to_empty(device=torch.device("cpu"))
    copy_.tie_weights()  # a tied head is one tensor again (to_empty made two)
    copy_.requires_grad_(False)
    copy_.eval()
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        copy_.get_submodule(owner)._buffers[leaf] = buffer.detach().clone()
    with torch.no_grad():
        copy_.load_state_dict(model.state_dict())
    return copy_
