"""Does `torch.compile` of the decoder layers pay on this CPU? The update's forward and backward of one micro-batch
(6 prompts x 8 completions, SmolLM2-135M-Instruct with LoRA r 32, bf16 autocast over a bf16 frozen base as
`train.dtype=bf16` runs it; the packed layout), eager against every decoder layer compiled by inductor with dynamic
shapes (`nn.Module.compile(dynamic=True)`, one graph serves all 30 layers). Study-shaped micro-batches (completions
of 10-64 tokens), then demo-shaped ones (3-24 tokens: a new shape, which must not compile again). Prints one JSON
line (eager and compiled seconds, the first compiled call's, the log-prob difference) to stdout and
bench/results/compiled_layers.jsonl.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/compiled_layers.py [THREADS]     # ~4 min on 2 cores
"""

from __future__ import annotations

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

RESULTS = Path(__file__).resolve().parent / "results" / "compiled_layers.jsonl"
REPEATS = 3


def micro_batch(tokenizer, shortest: int, longest: int, terms: int):
    """6 additions of `terms` terms, each with 8 completions of random tokens of random lengths."""
    g, rows = torch.Generator().manual_seed(0), []
    for q in range(6):
        text = " + ".join(str(17 * q + 3 + 5 * i) for i in range(terms))
        prompt = tokenizer(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {text}? Answer with only the final number."}],
            add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for _ in range(8):
            n = int(torch.randint(shortest, longest + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(100, 40000, (n,), generator=g).tolist(), None))
    return pack(rows, tokenizer.pad_token_id)


def update(model, batch, bf16: bool = True) -> tuple[float, torch.Tensor]:
    """Seconds of one forward and backward (under bf16 autocast, or in fp32); the completion tokens' log-probs."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp, entropy = forward.token_logprobs(model, batch, 1.0, with_entropy=True, prompt_sharing=forward.PACKED)
    (logp.sum() + 1e-3 * entropy.sum()).backward()
    return round(time.perf_counter() - started, 2), logp.detach()


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    model, tokenizer = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
    store_frozen_linear_weights(model, torch.bfloat16)
    batches = {"study": micro_batch(tokenizer, 10, 64, 3), "demo": micro_batch(tokenizer, 3, 24, 2)}
    record: dict = {"bench": "compiled_layers", "threads": threads}
    eager = {}
    for name, batch in batches.items():
        runs = [update(model, batch) for _ in range(REPEATS)]
        record[f"{name}/eager_s"], eager[name] = [s for s, _ in runs], runs[-1][1]
    layers = [m for m in model.modules() if type(m).__name__ in model.get_base_model()._no_split_modules]
    for layer in layers:
        layer.compile(dynamic=True)
    for name, batch in batches.items():
        runs = [update(model, batch) for _ in range(REPEATS + 1)]
        record[f"{name}/compiled_first_s"] = runs[0][0]
        record[f"{name}/compiled_s"] = [s for s, _ in runs[1:]]
        record[f"{name}/max_logprob_difference"] = round(float((runs[-1][1] - eager[name]).abs().max()), 5)
    record["compiled_layers"] = len(layers)
    print(json.dumps(record))
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
