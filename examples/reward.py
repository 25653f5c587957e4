"""The reward stage of a shell RL pipeline: cbrun's JSONL rollouts in, rows with reward and advantage out.

    cbrun generate examples/rl_prompts.jsonl - --n 8 --seed 1 --temperature 1 --logprobs \
        --prompt-token-ids --keep-columns answer -q | python examples/reward.py > scored.jsonl

reward: 1.0 when the row's `answer` column occurs in the completion, else 0.0. advantage: the reward
minus the mean of its prompt's group, over the group's standard deviation (GRPO). Rows that failed
(an `error`) are passed through with reward and advantage null. Groups are written once all rows are read.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def reward(row: dict) -> float:
    return float(str(row.get("answer", "")) in row["completion"]) if row.get("answer") is not None else 0.0


def main() -> None:
    groups: dict[str, list[dict]] = defaultdict(list)
    for line in sys.stdin:
        if line.strip():
            row = json.loads(line)
            groups[row["id"]].append(row)
    for rows in groups.values():
        ok = [r for r in rows if r.get("error") is None]
        scores = [reward(r) for r in ok]
        mean = statistics.fmean(scores) if scores else 0.0
        spread = statistics.pstdev(scores) if scores else 0.0
        for row, score in zip(ok, scores):
            row["reward"], row["advantage"] = score, (score - mean) / (spread + 1e-6)
        for row in rows:
            row.setdefault("reward", None)
            row.setdefault("advantage", None)
            sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
