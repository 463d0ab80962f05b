"""Would pushing the LoRA adapter instead of the merged weights pay on this CPU? vLLM in process samples the demo's
work (6 prompts x 8, <= 24 tokens, fp32) without LoRA and then with an adapter (SmolLM2-135M, r 32, all linear
layers) that changes at every step, as an adapter push would: saved with peft, then sampled under a new
`LoRARequest`. Prints one JSON line: the engine's start, each generation's seconds, the adapter's save time and
size, and the engine's log-probs against the peft model's own forward on the sampled tokens.

    .venv-vllm/bin/python bench/lora_push.py          # HF_HUB_OFFLINE=1; ~3 min on 2 cores

Today's push (the merged weights, `reload_weights`) takes about 1 s a step (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as exgrpo's sync mode runs it
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from exgrpo.config import LoraConfig  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.models.loading import apply_lora  # noqa: E402

QUESTIONS, K, NEW_TOKENS = 6, 8, 24


def prompt_ids(tokenizer, i: int) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {i} + {i + 7}? Answer with only the final number."}],
        add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def perturb_adapter(model, scale: float) -> None:
    """A training step's worth of change to the adapter (lora_B starts at 0, which would make it invisible)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * scale)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="exgrpo-lora-push-"))
    try:
        base, tok = load_policy("smollm2-135m-instruct")
        base.save_pretrained(work / "base")
        tok.save_pretrained(work / "base")
        model = apply_lora(base, LoraConfig(r=32, alpha=64, target_modules="all-linear"))
        perturb_adapter(model, 0.02)
        start = time.perf_counter()
        llm = LLM(model=str(work / "base"), dtype="float32", max_model_len=256, max_num_seqs=QUESTIONS * K, seed=0,
                  enforce_eager=True, block_size=32, kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=False,
                  max_num_batched_tokens=4096, enable_lora=True, max_lora_rank=32, max_loras=1,
                  logprobs_mode="processed_logprobs", max_logprobs=1, generation_config="vllm",
                  disable_log_stats=True)
        record: dict = {"bench": "lora_push", "start_s": time.perf_counter() - start}
        prompts = [{"prompt_token_ids": prompt_ids(tok, i)} for i in range(QUESTIONS) for _ in range(K)]
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, seed=1)

        def generate(lora=None):
            t = time.perf_counter()
            out = llm.generate(prompts, sampling, lora_request=lora, use_tqdm=False)
            return round(time.perf_counter() - t, 2), out

        record["without_lora_s"] = [generate()[0] for _ in range(2)]  # the first one warms the engine up
        steps = []
        for version in range(1, 5):
            perturb_adapter(model, 0.001)
            t = time.perf_counter()
            model.save_pretrained(work / f"adapter-{version}")
            saved = time.perf_counter() - t
            request = LoRARequest("policy", version, str(work / f"adapter-{version}"))
            first, out = generate(request)  # loads the new adapter
            again, _ = generate(request)
            size = sum(f.stat().st_size for f in (work / f"adapter-{version}").iterdir())
            steps.append({"save_s": round(saved, 3), "first_generate_s": first, "second_generate_s": again,
                          "adapter_mb": round(size / 1e6, 1)})
        record["with_a_new_adapter_each_step"] = steps
        sample = out[0]
        ids = list(sample.prompt_token_ids) + list(sample.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(sample.prompt_token_ids) - 1:-1].float()
        ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.outputs[0].token_ids)[:, None])[:, 0]
        engine = torch.tensor([next(iter(d.values())).logprob for d in sample.outputs[0].logprobs])
        record["logp_diff_max"] = float((ours - engine).abs().max())
        print(json.dumps(record), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
