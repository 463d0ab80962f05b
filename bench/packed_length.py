"""Does a shorter packed sequence pay? The update's forward and backward of one study-shaped micro-batch (6
prompts x 8 completions of 10-64 tokens, SmolLM2-135M-Instruct with LoRA r 32, the frozen base in bf16 under bf16
autocast, as `train.dtype=bf16` runs it) with the packed layout's sequence cap (`pack_rows(max_tokens=...)`) at
1024 tokens (exgrpo's: one sequence per prompt here) and shorter (the prompt repeated, attention over smaller
blocks). Three alternating repeats; prints one JSON line to stdout and bench/results/packed_length.jsonl.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/packed_length.py [THREADS]     # ~2 min on 2 cores
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from exgrpo.config import LoraConfig  # noqa: E402
from exgrpo.learner import forward  # noqa: E402
from exgrpo.learner.learner import store_frozen_linear_weights  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.tensors import pack  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "packed_length.jsonl"
CAPS, REPEATS = (1024, 256, 160, 110), 3


def study_batch(tokenizer):
    """6 three-term additions, each with 8 completions of 10-64 random tokens (their values do not matter)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for q in range(6):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {17 * q + 3} + {5 * q + 40} + {q + 7}? Answer with only the final "
                                         "number."}], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        for _ in range(8):
            length = int(torch.randint(10, 65, (1,), generator=g))
            rows.append((prompt, torch.randint(100, 40000, (length,), generator=g).tolist(), None))
    return pack(rows, tokenizer.pad_token_id)


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    model, tokenizer = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
    store_frozen_linear_weights(model, torch.bfloat16)
    batch = study_batch(tokenizer)
    pack_rows = forward.pack_rows
    seconds = {cap: [] for cap in CAPS}
    for _ in range(REPEATS):
        for cap in CAPS:
            forward.pack_rows = functools.partial(pack_rows, max_tokens=cap)
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, entropy = forward.token_logprobs(model, batch, 1.0, with_entropy=True, prompt_sharing="packed")
            (logp.sum() + 1e-3 * entropy.sum()).backward()
            seconds[cap].append(round(time.perf_counter() - started, 2))
    forward.pack_rows = pack_rows
    record = {"bench": "packed_length", "threads": threads, "completion_tokens": int(batch.completion_mask.sum()),
              "forward_backward_s": {str(cap): s for cap, s in seconds.items()}}
    print(json.dumps(record))
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
