#!/usr/bin/env bash
# The SmolLM2-135M preset scaled to minutes on one CUDA GPU: more and longer target answers, bigger batches, and each
# draft's training loop held to a wall-clock budget (`--max-minutes`). Both drafts share the data work directory.
#   scripts/gpu_train.sh OUT_DIR [DSPARK_MINUTES [DFLASH_MINUTES]]     (0 minutes: skip that draft)
# Writes OUT_DIR/smollm2-135m-{dspark,dflash} (drafts with their cards and summaries) and OUT_DIR/work (data,
# features, checkpoints, metrics). SIZE=tiny shrinks everything, for a dry run of this script on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_train.sh OUT_DIR [DSPARK_MINUTES [DFLASH_MINUTES]]}
DSPARK_MINUTES=${2:-3}
DFLASH_MINUTES=${3:-2}
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

if [ "${SIZE:-full}" = tiny ]; then
  data=(--num-code-prompts 8 --num-topic-prompts 4 --max-new-tokens 16 --batch-size 4)
  steps=(--max-steps 30 --sequences-per-step 2 --eval-every 10 --checkpoint-every 10)
else
  # Every stdlib code task (~2100), 1500 self-written questions, answers of up to 256 tokens.
  data=(--num-code-prompts 5000 --num-topic-prompts 1500 --max-new-tokens 256 --batch-size 256)
  steps=(--max-steps 100000 --sequences-per-step 16 --eval-every 500 --checkpoint-every 1000
         --mixed-precision bf16)
fi
train() {  # kind, minutes, extra flags
  local kind=$1 minutes=$2
  shift 2
  "$PYTHON" -m dflash_hf.cli train --preset smollm2-135m --kind "$kind" --dtype bfloat16 \
    --out "$OUT/smollm2-135m-$kind" --work-dir "$OUT/work" --max-minutes "$minutes" "${data[@]}" "${steps[@]}" "$@"
}
[ "$DSPARK_MINUTES" = 0 ] || train dspark "$DSPARK_MINUTES" --anchors-per-sequence 64
[ "$DFLASH_MINUTES" = 0 ] || train dflash "$DFLASH_MINUTES" --anchors-per-sequence 32
