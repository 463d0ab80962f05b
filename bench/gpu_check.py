"""The GPU check: exgrpo's CUDA code paths and its figures on one GPU, with nothing but the GPU image's packages.

Sized for the GPU machine this project can get (one H200; torch, transformers, accelerate, peft and safetensors in
its image; no vLLM, no network). Everything it needs is built from configs in-process:

  (a) the CUDA paths of the tests on the tiny model: a 2-step ExGRPO run in bf16 with activation checkpointing,
      the chunked log-prob head and token-budget micro-batches; FSDP2 on one rank over NCCL (shard, gather, a
      training forward/backward, the full state dict);
  (b) a Qwen2.5-1.5B-shaped model (random init) through one update of a 32,768-token micro-batch: time, tokens/s
      and peak CUDA memory, beside docs/distributed.md's memory model;
  (c) the `hf` engine's decode tokens/s on the same model.

One JSON line at the end. `bash bench/gpu_check.sh` runs it on the GPU machine (see that file); `python
bench/gpu_check.py --smoke` runs the same code on CPU at toy sizes, so the script is tested here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from exgrpo.config import config_from_dict  # noqa: E402
from exgrpo.data import Question  # noqa: E402
from exgrpo.learner.objective import LossSettings  # noqa: E402
from exgrpo.learner.forward import token_logprobs  # noqa: E402
from exgrpo.tensors import pack  # noqa: E402
from exgrpo.learner.learner import Learner  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.records import WARMUP  # noqa: E402
from exgrpo.rollout import HFEngine, SamplingSettings  # noqa: E402
from exgrpo.runtime.distributed import Distributed  # noqa: E402
from exgrpo.runtime.sharding import full_model_state, fully_shard_model, gathered  # noqa: E402
from exgrpo.runtime.timing import StageTimer  # noqa: E402
from exgrpo.training.trainer import ExGRPOTrainer  # noqa: E402

# Qwen2.5-Math-1.5B's shape (config.json of the released model); `--smoke` shrinks it
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rope_theta=10000.0,
                 tie_word_embeddings=True)
SMOKE = dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)
DOCS_MEMORY_MODEL_GB = {"model_state_1_gpu": 1.54e9 * 16 / 1e9, "activations_32k_fp32_figure": 16.1,
                        "chunked_head_1024": 1.9}  # docs/distributed.md, "Memory model" (state for 1 GPU, not 8)


def _lowercase_reward(prompts, completions, completion_ids, **_):
    return [float(c[:1].islower()) for c in completions]


def tiny_training_paths(device: torch.device, out: Path) -> dict:
    """(a) a 2-step run of the tiny model with the CUDA-relevant settings of the tests."""
    model, tok = load_policy("tiny:0")
    questions = [Question(f"q{i}", ({"role": "user", "content": f"say {i}"},), str(i), {}) for i in range(8)]
    config = config_from_dict({
        "model": {"name": "tiny"}, "rollout": {"num_generations": 4, "max_completion_length": 8},
        "experience": {"start_threshold": 0.0},
        "train": {"steps": 2, "prompts_per_step": 4, "mini_batches": 2, "micro_batch_size": 8,
                  "dtype": "bf16", "activation_checkpointing": True, "logprob_chunk_tokens": 16,
                  "max_tokens_per_micro_batch": 64, "learning_rate": 1e-3, "save_every": 0},
        "logging": {"output_dir": str(out / "tiny"), "progress": False, "tensorboard": False, "sample_every": 0,
                    "overwrite": True}})
    trainer = ExGRPOTrainer(model, tok, [_lowercase_reward], config, questions,
                            distributed=Distributed(local_rank=device.index or 0))
    history = trainer.train()
    assert next(trainer.model.parameters()).device.type == device.type
    return {"steps": len(history), "loss_finite": all(np.isfinite(h["loss"]) for h in history),
            "phases": [h["phase"] for h in history]}


def fsdp_one_rank(device: torch.device) -> dict:
    """(a) FSDP2 over a one-rank process group (NCCL on CUDA): shard, gather, forward/backward, full state."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        model, tok = load_policy("tiny:1")
        model.to(device)
        fully_shard_model(model, Distributed(1, 0, device.index or 0), bf16=device.type == "cuda")
        batch = pack([([5, 6, 7], [8, 9, 10], None), ([11, 12], [13], None)], tok.pad_token_id)
        logp, _ = token_logprobs(model, batch, 1.0, slice(None), False, device=device)
        (logp * batch.completion_mask.to(device)).sum().backward()
        with gathered(model):
            full = sum(p.numel() for p in model.parameters())
        state = full_model_state(model)
        grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        return {"backend": dist.get_backend(), "parameters": full, "state_tensors": len(state), "grads": grads}
    finally:
        dist.destroy_process_group()


def qwen_shaped(device: torch.device, shape: dict, tokens: int, decode: tuple[int, int]) -> dict:
    """(b) one update of a `tokens`-token micro-batch and (c) hf decode tokens/s, on a random model of `shape`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))  # fp32 master weights; bf16 compute through train.dtype
    params = sum(p.numel() for p in model.parameters())
    prompt = tokens // 128  # 16 rows of 256 prompt + 1792 completion tokens at 32,768
    completion = tokens // 16 - prompt
    rng = np.random.default_rng(0)
    rows = [(rng.integers(10, shape["vocab_size"], prompt).tolist(), rng.integers(10, shape["vocab_size"],
                                                                                 completion).tolist(), None)
            for _ in range(16)]
    batch = pack(rows, pad_id=0)
    config = config_from_dict({"train": {"steps": 1, "mini_batches": 1, "prompts_per_step": 2, "micro_batch_size": 16,
                                         "max_tokens_per_micro_batch": tokens, "dtype": "bf16",
                                         "activation_checkpointing": True, "logprob_chunk_tokens": 1024,
                                         "learning_rate": 1e-6}})
    model.config.use_cache = False
    update = Learner(model, config.train, num_generations=8, temperature=1.0, dist=Distributed(),
                     losses={WARMUP: LossSettings(normalizer=float(completion))})
    advantages = torch.tensor([0.5, -0.5] * 8)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = update(batch, advantages, WARMUP, np.random.default_rng(0), StageTimer())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None
    out = {"parameters": params, "tokens": int(batch.attention_mask.sum()), "update_s": round(seconds, 2),
           "train_tokens_per_s": round(int(batch.attention_mask.sum()) / seconds, 1),
           "peak_cuda_gb": peak, "loss": result.stats["loss"], "docs_memory_model_gb": DOCS_MEMORY_MODEL_GB}
    del update
    model.config.use_cache = True
    prompts, new_tokens = decode
    engine = HFEngine(model, _IdTokenizer(), batch_size=prompts)
    ids = [rng.integers(10, shape["vocab_size"], 64).tolist() for _ in range(prompts)]
    sampling = SamplingSettings(new_tokens, temperature=1.0)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        start = time.perf_counter()
        rollouts = engine.generate(ids, sampling, list(range(prompts)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    generated = sum(len(c) for c in rollouts.completion_ids)
    out.update({"decode_sequences": prompts, "decode_tokens": generated, "decode_s": round(seconds, 2),
                "decode_tokens_per_s": round(generated / seconds, 1)})
    return out


class _IdTokenizer:
    """What HFEngine needs of a tokenizer for a model with random weights: pad and an EOS it will rarely sample."""

    pad_token_id, eos_token_id = 0, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes: check the script, not the GPU")
    parser.add_argument("--out", default="/tmp/exgrpo-gpu-check")
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(args.out)
    start = time.perf_counter()
    report = {"bench": "gpu_check", "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for name, run in (("tiny_training", lambda: tiny_training_paths(device, out)),
                      ("fsdp_one_rank", lambda: fsdp_one_rank(device)),
                      ("qwen2.5_1.5b_shape", lambda: qwen_shaped(device, SMOKE if args.smoke else QWEN_1_5B,
                                                                  512 if args.smoke else 32768,
                                                                  (4, 8) if args.smoke else (64, 256)))):
        part = time.perf_counter()
        try:
            report[name] = {**run(), "wall_s": round(time.perf_counter() - part, 1)}
        except Exception as e:  # report every part, then fail
            report[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"gpu_check: {name}: {report[name]}", file=sys.stderr, flush=True)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report))
    sys.exit(1 if any("error" in v for v in report.values() if isinstance(v, dict)) else 0)


if __name__ == "__main__":
    main()
