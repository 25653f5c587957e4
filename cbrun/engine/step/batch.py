"""Scheduled work -> flat model inputs and the per-step attention metadata.

Tokens of all scheduled sequences are laid end to end in one `(1, T)` row,
the sequences the backend attends row by row first, then the chunks it
attends whole:

    input_ids   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      T = 9
    logits at   [  0  1  2 |          6  |     8 ]      last token of each finishing sequence

The attention metadata of each step is the backend's own: its metadata
builder (one per backend, chosen when it installs; the contract is
backends/metadata.py) says which sequences it attends row by row and turns
every attention group's sequences into the tensors its attention reads. The
builder holds that metadata builder, not the backend: a step's layout needs
nothing else of it. A compiled kernel (CPU, Triton) takes every
token as a row of its sequence's block table, with its own plan of the rows
(backends/base.py); the torch reference attends decodes and short chunks
over a cached context as padded rows with a key bias, and other chunks
whole with SDPA (backends/torch_attention.py).

`PagedBatch` is the one typed object the attention function receives each
step (through the model's **kwargs), tensors and sizes only; everything it
needs per layer is built here once per step, not per layer. Its tensors are
made on the host and reach an accelerator in one copy per dtype
(device_copy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbrun.engine.backends.metadata import AttentionMetadataBuilder, PrefillSeq, RowLayout, SequenceRows
from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.cache.kv_store import KVStore
from cbrun.engine.request import Request
from cbrun.engine.step.device_copy import to_device
from cbrun.lora.adapters import LoRAAdapters
from cbrun.lora.step import StepLoRA


@dataclass
class GroupLayout:
    """Addresses for one attention type (full or sliding) in this step."""

    write_slots: torch.Tensor  # [T] flat slot (block * page + offset) of each new token
    rows: RowLayout | None = None  # the leading `num_rows` tokens, as the backend's builder laid them out
    prefills: list[PrefillSeq] = field(default_factory=list)  # the chunks after them


HOST_ONLY = {"device_copy": False}  # a PagedBatch field that stays as it is (device_copy.py)


@dataclass
class PagedBatch:
    """Everything one forward pass needs, built once per step."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [N] flat index of each sampled sequence's last token
    sampled: list[Request] = field(metadata=HOST_ONLY)  # the N requests that get a token this step
    num_decode: int  # single-query sequences (decodes), for statistics
    num_rows: int  # leading tokens attended row by row (every token with a kernel backend)
    groups: dict[str, GroupLayout]
    store: KVStore = field(metadata=HOST_ONLY)  # the page pools (already on the device)
    layer_groups: tuple[str, ...]  # attention type of each layer: "full" or "sliding"
    score_indices: torch.Tensor | None = None  # [S] flat index of each position a scoring request keeps
    scored: list[tuple[Request, int, int]] = field(default_factory=list, metadata=HOST_ONLY)  # (request, first, count)
    lora: StepLoRA | None = field(default=None, metadata=HOST_ONLY)  # the tokens that run LoRA adapters, if any

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


class BatchBuilder:
    """Turns (request, new tokens) pairs into a PagedBatch for the cache's allocators."""

    def __init__(
        self,
        cache: KVCacheManager,
        store: KVStore,
        layer_groups: tuple[str, ...],
        page_size: int,
        sliding_window: int | None,
        device: torch.device,
        metadata: AttentionMetadataBuilder,
    ) -> None:
        self.metadata = metadata  # the backend's builder; the core sets it again whenever the backend installs
        self.cache = cache
        self.store = store
        self.layer_groups = layer_groups
        self.page_size = page_size
        self.window = sliding_window
        self.device = device
        self.adapters: LoRAAdapters | None = None  # the engine's LoRA adapters, when it has them

    def build(self, items: list[tuple[Request, int]]) -> PagedBatch:
        metadata = self.metadata
        row_items = [(r, n) for r, n in items if metadata.attends_as_row(r.num_computed_tokens, n)]
        rows = {id(r) for r, _ in row_items}
        items = row_items + [(r, n) for r, n in items if id(r) not in rows]
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        score_rows: list[int] = []
        scored: list[tuple[Request, int, int]] = []
        lora_rows: dict[str, list[int]] = {}
        for request, count in items:
            start = request.num_computed_tokens
            if request.lora is not None:
                lora_rows.setdefault(request.lora, []).extend(range(len(ids), len(ids) + count))
            ids.extend(request.all_token_ids[start : start + count])
            positions.extend(range(start, start + count))
            if request.score is not None:  # scoring: keep every wanted position, sample nothing
                first = max(start, request.next_score_position)
                if first < start + count:
                    score_rows.extend(range(len(ids) - (start + count - first), len(ids)))
                    scored.append((request, first, start + count - first))
            elif start + count == request.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(request)
        groups = {name: self._layout(name, items, metadata) for name in self.cache.allocators}
        batch = PagedBatch(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([positions], dtype=torch.long),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long),
            sampled=sampled,
            num_decode=sum(1 for _, count in items if count == 1),
            num_rows=sum(count for _, count in row_items),
            groups=groups,
            store=self.store,
            layer_groups=self.layer_groups,
            score_indices=torch.tensor(score_rows, dtype=torch.long),
            scored=scored,
            lora=self.adapters.step(lora_rows, len(ids)) if self.adapters is not None and lora_rows else None,
        )
        return to_device(batch, self.device)

    def _layout(self, group: str, items: list[tuple[Request, int]], metadata: AttentionMetadataBuilder) -> GroupLayout:
        """Where each new token's K/V goes in this attention group, and the backend's metadata to attend them."""
        page = self.page_size
        slots: list[int] = []
        seqs: list[SequenceRows] = []
        for request, count in items:
            table = self.cache.allocators[group].table(request.key)
            first = self.cache.first_page(group, request.key)
            start = request.num_computed_tokens
            seqs.append(SequenceRows(len(slots), start, count, table, first))
            for pos in range(start, start + count):
                slots.append(table[pos // page - first] * page + pos % page)
        rows, prefills = metadata.build(seqs, page, self.window if group == "sliding" else None)
        return GroupLayout(torch.tensor(slots, dtype=torch.long), rows, prefills)
