"""Seconds per optimizer step: TRL's GRPOTrainer vs exgrpo (GRPO, i.e. experience.ratio=0) vs exgrpo (ExGRPO after
the switch), plus the per-phase breakdown of each trainer's step.

    .venv-bench/bin/python bench/step_time.py --model tiny              # needs trl (bench/requirements.txt)
    .venv-bench/bin/python bench/step_time.py --model smollm2
    .venv/bin/python bench/step_time.py --model gemma3 --trainers grpo   # configs/gemma3-270m.yaml's work
    .venv/bin/python bench/step_time.py --model tiny --trainers grpo exgrpo   # exgrpo only, no TRL needed

One JSON line per measured step ("bench": "step"), then per trainer a summary ("step_summary") and the median
breakdown ("step_breakdown"), and finally the ratios ("step_ratios"). Everything goes to stdout; TRL's and
transformers' chatter goes to stderr.

Same work for every trainer: the same model weights (each trainer gets its own copy), the same prompts (the chat
template rendered by exgrpo; TRL receives the rendered text, and its token ids are checked to be equal), K
completions per prompt, B prompts per step, the same completion length, learning rate, AdamW (weight decay 0,
constant schedule, grad-norm clip 1.0), sampling at temperature 1 without top-k/top-p, fp32 on CPU, the same reward
function object, and the same loss: Dr.GRPO aggregation (token sum / max_completion_length; TRL
loss_type="dr_grpo"), no std scaling (scale_rewards none), no KL (beta 0), no entropy bonus, PPO clip 0.2. Every
trainer takes exactly one optimizer step per step, with one micro-batch of all B*K sequences (TRL:
per_device_train_batch_size = B*K, gradient_accumulation_steps = steps_per_generation = 1, so it skips the separate
old-log-prob pass; exgrpo: train.mini_batches = 1, micro_batch_size = B*K, so the training forward is the
pre-update forward). No checkpointing or evaluation; exgrpo's steps include its Tracker.log (JSONL + TensorBoard),
TRL's include its own logging (report_to none).

Interleaving: with TRL in the set, TRL's `train()` drives the rounds and a callback runs one step of each exgrpo
trainer after each TRL optimizer step (TRL's step time excludes the callback). Without TRL, a plain loop
alternates the exgrpo trainers. The first `--warmup` rounds are discarded; summaries are medians over the rest.
ExGRPO uses experience.start_threshold 0, so it switches to the mixed phase after its first step; the buffer is
filled from the second step on (collection happens in the mixed phase only), so replays start at the third step.
Hence the default warm-up of 2 rounds for every trainer: ExGRPO's measured steps all replay, and each line records
how many questions were replayed.
"""

from __future__ import annotations

import atexit
import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from exgrpo.config import config_from_dict  # noqa: E402
from exgrpo.data import load_questions, render_prompt  # noqa: E402
from exgrpo.config import LoraConfig
from exgrpo.models import apply_lora, load_policy  # noqa: E402
from exgrpo.rewards import GradingPool, grade_math  # noqa: E402
from exgrpo.runtime.tracking import Tracker  # noqa: E402
from exgrpo.training.trainer import ExGRPOTrainer  # noqa: E402

DEMO_DATA = ("reasoning_gym:basic_arithmetic?size=800&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=2"
             "&operators=+&allow_negation=false&allow_parentheses=false")
PRESETS = {
    # tiny random model: a reward it can earn (~26% of its first characters are lowercase letters)
    "tiny": dict(model="tiny:0", data=DEMO_DATA.replace("size=800", "size=256"), K=8, B=8, T=32, lr=1e-3,
                 lora=False, reward="lowercase", warmup=2, steps=10),
    # configs/demo.yaml: SmolLM2-135M-Instruct + LoRA r32/alpha64, 1-2 digit addition, math-verify reward (2 workers)
    "smollm2": dict(model="smollm2-135m-instruct", data=DEMO_DATA, K=8, B=6, T=24, lr=2e-4, lora=True,
                    reward="math", warmup=2, steps=6),
    # the same work with Gemma 3 270M (configs/gemma3-270m.yaml; issue #47)
    "gemma3": dict(model="gemma3-270m", data=DEMO_DATA, K=8, B=6, T=24, lr=2e-4, lora=True,
                   reward="math", warmup=2, steps=6),
}
SUFFIX = " Answer with only the final number."
PHASES = ["time/rollout", "time/logprob", "time/reward", "time/selection", "time/buffer", "time/update",
          "time/tracking"]
LORA = LoraConfig(r=32, alpha=64, dropout=0.0, target_modules="all-linear")


def out(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ------------------------------------------------------------------ rewards (one object shared by all trainers)
def lowercase_start(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1.0 when the completion starts with a lowercase ASCII letter."""
    return [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions]


def make_math_reward(pool: GradingPool):
    def math_reward(prompts, completions, completion_ids=None, *, answer, **columns) -> list[float]:
        """math-verify against the gold answer, in the grading pool (as exgrpo's MathReward)."""
        return pool.grade(grade_math, list(completions), list(answer))

    return math_reward


# ------------------------------------------------------------------ timing helpers
class Timed:
    """Wrap a bound method; accumulate its wall time into `sink[key]`."""

    def __init__(self, fn, sink: dict, key: str):
        self.fn, self.sink, self.key = fn, sink, key

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.sink[self.key] = self.sink.get(self.key, 0.0) + time.perf_counter() - t


class ExgrpoRunner:
    def __init__(self, name: str, preset: dict, questions, reward, ratio: float, threads: int, workdir: str):
        self.name = name
        model, tok = load_policy(preset["model"])
        if preset["lora"]:
            model = apply_lora(model, LORA)
        K, B, T = preset["K"], preset["B"], preset["T"]
        self.config = config_from_dict({
            "model": {"name": preset["model"]},
            "rollout": {"num_generations": K, "max_completion_length": T, "temperature": 1.0, "top_p": 1.0,
                        "top_k": 0, "generation_batch_size": 256},
            "objective": {"scale_rewards": "none", "aggregation": "sum_constant", "normalizer": float(T),
                          "entropy_coef": 0.0, "epsilon_low": 0.2, "epsilon_high": 0.2},
            "experience": {"ratio": ratio, "start_threshold": 0.0},
            "train": {"steps": 10_000, "prompts_per_step": B, "mini_batches": 1, "micro_batch_size": B * K,
                      "learning_rate": preset["lr"], "weight_decay": 0.0, "lr_scheduler": "constant",
                      "max_grad_norm": 1.0, "threads": threads, "seed": 1},
            "logging": {"output_dir": os.path.join(workdir, name), "sample_every": 0, "progress": False},
        })
        self.trainer = ExGRPOTrainer(model, tok, [reward], self.config, questions)
        self.tracker = Tracker(self.config.logging.output_dir, 10_000, tensorboard=True, progress=False)

    def prompt_ids(self, question) -> list[int]:
        return self.trainer.prompt_ids(question)

    def step(self) -> dict:
        t = time.perf_counter()
        metrics = self.trainer.train_step()
        t_track = time.perf_counter()
        self.tracker.log(self.trainer.step, metrics)
        end = time.perf_counter()
        metrics["time/tracking"] = end - t_track
        seconds = end - t
        rec = {
            "seconds": seconds,
            "phase": metrics["phase"],
            "replayed": metrics["experience/replayed"],
            "buffer_questions": metrics["experience/questions"],
            "completion_mean_length": metrics["completions/mean_length"],
            "reward": metrics["reward"],
            **{k: metrics[k] for k in PHASES},
            # inside time/update: training forward (incl. log-softmax/entropy), optimizer (clip + AdamW), the rest is
            # loss + backward; selection's scoring forwards are time/selection
            "detail/update_forward": metrics["time/forward"],
            "detail/optimizer": metrics["time/optimizer"],
        }
        rec["detail/update_loss_backward"] = (metrics["time/update"] - rec["detail/update_forward"]
                                              - rec["detail/optimizer"])
        rec["time/other"] = seconds - sum(metrics[k] for k in PHASES)
        return rec

    def close(self) -> None:
        self.tracker.close()


def build_trl(preset: dict, rendered: list[dict], reward, threads: int, steps: int, workdir: str, callback,
              bf16: bool = False):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    K, B, T = preset["K"], preset["B"], preset["T"]
    model, tok = load_policy(preset["model"])
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"), use_cpu=True, bf16=bf16, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=B * K, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=K, max_completion_length=T, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=preset["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        loss_type="dr_grpo", scale_rewards="none", beta=0.0, epsilon=0.2, entropy_coef=0.0,
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=1, log_completions=False,
    )
    peft_config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
                             target_modules=LORA.modules, task_type="CAUSAL_LM") if preset["lora"] else None
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rendered),
                          processing_class=tok, peft_config=peft_config, callbacks=[callback])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, which carries JSON lines only
    # TRL's phases, for its own breakdown
    detail: dict[str, float] = {}
    trainer._generate_single_turn = Timed(trainer._generate_single_turn, detail, "time/rollout")
    trainer._calculate_rewards = Timed(trainer._calculate_rewards, detail, "time/reward")
    trainer._get_per_token_logps_and_entropies = Timed(trainer._get_per_token_logps_and_entropies, detail,
                                                       "detail/update_forward")
    trainer.optimizer_detail = detail
    torch.set_num_threads(threads)
    return trainer, tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--trainers", nargs="+", choices=["trl", "grpo", "exgrpo"], default=["trl", "grpo", "exgrpo"])
    parser.add_argument("--steps", type=int, help="measured steps per trainer (default: preset)")
    parser.add_argument("--warmup", type=int, help="discarded first rounds (default: preset)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-bf16", action="store_true", help="TRL with bf16=True (its CPU default is fp32)")
    args = parser.parse_args()
    if args.trl_bf16 and "trl" not in args.trainers:  # it would be recorded as set while nothing read it
        parser.error("--trl-bf16 sets TRL's precision: it goes with --trainers trl")
    preset = dict(PRESETS[args.model])
    steps = args.steps or preset["steps"]
    warmup = preset["warmup"] if args.warmup is None else args.warmup
    rounds = warmup + steps
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    questions = list(load_questions(preset["data"], prompt_suffix=SUFFIX))
    pool = GradingPool(num_workers=2, timeout=5.0) if preset["reward"] == "math" else None
    reward = make_math_reward(pool) if pool is not None else lowercase_start
    workdir = tempfile.mkdtemp(prefix="exgrpo-bench-")
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    runners = []
    if "grpo" in args.trainers:
        runners.append(ExgrpoRunner("grpo", preset, questions, reward, 0.0, args.threads, workdir))
    if "exgrpo" in args.trainers:
        runners.append(ExgrpoRunner("exgrpo", preset, questions, reward, 0.5, args.threads, workdir))
    tokenizer = (runners[0].trainer.tokenizer if runners else load_policy(preset["model"])[1])
    base = {"bench": "step", "model": args.model, "K": preset["K"], "B": preset["B"], "T": preset["T"],
            "lora": preset["lora"], "threads": args.threads, "trl_bf16": args.trl_bf16}
    records: dict[str, list[dict]] = {}

    def emit(trainer: str, round_: int, rec: dict) -> None:
        rec = {**base, "trainer": trainer, "round": round_, "warmup": round_ < warmup, **rec,
               "torch_threads": torch.get_num_threads()}
        records.setdefault(trainer, []).append(rec)
        out({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()})

    def step_exgrpo(round_: int) -> None:
        for r in runners:
            emit(r.name, round_, r.step())

    if "trl" in args.trainers:
        from transformers import TrainerCallback

        state = {"t": None, "round": 0}

        class Interleave(TrainerCallback):
            def on_train_begin(self, a, s, c, **kw):
                state["t"] = time.perf_counter()

            def on_step_end(self, a, s, c, **kw):
                seconds = time.perf_counter() - state["t"]
                m = trl._metrics["train"]
                d = dict(trl.optimizer_detail)
                trl.optimizer_detail.clear()
                rec = {"seconds": seconds,
                       "completion_mean_length": m["completions/mean_length"][-1],
                       "reward": m["reward"][-1], **d}
                rec["time/other"] = seconds - d.get("time/rollout", 0.0) - d.get("time/reward", 0.0)
                emit("trl", state["round"], rec)
                step_exgrpo(state["round"])
                state["round"] += 1
                torch.set_num_threads(args.threads)
                state["t"] = time.perf_counter()

        rendered = [{"prompt": render_prompt(tokenizer, q.messages), "answer": q.answer} for q in questions]
        trl, trl_tok = build_trl(preset, rendered, reward, args.threads, rounds, workdir, Interleave(),
                                 bf16=args.trl_bf16)
        # the same prompt token ids as exgrpo's
        same = all(trl_tok(text=[row["prompt"]])["input_ids"][0] == (runners[0].prompt_ids(q) if runners else None)
                   for row, q in list(zip(rendered, questions))[:32])
        out({"bench": "check", "model": args.model, "trl_prompt_ids_equal_exgrpo": bool(same or not runners)})
        trl.train()
    else:
        for i in range(rounds):
            step_exgrpo(i)

    # ---------------------------------------------------------------- summaries
    medians = {}
    for trainer, recs in records.items():
        measured = [r for r in recs if not r["warmup"]]
        keys = [k for k in measured[0] if k.startswith(("time/", "detail/"))]
        med = {k: statistics.median(r[k] for r in measured) for k in keys}
        seconds = [r["seconds"] for r in measured]
        medians[trainer] = statistics.median(seconds)
        out({"bench": "step_summary", "model": args.model, "trainer": trainer, "steps": len(measured),
             "median_s": round(medians[trainer], 4), "min_s": round(min(seconds), 4),
             "max_s": round(max(seconds), 4),
             "completion_mean_length": round(statistics.mean(r["completion_mean_length"] for r in measured), 2),
             "replayed_per_step": (round(statistics.mean(r["replayed"] for r in measured), 2)
                                   if "replayed" in measured[0] else None),
             "phases": sorted({r.get("phase", "-") for r in measured})})
        total = medians[trainer]
        out({"bench": "step_breakdown", "model": args.model, "trainer": trainer, "median_step_s": round(total, 4),
             "seconds": {k: round(v, 4) for k, v in med.items()},
             "fractions": {k: round(v / total, 3) for k, v in med.items()}})
    ratios = {"bench": "step_ratios", "model": args.model}
    if "trl" in medians and "grpo" in medians:
        ratios["grpo_over_trl"] = round(medians["grpo"] / medians["trl"], 3)
        ratios["target_grpo_over_trl"] = 0.6
    if "grpo" in medians and "exgrpo" in medians:
        ratios["exgrpo_over_grpo"] = round(medians["exgrpo"] / medians["grpo"], 3)
        ratios["target_exgrpo_over_grpo"] = 1.1
    out(ratios)
    for r in runners:
        r.close()
    if pool is not None:
        pool.close()


if __name__ == "__main__":
    main()
