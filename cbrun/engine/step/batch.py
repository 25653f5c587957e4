"""Scheduled work -> flat model inputs and the per-step attention metadata.

Tokens of all scheduled sequences are laid end to end in one `(1, T)` row,
single-query sequences (decodes) first, then prefill chunks:

    input_ids   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      T = 9
    logits at   [  0  1  2 |          6  |     8 ]      last token of each finishing sequence

With a row-attending backend (the compiled CPU kernel, Triton on CUDA)
every token is a row: each query is attended alone over its own keys (decode
rows, and every token of a prefill chunk); the backend adds its own plan of
the rows (the CPU kernel's tasks that read shared leading pages once, the
Triton kernel's query blocks). The torch reference attends decodes and short
chunks over a cached context row by row, and longer or fresh chunks with
SDPA per sequence.

`PagedBatch` is the one typed object the attention function receives each
step (through the model's **kwargs), tensors only; everything it needs per
layer is built here once per step, not per layer. Its tensors are made on
the host and reach an accelerator in one copy per dtype (device_copy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cbrun.engine.cache.kv_cache import KVCacheManager
from cbrun.engine.cache.kv_store import KVStore
from cbrun.engine.request import Request
from cbrun.engine.step.device_copy import to_device

if TYPE_CHECKING:  # backend.py imports this module (through torch_attention.py)
    from cbrun.engine.backends.base import Backend


@dataclass
class SequenceRows:
    """The query rows of one sequence in a step: `count` tokens from position `start`, rows first_row..."""

    first_row: int
    start: int
    count: int
    table: list[int]  # block ids from logical page `first_page` on
    first_page: int


@dataclass
class PrefillSeq:
    """One multi-token chunk: flat token range and what its queries attend to."""

    start: int
    end: int
    new_kv_only: bool  # context is exactly this chunk's own keys (no cached prefix)
    pages: torch.Tensor | None  # [num_pages] block ids to gather when not new_kv_only
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend); None = plain causal
    causal_from: int | None = None  # position of the first query when plain causal over keys from 0, else None


@dataclass
class GroupLayout:
    """Addresses for one attention type (full or sliding) in this step."""

    write_slots: torch.Tensor  # [T] flat slot (block * page + offset) of each new token
    decode: DecodeLayout | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass
class DecodeLayout:
    """Where the keys of every row-wise query token lie.

    Kernel form (`row_seq` set): one block table per sequence, the sequence of
    each row, and the backend's plan of the rows. Torch form: one padded table
    per row, which the torch path gathers through `pages` and masks with `bias`.
    """

    tables: torch.Tensor  # [S, max_pages] (kernel) or [B, max_pages] (torch) int64 block ids, padded
    kv_len: torch.Tensor  # [B] keys visible at positions < kv_len ...
    kv_lo: torch.Tensor  # [B] ... and >= kv_lo (sliding window), else 0
    first_page: torch.Tensor  # [S] or [B] logical page of each table's first entry
    pages: torch.Tensor | None = None  # [B * max_pages] (torch path)
    bias: torch.Tensor | None = None  # [B, 1, max_pages * page] 0 or -inf, fp32 (torch path)
    row_seq: torch.Tensor | None = None  # [B] table of each row (kernel form)
    plan: tuple = ()  # the backend's plan of the rows: tensors and sizes (kernel form; see Backend.plan_rows)
    # the torch form of a kernel-form layout, made by the first layer that needs it (not an init field,
    # so a device copy of the layout starts without the host's)
    _per_row: DecodeLayout | None = field(default=None, init=False, repr=False, compare=False)

    def per_row(self) -> DecodeLayout:
        """The torch form's addressing: one table per row (the kernel form's, expanded), made once per step."""
        if self.row_seq is None:
            return self
        if self._per_row is None:
            self._per_row = DecodeLayout(
                self.tables.index_select(0, self.row_seq),
                self.kv_len,
                self.kv_lo,
                self.first_page.index_select(0, self.row_seq),
            )
        return self._per_row


HOST_ONLY = {"device_copy": False}  # a PagedBatch field that stays as it is (device_copy.py)


@dataclass
class PagedBatch:
    """Everything one forward pass needs, built once per step."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [N] flat index of each sampled sequence's last token
    sampled: list[Request] = field(metadata=HOST_ONLY)  # the N requests that get a token this step
    num_decode: int  # single-query sequences (decodes), for statistics
    num_rows: int  # leading tokens attended row by row (decodes, short chunks over a cached context)
    groups: dict[str, GroupLayout]
    store: KVStore = field(metadata=HOST_ONLY)  # the page pools (already on the device)
    layer_groups: tuple[str, ...]  # attention type of each layer: "full" or "sliding"
    score_indices: torch.Tensor | None = None  # [S] flat index of each position a scoring request keeps
    scored: list[tuple[Request, int, int]] = field(default_factory=list, metadata=HOST_ONLY)  # (request, first, count)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


ROW_CHUNK = 64  # chunks over a cached context up to this long are attended row by row


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
        backend: Backend,
    ) -> None:
        self.backend = backend  # attends_rows: every token a row; plan_rows: its per-step plan
        self.cache = cache
        self.store = store
        self.layer_groups = layer_groups
        self.page_size = page_size
        self.window = sliding_window
        self.device = device

    def build(self, items: list[tuple[Request, int]]) -> PagedBatch:
        if self.backend.attends_rows:  # every token a row: one arithmetic for every query
            row_items = items
        else:
            row_items = [(r, n) for r, n in items if n == 1 or (r.num_computed_tokens > 0 and n <= ROW_CHUNK)]
        rows = {id(r) for r, _ in row_items}
        items = row_items + [(r, n) for r, n in items if id(r) not in rows]
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        score_rows: list[int] = []
        scored: list[tuple[Request, int, int]] = []
        for request, count in items:
            start = request.num_computed_tokens
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
        groups = {name: self._layout(name, items, len(row_items)) for name in self.cache.allocators}
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
        )
        return to_device(batch, self.device)

    # -- per attention type -------------------------------------------------
    def _layout(self, group: str, items: list[tuple[Request, int]], num_row_items: int) -> GroupLayout:
        page = self.page_size
        window = self.window if group == "sliding" else None
        slots: list[int] = []
        tables: list[tuple[list[int], int]] = []  # (block table, its first logical page) per item
        for request, count in items:
            table = self.cache.allocators[group].table(request.key)
            first = self.cache.first_page(group, request.key)
            tables.append((table, first))
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + count):
                slots.append(table[pos // page - first] * page + pos % page)
        layout = GroupLayout(write_slots=torch.tensor(slots, dtype=torch.long))
        if num_row_items:
            layout.decode = self._decode_layout(items[:num_row_items], tables[:num_row_items], window)
        offset = sum(count for _, count in items[:num_row_items])
        for (request, count), (table, first) in zip(items[num_row_items:], tables[num_row_items:]):
            layout.prefills.append(self._prefill_seq(request, count, offset, table, first, window))
            offset += count
        return layout

    def _decode_layout(
        self, items: Sequence[tuple[Request, int]], tables: Sequence[tuple[list[int], int]], window: int | None
    ) -> DecodeLayout:
        """Block tables and visible key ranges for every row-wise query token."""
        if self.backend.attends_rows:
            return self._kernel_layout(items, tables, window)
        max_pages = max(len(table) for table, _ in tables)
        padded: list[list[int]] = []
        firsts: list[int] = []
        lengths: list[int] = []
        for (request, count), (table, first) in zip(items, tables):
            row_table = table + [table[0]] * (max_pages - len(table))
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + count):
                padded.append(row_table)
                firsts.append(first)
                lengths.append(pos + 1)  # causal: keys up to and including this token
        lows = [max(0, n - window) if window is not None else 0 for n in lengths]
        # pages and bias are derived from these where the step runs, once (torch_attention.decode)
        return DecodeLayout(
            tables=torch.tensor(padded, dtype=torch.long),
            kv_len=torch.tensor(lengths, dtype=torch.long),
            kv_lo=torch.tensor(lows, dtype=torch.long),
            first_page=torch.tensor(firsts, dtype=torch.long),
        )

    def _kernel_layout(
        self, items: Sequence[tuple[Request, int]], tables: Sequence[tuple[list[int], int]], window: int | None
    ) -> DecodeLayout:
        """The kernel form: a table per sequence, each token a row of it, and the rows' tasks."""
        max_pages = max(len(table) for table, _ in tables)
        seqs: list[SequenceRows] = []
        lengths: list[int] = []
        row_seq: list[int] = []
        for index, ((request, count), (table, first)) in enumerate(zip(items, tables)):
            start = request.num_computed_tokens
            seqs.append(SequenceRows(len(lengths), start, count, table, first))
            lengths.extend(range(start + 1, start + count + 1))  # causal: keys up to and including the token
            row_seq.extend([index] * count)
        lows = [max(0, n - window) if window is not None else 0 for n in lengths]
        return DecodeLayout(
            tables=torch.tensor(
                [table + [table[0]] * (max_pages - len(table)) for table, _ in tables], dtype=torch.long
            ),
            kv_len=torch.tensor(lengths, dtype=torch.long),
            kv_lo=torch.tensor(lows, dtype=torch.long),
            first_page=torch.tensor([first for _, first in tables], dtype=torch.long),
            row_seq=torch.tensor(row_seq, dtype=torch.long),
            plan=self.backend.plan_rows(seqs, self.page_size, window is not None),
        )

    def _prefill_seq(
        self, request: Request, count: int, offset: int, table: list[int], first: int, window: int | None
    ) -> PrefillSeq:
        start = request.num_computed_tokens
        query_pos = torch.arange(start, start + count)  # [q]
        if start == 0:
            mask = None
            if window is not None and count > window:
                key_pos = torch.arange(count)
                mask = _causal_window(query_pos, key_pos, window)
            return PrefillSeq(offset, offset + count, True, None, mask, 0 if mask is None else None)
        key_pos = first * self.page_size + torch.arange(len(table) * self.page_size)  # [L]
        mask = _causal_window(query_pos, key_pos, window)
        pages = torch.tensor(table, dtype=torch.long)
        plain = window is None and first == 0
        return PrefillSeq(offset, offset + count, False, pages, mask, start if plain else None)


def _causal_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] bool: key at or before the query, and within the window if any."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed
