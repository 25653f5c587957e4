"""How a step's query rows are grouped into tasks for the compiled attention kernel.

Every query token of a step is a row with its own key range (csrc/attention.c).
Rows that share leading blocks run as one task: the shared keys are read once
per task, each page of them passing through all of the task's rows while it
sits in L1. Two kinds
of rows share:

- the tokens of one prefill chunk (the chunk's cached context, and the earlier
  tokens of the chunk itself: each row shares the whole segments it sees), and
- decode rows of different sequences whose first blocks are the same (a common
  system prompt, the n samples of one prompt): "cascade" attention.

Grouping changes only which rows are computed together, never the arithmetic:
the kernel takes the keys of every row in segments at fixed absolute positions
whatever its task, so results are the same bits with or without a group (the
engine's batch invariance). Shared keys are therefore counted in whole
segments (`segment` keys, from position 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbrun.engine.backends.metadata import SequenceRows

TASK_ROWS = 16  # rows per task at most: big groups are split so both threads get work


def plan_tasks(
    seqs: Sequence[SequenceRows], page_size: int, segment: int, windowed: bool, max_rows: int = TASK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tasks for the kernel: (rows [R], start [T + 1], shared keys [T]), int64, largest tasks first.

    Sequences whose first block is the same (and that see keys from position 0)
    are grouped. A row can share the leading pages common to all the group's
    tables that it sees whole, in whole segments; the group's rows are sorted by
    that count and cut into tasks of rows that share the same number of
    segments. So the rows of a prefill chunk past the first segment share it,
    those past the second share two, and so on (causal rows see different
    prefixes), and decodes on a common prompt share all of its whole segments.
    Rows that share nothing are tasks of their own.
    """
    groups: dict[int, list[SequenceRows]] = {}
    singles: list[tuple[int, int]] = []  # (row, keys it sees)
    for seq in seqs:
        if windowed or seq.first_page != 0:
            singles.extend((seq.first_row + i, seq.start + i + 1) for i in range(seq.count))
        else:
            groups.setdefault(seq.table[0], []).append(seq)
    tasks: list[tuple[int, list[int], int]] = []  # (cost, rows, shared keys)
    for members in groups.values():
        common = _common_keys(members, page_size)
        by_shared: dict[int, list[tuple[int, int]]] = {}
        for seq in members:
            for i in range(seq.count):
                visible = seq.start + i + 1
                shared = min(common, visible) // segment * segment
                if shared == 0:
                    singles.append((seq.first_row + i, visible))
                else:
                    by_shared.setdefault(shared, []).append((seq.first_row + i, visible))
        for shared, sharing in by_shared.items():
            for at in range(0, len(sharing), max_rows):
                part = sharing[at : at + max_rows]
                tasks.append((sum(visible for _, visible in part), [row for row, _ in part], shared))
    tasks.extend((visible, [row], 0) for row, visible in singles)
    tasks.sort(key=lambda task: -task[0])  # long tasks first: dynamic scheduling then balances the tail
    rows = [row for _, task_rows, _ in tasks for row in task_rows]
    starts = [0]
    for _, task_rows, _ in tasks:
        starts.append(starts[-1] + len(task_rows))
    return (
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor([shared for _, _, shared in tasks], dtype=torch.long),
    )


def _common_keys(members: list[SequenceRows], page_size: int) -> int:
    """Keys from 0 on the same blocks in every member's table."""
    lead = members[0].table
    common = min(len(seq.table) for seq in members)
    for seq in members[1:]:
        common = next((i for i in range(common) if seq.table[i] != lead[i]), common)
    return common * page_size
