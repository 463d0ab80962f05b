"""Where exgrpo's update and rollout time goes, and what three bench-only prototypes would save (src/ untouched).

    .venv/bin/python bench/anatomy.py [--models smollm2 tiny] [--repeats 3]

On one real batch (the step benchmark's: B prompts of the demo's addition set, K rollouts each from exgrpo's own
HFEngine, SmolLM2 with the demo's LoRA), one JSON line per variant, medians of R repeats after a warm-up:

* "update/current": the trainer's own micro-batch path (`exgrpo.learner.forward.token_logprobs` with entropies,
  `mixed_policy_loss`, backward), split into forward and loss+backward; "update/current_entropy_bonus": the same with
  the default entropy_coef 0.001 (the step benchmark uses 0, as TRL does), so the entropy term is differentiated too.
* "update/no_entropy": the same without computing token entropies in the training forward.
* "update/logsumexp_head": log-probs as logit[target] - logsumexp(logits) on the (N, T, V) logits, no full log-softmax
  tensor and no entropy (what a fused/chunked head would start from).
* "update/prefix_shared": the K members of a group share their prompt: the prompt is run once per group
  (use_cache) and its KV cache repeated K times for the completion tokens, gradients flowing back through the
  cache; `max_abs_logp_diff` checks the log-probs against the full forward.
* "rollout/prefill": the no-grad prompt forward that starts generation, over all B*K rows (what `generate` does)
  vs once per distinct prompt (B rows), and the full HFEngine rollout for scale.
* "rollout/lora_merged" (LoRA models): the HFEngine rollout through the unmerged adapters (as the trainer does)
  vs with `merge_adapter()` before and `unmerge_adapter()` after it, same seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from exgrpo.config import config_from_dict  # noqa: E402
from exgrpo.data import load_questions  # noqa: E402
from exgrpo.config import LoraConfig
from exgrpo.models import apply_lora, load_policy  # noqa: E402
from exgrpo.learner.objective import MicroBatch, mixed_policy_loss  # noqa: E402
from exgrpo.learner.forward import token_logprobs  # noqa: E402
from exgrpo.records import WARMUP  # noqa: E402
from exgrpo.tensors import pack  # noqa: E402
from exgrpo.training.trainer import ExGRPOTrainer  # noqa: E402
from exgrpo.learner.learner import phase_losses  # noqa: E402

DEMO_DATA = ("reasoning_gym:basic_arithmetic?size=64&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=2"
             "&operators=+&allow_negation=false&allow_parentheses=false")
SUFFIX = " Answer with only the final number."
MODELS = {"tiny": ("tiny:0", 8, 8, 32, False), "smollm2": ("smollm2-135m-instruct", 6, 8, 24, True)}


def out(record: dict) -> None:
    def short(v):
        return (round(v, 4) if abs(v) >= 1e-3 else float(f"{v:.3g}")) if isinstance(v, float) else v

    print(json.dumps({k: short(v) for k, v in record.items()}), flush=True)


def median_times(fn, repeats: int) -> dict[str, float]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def bench_model(name: str, repeats: int) -> None:
    preset, B, K, T, lora = MODELS[name]
    model, tok = load_policy(preset)
    if lora:
        model = apply_lora(model, LoraConfig(32, 64, 0.0, "all-linear"))
    config = config_from_dict({
        "rollout": {"num_generations": K, "max_completion_length": T},
        "objective": {"normalizer": float(T), "entropy_coef": 0.0},
        "experience": {"ratio": 0.0},
        "train": {"prompts_per_step": B, "mini_batches": 1, "micro_batch_size": B * K, "threads": 2, "seed": 1},
        "logging": {"output_dir": tempfile.mkdtemp(prefix="exgrpo-anatomy-"), "progress": False},
    })
    questions = list(load_questions(DEMO_DATA, prompt_suffix=SUFFIX))
    trainer = ExGRPOTrainer(model, tok, [lambda prompts, completions, **kw: [0.0] * len(completions)], config,
                            questions)
    qs = questions[:B]
    prompts = [trainer.prompt_ids(q) for q in qs]
    t = time.perf_counter()
    rollouts = trainer.engine.generate([p for p in prompts for _ in range(K)], trainer.generation.sampling,
                                       list(range(B * K)))
    rollout_s = time.perf_counter() - t
    packed = pack([(prompts[i // K], ids, None) for i, ids in enumerate(rollouts.completion_ids)],
                  tok.pad_token_id)
    batch = {k: getattr(packed, k) for k in ("input_ids", "attention_mask", "position_ids", "completion_ids")}
    N, P = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - batch["completion_ids"].shape[1]
    advantages = torch.randn(N)
    mask = packed.completion_mask
    base = {"bench": "anatomy", "model": name, "rows": N, "prompt_len": P, "completion_len": T,
            "completion_tokens": int(mask.sum()), "lora": lora, "repeats": repeats}

    def loss_of(logp, entropy, settings):
        micro = MicroBatch(advantages, mask, packed.replay_mask, logp.detach(), total_tokens=float(mask.sum()),
                           total_sequences=float(N))
        return mixed_policy_loss(logp, logp.detach(), micro, settings, entropy=entropy)[0]

    def run(forward, entropy_coef=0.0):
        settings = dataclasses.replace(phase_losses(config)[WARMUP], entropy_coef=entropy_coef)
        trainer.model.train()

        def once():
            t0 = time.perf_counter()
            logp, entropy = forward()
            t1 = time.perf_counter()
            loss_of(logp, entropy, settings).backward()
            t2 = time.perf_counter()
            trainer.learner.optimizer.zero_grad(set_to_none=True)
            return {"forward_s": t1 - t0, "loss_backward_s": t2 - t1, "total_s": t2 - t0}

        return median_times(once, repeats)

    current = lambda: token_logprobs(trainer.model, packed, 1.0, with_entropy=True)  # noqa: E731
    out({**base, "variant": "update/current", **run(current)})
    out({**base, "variant": "update/current_entropy_bonus", **run(current, 0.001)})
    out({**base, "variant": "update/no_entropy", **run(lambda: token_logprobs(trainer.model, packed, 1.0))})

    temperature = config.rollout.temperature

    def logsumexp_head():
        o = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"], logits_to_keep=T + 1, use_cache=False)
        logits = o.logits[:, :-1] / temperature
        target = logits.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        return target - torch.logsumexp(logits, dim=-1), None

    out({**base, "variant": "update/logsumexp_head", **run(logsumexp_head)})

    def prefix_shared():
        first = torch.arange(0, N, K)  # one row per group: its members share the prompt
        o1 = trainer.model(input_ids=batch["input_ids"][first, :P], attention_mask=batch["attention_mask"][first, :P],
                           position_ids=batch["position_ids"][first, :P], use_cache=True, logits_to_keep=1)
        cache = o1.past_key_values
        cache.batch_repeat_interleave(K)
        o2 = trainer.model(input_ids=batch["completion_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"][:, P:], past_key_values=cache, use_cache=True)
        logits = torch.cat([o1.logits.repeat_interleave(K, dim=0), o2.logits[:, :-1]], dim=1).float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        return logp, None

    with torch.no_grad():
        trainer.model.eval()
        full, _ = token_logprobs(trainer.model, packed, 1.0)
        shared, _ = prefix_shared()
        diff = float(((full - shared).abs() * mask).max())
    out({**base, "variant": "update/prefix_shared", "max_abs_logp_diff": diff, **run(prefix_shared)})

    trainer.model.eval()
    ids, att, pos = batch["input_ids"][:, :P], batch["attention_mask"][:, :P], batch["position_ids"][:, :P]
    first = torch.arange(0, N, K)

    def prefill():
        with torch.no_grad():
            t0 = time.perf_counter()
            trainer.model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            o = trainer.model(input_ids=ids[first], attention_mask=att[first], position_ids=pos[first], use_cache=True,
                              logits_to_keep=1)
            o.past_key_values.batch_repeat_interleave(K)
            t2 = time.perf_counter()
        return {"prefill_all_rows_s": t1 - t0, "prefill_once_per_prompt_s": t2 - t1}

    out({**base, "variant": "rollout/prefill", "hf_engine_rollout_s": rollout_s, **median_times(prefill, repeats)})

    if lora:  # generation through unmerged LoRA adapters vs adapters merged into the weights for the rollout
        rows = [p for p in prompts for _ in range(K)]

        def lora_rollout():
            t0 = time.perf_counter()
            a = trainer.engine.generate(rows, trainer.generation.sampling, list(range(B * K)))
            t1 = time.perf_counter()
            trainer.model.merge_adapter()
            t2 = time.perf_counter()
            b = trainer.engine.generate(rows, trainer.generation.sampling, list(range(B * K)))
            t3 = time.perf_counter()
            trainer.model.unmerge_adapter()
            t4 = time.perf_counter()
            same = sum(x == y for x, y in zip(a.completion_ids, b.completion_ids))
            return {"unmerged_s": t1 - t0, "merged_s": t3 - t2, "merge_plus_unmerge_s": (t2 - t1) + (t4 - t3),
                    "tokens_unmerged": float(sum(map(len, a.completion_ids))),
                    "tokens_merged": float(sum(map(len, b.completion_ids))), "identical_rows": float(same)}

        out({**base, "variant": "rollout/lora_merged", **median_times(lora_rollout, repeats)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name in args.models:
        bench_model(name, args.repeats)


if __name__ == "__main__":
    main()
