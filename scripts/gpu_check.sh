#!/usr/bin/env bash
# Every Triton kernel against its torch reference on a CUDA GPU, both timed (median of CUDA-event runs); prints a
# table and exits non-zero on a mismatch (1) or without a CUDA device (2). Extra arguments go to the checker:
#   --source hub   check the published kernel repo instead of this checkout's kernel source
#   --runs N       timed runs per op (default 50)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
if [ "${TRITON_INTERPRET:-0}" = "1" ] && [[ " $* " != *" --tiny "* ]]; then
  echo "gpu_check: TRITON_INTERPRET=1 is set; unset it to run the compiled kernels on the GPU." >&2
  exit 2
fi
exec timeout 300 "$PYTHON" -m dflash_hf.kernels.gpu_check "$@"
