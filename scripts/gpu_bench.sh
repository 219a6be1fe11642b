#!/usr/bin/env bash
# Every speculative loop end to end on a Qwen3-8B-shaped target (scripts/gpu_bench.py): per verify step the target's
# forward, the draft and the loop's own overhead, and the speed-up over plain generate at forced acceptance lengths.
# Prints one table; writes gpu_bench_<size>.json and .txt to OUT_DIR. Exit status 1 when a loop is not lossless.
#   scripts/gpu_bench.sh [OUT_DIR]             on a CUDA GPU; sized for 3-5 minutes on an H200 (stopped at 8)
#   SIZE=tiny scripts/gpu_bench.sh [OUT_DIR]   a toy pair in float32 on the CPU, in seconds (the suite runs this)
#   scripts/gpu_bench.sh --wheels              here, before a lent-GPU run: the wheels its image lacks, into .whl/
# OUT_DIR defaults to $OUT (the lent machine's result folder), else out/gpu_bench. On the lent machine, carry .whl:
# its wheels (transformers, kernels and z-lab's dflash at this venv's versions) are installed into /tmp/dflash-site first.
# CHECK_KERNELS=1 runs scripts/gpu_check.sh's kernel check first (its table into OUT_DIR/gpu_check.txt): one device
# call for both, e.g. the device tool's run(command="CHECK_KERNELS=1 scripts/gpu_bench.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --wheels ]; then
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec scripts/device_wheels.sh .whl transformers kernels dflash
fi

PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
if compgen -G ".whl/*.whl" > /dev/null && [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dflash-site \
    .whl/*.whl
  export PYTHONPATH="/tmp/dflash-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Nothing is downloaded: offline, the kernel loader skips the Hub at once and takes the checkout's kernels.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT_DIR="${1:-${OUT:-out/gpu_bench}}"
if [ "${CHECK_KERNELS:-0}" = 1 ]; then
  mkdir -p "$OUT_DIR"
  timeout 100 "$PYTHON" -m dflash_hf.kernels.gpu_check --runs 20 | tee "$OUT_DIR/gpu_check.txt" \
    || echo "gpu_bench: the kernel check failed (see above); running the bench anyway" >&2
fi
exec timeout 480 "$PYTHON" scripts/gpu_bench.py --size "${SIZE:-full}" --out "$OUT_DIR"
