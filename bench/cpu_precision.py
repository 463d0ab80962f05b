"""Does `train.dtype=bf16` pay on this CPU? The update's forward and backward of one micro-batch (6 prompts x 8
completions, SmolLM2-135M-Instruct with LoRA r 32, the packed layout; `compiled_layers.micro_batch`) in fp32, as
`train.dtype=fp32` runs it, against bf16 autocast over a bf16 frozen base, as `train.dtype=bf16` runs it; study- and
demo-shaped micro-batches, the two precisions alternating. bf16 pays where the CPU has AMX tiles, whose bf16 matrix
products run several times faster than fp32 ones; with avx512_bf16 alone they do not. Prints one JSON line (the
CPU's AMX and avx512_bf16 support, seconds per repeat) to stdout and bench/results/cpu_precision.jsonl.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cpu_precision.py [THREADS]     # ~4 min on 2 cores
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from compiled_layers import micro_batch, update  # noqa: E402

from exgrpo.config import LoraConfig  # noqa: E402
from exgrpo.learner.learner import store_frozen_linear_weights  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_precision.jsonl"
REPEATS = 3


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    fp32, tokenizer = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
    bf16, _ = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
    store_frozen_linear_weights(bf16, torch.bfloat16)
    record: dict = {"bench": "cpu_precision", "threads": threads, "amx": torch.cpu._is_amx_tile_supported(),
                    "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}
    for name, batch in {"study": micro_batch(tokenizer, 10, 64, 3), "demo": micro_batch(tokenizer, 3, 24, 2)}.items():
        update(fp32, batch, bf16=False), update(bf16, batch)  # warm-up
        for _ in range(REPEATS):
            record.setdefault(f"{name}/fp32_s", []).append(update(fp32, batch, bf16=False)[0])
            record.setdefault(f"{name}/bf16_s", []).append(update(bf16, batch)[0])
    print(json.dumps(record))
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
