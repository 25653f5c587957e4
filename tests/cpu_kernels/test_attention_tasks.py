"""The attention task planner: which rows share which leading keys (the arithmetic never changes with it)."""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows


def _tasks(seqs, page=16, segment=128, max_rows=16):
    rows, starts, shared = plan_tasks(seqs, page, segment, windowed=False, max_rows=max_rows)
    return [(rows[a:b].tolist(), int(s)) for a, b, s in zip(starts[:-1], starts[1:], shared)]


def test_the_rows_of_a_causal_chunk_share_the_whole_segments_each_sees():
    """A 300-token prefill from position 0: rows 0-126 see less than a segment (alone), 127-254 share one
    segment, 255-299 share two."""
    tasks = _tasks([SequenceRows(0, 0, 300, list(range(19)), 0)], max_rows=300)
    shared_of = {row: shared for rows, shared in tasks for row in rows}
    assert sorted(shared_of) == list(range(300))
    assert all(shared_of[r] == 0 for r in range(127))
    assert all(shared_of[r] == 128 for r in range(127, 255))
    assert all(shared_of[r] == 256 for r in range(255, 300))
    assert all(len(rows) == 1 for rows, shared in tasks if shared == 0)


def test_decodes_on_a_common_prompt_share_its_whole_segments_and_no_more():
    prompt = list(range(20))  # 320 keys on the same blocks: two whole segments
    seqs = [SequenceRows(i, 330 + i, 1, [*prompt, 100 + i], 0) for i in range(5)]
    [(rows, shared)] = _tasks(seqs)
    assert sorted(rows) == [0, 1, 2, 3, 4] and shared == 256


kernels = load_cpu_kernels()


@pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_chunk_gives_each_row_its_bits_alone(dtype):
    """Rows planned into shared-segment tasks get the bits they get as single rows."""
    torch.manual_seed(0)
    heads, kv_heads, dim, page, count = 6, 2, 64, 16, 300
    k_pool = torch.randn(kv_heads, 24, page, dim).to(dtype)
    v_pool = torch.randn(kv_heads, 24, page, dim).to(dtype)
    table = torch.randperm(24)[:19]
    q = torch.randn(count, heads, dim).to(dtype)
    tables, rows = table[None, :], torch.zeros(count, dtype=torch.long)
    kv_len, zeros = torch.arange(1, count + 1), torch.zeros(count, dtype=torch.long)
    planned = plan_tasks([SequenceRows(0, 0, count, table.tolist(), 0)], page, kernels.segment, False)
    assert int(planned[2].max()) > 0
    alone = (torch.arange(count), torch.arange(count + 1), torch.zeros(count, dtype=torch.long))
    paged = PagedRows(tables, rows, zeros[:1], kv_len, zeros)
    together = kernels.attend(q, k_pool, v_pool, paged, planned, 0.125)
    single = kernels.attend(q, k_pool, v_pool, paged, alone, 0.125)
    assert torch.equal(together, single)
