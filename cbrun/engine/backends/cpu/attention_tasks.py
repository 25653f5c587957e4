"""How a step's query rows are grouped into tasks for the compiled attention kernel.

Every query token of a step is a row with its own key range (csrc/attention.c).
Rows that share leading blocks run as one task: the shared keys are read once
per task, each page of them passing through all of the task's rows while it
sits in L1. Two kinds
of rows share:

- the tokens of one prefill chunk (all of the chunk's cached context, and the
  earlier tokens of the chunk itself), and
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

from cbrun.engine.step.batch import SequenceRows

TASK_ROWS = 16  # rows per task at most: big groups are split so both threads get work


def plan_tasks(
    seqs: Sequence[SequenceRows], page_size: int, segment: int, windowed: bool, max_rows: int = TASK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tasks for the kernel: (rows [R], start [T + 1], shared keys [T]), int64, largest tasks first.

    Sequences whose first block is the same (and that see keys from position 0)
    are grouped; a group's shared keys are the leading pages common to all its
    tables and visible to all its rows, rounded down to whole segments. Rows in
    no group with shared keys are tasks of their own.
    """
    groups: dict[int, list[SequenceRows]] = {}
    singles: list[SequenceRows] = []
    for seq in seqs:
        if windowed or seq.first_page != 0:
            singles.append(seq)
        else:
            groups.setdefault(seq.table[0], []).append(seq)
    tasks: list[tuple[int, list[int], int]] = []  # (cost, rows, shared keys)
    for members in groups.values():
        shared = _shared_keys(members, page_size, segment)
        if shared == 0:
            singles.extend(members)
            continue
        rows = [row for seq in members for row in range(seq.first_row, seq.first_row + seq.count)]
        ends = [seq.start + i + 1 for seq in members for i in range(seq.count)]
        for at in range(0, len(rows), max_rows):
            tasks.append((sum(ends[at : at + max_rows]), rows[at : at + max_rows], shared))
    for seq in singles:
        for i in range(seq.count):
            tasks.append((seq.start + i + 1, [seq.first_row + i], 0))
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


def _shared_keys(members: list[SequenceRows], page_size: int, segment: int) -> int:
    """Keys from 0 on the same blocks for every member and visible to each of its rows, in whole segments."""
    visible = min(seq.start + 1 for seq in members)  # the earliest row of each sequence sees start + 1 keys
    lead = members[0].table
    common = min(len(seq.table) for seq in members)
    for seq in members[1:]:
        common = next((i for i in range(common) if seq.table[i] != lead[i]), common)
    keys = min(common * page_size, visible)
    return keys // segment * segment
