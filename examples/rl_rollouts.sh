#!/usr/bin/env bash
# RL-style rollouts: 8 seeded samples per prompt with per-token logprobs, then a toy reward.
#
#   examples/rl_rollouts.sh                      # default model, writes ./rollouts.parquet
#   MODEL=/path/to/model OUT=/tmp/r.parquet examples/rl_rollouts.sh --max-tokens 32
#
# Extra arguments are passed to `cbrun generate` (later flags win). The same seed gives the
# same samples on every run, whatever the batch size, so a rollout can be regenerated exactly.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-smollm2-135m}"
OUT="${OUT:-rollouts.parquet}"
PYTHON="${PYTHON:-python}"
if command -v cbrun >/dev/null 2>&1; then CBRUN=(cbrun); else CBRUN=("$PYTHON" -m cbrun); fi

code=0
"${CBRUN[@]}" generate "$here/rl_prompts.jsonl" "$OUT" --model "$MODEL" \
    --n 8 --seed 1234 --temperature 1.0 --top-p 0.95 --max-tokens 64 \
    --logprobs --prompt-token-ids --keep-columns answer --overwrite "$@" || code=$?
if [ "$code" -gt 1 ]; then exit "$code"; fi  # 1: some rows failed, still worth a look

# reward = 1 when the completion contains the answer; report per prompt
"$PYTHON" - "$OUT" <<'PY'
import sys
from collections import defaultdict

import pyarrow.parquet as pq

rows = pq.read_table(sys.argv[1]).to_pylist()
by_id = defaultdict(list)
for row in rows:
    by_id[row["id"]].append(row)
for row_id, samples in sorted(by_id.items()):
    rewards = [float(s["answer"] in s["completion"]) for s in samples if s["error"] is None]
    logps = [sum(s["logprobs"]) for s in samples if s["error"] is None]
    distinct = len({tuple(s["completion_token_ids"]) for s in samples})
    mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    mean_logp = sum(logps) / len(logps) if logps else 0.0
    print(f"{row_id}: {len(samples)} samples ({distinct} distinct), mean reward {mean_reward:.2f}, "
          f"mean sequence logprob {mean_logp:.1f}")
PY
