"""How many sequences should the vLLM engine run at once? A held-out evaluation of round six's setting (160
three-term additions x 4 samples, up to 64 tokens at T = 1, SmolLM2-135M-Instruct in bf16, the engine in this
process) generated with `max_num_seqs` = the training batch (48) and larger. Same prompts and per-sequence seeds at
every size, so the completions are the same; prints one JSON line per size (engine start, generation seconds,
completion tokens per second) to stdout and bench/results/engine_batch.jsonl.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python bench/engine_batch.py [SIZES...]    # default 48 160 320 640; ~4 min
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import reasoning_gym  # noqa: E402

from exgrpo.data import PromptEncoder, Question  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.rollout import SamplingSettings  # noqa: E402
from exgrpo.rollout.vllm import VLLMEngine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engine_batch.jsonl"
QUESTIONS, SAMPLES, NEW_TOKENS = 160, 4, 64


def held_out_prompts(tokenizer) -> list[list[int]]:
    rows = reasoning_gym.create_dataset("basic_arithmetic", size=QUESTIONS, seed=66, min_terms=3, max_terms=3,
                                        min_digits=1, max_digits=2, operators=("+",), allow_negation=False,
                                        allow_parentheses=False)
    encode = PromptEncoder(tokenizer)
    return [encode(Question(str(i), ({"role": "user", "content": row["question"] +
                                      " Answer with only the final number."},), row["answer"], {}))
            for i, row in enumerate(rows) for _ in range(SAMPLES)]


def main(sizes: list[int]) -> None:
    model, tokenizer = load_policy("smollm2-135m-instruct")
    prompts = held_out_prompts(tokenizer)
    seeds = list(range(len(prompts)))
    reference = None
    for size in sizes:
        started = time.perf_counter()
        engine = VLLMEngine(model, tokenizer, dtype="bfloat16", max_model_len=256, max_num_seqs=size)
        try:
            ready = time.perf_counter()
            out = engine.generate(prompts, SamplingSettings(NEW_TOKENS, temperature=1.0), seeds)
            seconds = time.perf_counter() - ready
        finally:
            engine.close()
        tokens = sum(map(len, out.completion_ids))
        reference = reference or out.completion_ids
        record = {"bench": "engine_batch", "max_num_seqs": size, "sequences": len(prompts),
                  "engine_start_s": round(ready - started, 1), "generate_s": round(seconds, 2),
                  "completion_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                  "same_completions_as_first": out.completion_ids == reference}
        print(json.dumps(record), flush=True)
        with RESULTS.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [48, 160, 320, 640])
