#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on the GPU machine this project can get: one GPU whose image has torch,
# transformers, accelerate, peft and safetensors, but no vLLM and no network. Nothing is installed there: exgrpo
# runs from src/. Must finish in <= 8 min including start-up; prints one JSON line at the end.
#
#   make gpu-check-wheels                 # here: math-verify and its two pure-Python dependencies into .gpu-wheels
#   bash bench/gpu_check.sh               # on the GPU machine, from the repository root (.gpu-wheels carried along)
#   .venv/bin/python bench/gpu_check.py --smoke   # here: the same code on CPU at toy sizes
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(mktemp -d)
if ! python3 -c "import math_verify" 2>/dev/null; then
  python3 -m pip install --quiet --no-index --no-deps --target "$SITE" .gpu-wheels/*.whl
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="src:$SITE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
timeout 470 python3 bench/gpu_check.py "$@"
