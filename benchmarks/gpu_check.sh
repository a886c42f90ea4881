#!/usr/bin/env bash
# The engine on one GPU, in one command that prints one table (benchmarks/gpu_check.py says what it measures):
#   benchmarks/gpu_check.sh                      # on a machine with a CUDA GPU, torch, transformers and triton
#   WHEELS=dir benchmarks/gpu_check.sh           # first install the wheels in dir (a machine without an index)
# The table is also written to $OUT/gpu_check.md (default: the current folder). Finishes in under 8 minutes on
# one H200 (it stops itself at 7m50s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rollserve-site \
        "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/rollserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L || true
exec timeout 470 python3 benchmarks/gpu_check.py --out "${OUT:-.}/gpu_check.md" "$@"
