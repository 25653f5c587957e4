"""The attention-metadata contract between the batch builder and the backends.

Each step the batch builder (step/batch.py) lays every scheduled sequence's
new tokens end to end and asks the backend's metadata builder how to attend
them. The builder is the backend's own (vLLM's metadata builders, kept
beside the backends as in `vllm/v1/attention/backends/utils.py`), so the
contract lives here, with the backends, and the step only imports it:

    batch builder  --SequenceRows per sequence-->  metadata builder
                   <--(RowLayout | None, [PrefillSeq])--

A backend attends the leading sequences query row by query row (a "row" here
is one query token of the step); the other sequences follow as chunks
attended whole. `RowLayout` is a backend's own dataclass of tensors for its
rows; `PrefillSeq` describes one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SequenceRows:
    """The query rows of one sequence in a step: `count` tokens from position `start`, rows first_row...

    What a metadata builder is given per sequence and attention group (host values, not tensors).
    """

    first_row: int
    start: int
    count: int
    table: list[int]  # block ids from logical page `first_page` on
    first_page: int


class RowLayout:
    """A backend's per-step metadata for the tokens it attends row by row: a dataclass of tensors and sizes
    made by its metadata builder and read by its `attend_rows` (each backend has its own subclass)."""


@dataclass
class PagedRows:
    """Where every query row's keys lie in the page pools: what a compiled paged attention reads, the CPU kernel
    and the Triton kernel alike (one description, not nine arguments apiece)."""

    tables: torch.Tensor  # [S, max_pages] int64 block ids of each sequence, padded with its first
    row_seq: torch.Tensor  # [R] the sequence (table) of each row
    first_page: torch.Tensor  # [S] logical page of each table's first entry
    kv_len: torch.Tensor  # [R] keys visible at positions < kv_len ...
    kv_lo: torch.Tensor  # [R] ... and >= kv_lo (sliding window), else 0


@dataclass
class PrefillSeq:
    """One chunk attended whole: its flat token range and what its queries attend to."""

    start: int
    end: int
    new_kv_only: bool  # context is exactly this chunk's own keys (no cached prefix)
    pages: torch.Tensor | None  # [num_pages] block ids to gather when not new_kv_only
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend); None = plain causal


class AttentionMetadataBuilder(Protocol):
    """How a backend lays out a step's attention: which sequences it attends row by row, and their tensors."""

    def attends_as_row(self, start: int, count: int) -> bool:
        """Whether `count` new tokens of a sequence from position `start` are attended row by row (they lead
        the step's tokens; the other sequences are chunks attended whole)."""
        ...

    def build(
        self, seqs: Sequence[SequenceRows], page_size: int, window: int | None
    ) -> tuple[RowLayout | None, list[PrefillSeq]]:
        """One attention group's metadata: the layout of the leading row sequences (None without any), and one
        PrefillSeq per chunk after them. `window` is the group's sliding window (None: full attention)."""
        ...
