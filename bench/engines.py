"""Rollout engines side by side: seconds per training step and rollout tokens/s of the `hf` engine vs the `vllm` engine
(fp32, and bf16 with the truncated-IS correction) on the demo setting, interleaved; and evaluation throughput.

    .venv-vllm/bin/python bench/engines.py                    # needs the vLLM venv (make test-vllm creates it)
    .venv-vllm/bin/python bench/engines.py --rounds 6 --eval-questions 16

Demo setting (configs/demo.yaml): SmolLM2-135M-Instruct + LoRA r32, 6 questions x 8 rollouts, <= 24 new tokens,
math-verify reward in 2 workers, one optimizer step per step, fp32 training. Each engine gets its own trainer
(same weights, same seeds) and the trainers take turns, one step each per round; the first round (vLLM's kernel
JIT, the first weight push) is discarded and medians over the rest are reported. Eval: the first N MATH-500
questions, 1 sample each at T = 0.6 with up to 256 new tokens, through `exgrpo.evaluation.evaluate_questions`.
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
BENCH_DATA = ROOT.parent / "shared" / "data" / "benchmarks"
ENGINES = {"hf": ["rollout.engine=hf"],
           "vllm-fp32": ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48"],
           "vllm-bf16": ["rollout.engine=vllm", "rollout.engine_dtype=bfloat16", "rollout.max_model_len=256",
                         "rollout.generation_batch_size=48"]}


def out(record: dict) -> None:
    print(json.dumps(record), flush=True)


def step_times(rounds: int) -> None:
    from exgrpo.config import load_config
    from exgrpo.training.run import build_run

    runs = {}
    for name, overrides in ENGINES.items():
        config = load_config(ROOT / "configs" / "demo.yaml", overrides + [
            "experience.ratio=0", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
            f"logging.output_dir={tempfile.mkdtemp(prefix=f'exgrpo-engines-{name}-')}"])
        runs[name] = build_run(config)
    records = {name: [] for name in runs}
    try:
        for r in range(rounds + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                metrics, _ = run.trainer.train_step()
                seconds = time.perf_counter() - start
                tokens = sum(len(m.completion_ids) for g in run.trainer.last_step.groups for m in g.members)
                rec = {"bench": "engine_step", "engine": name, "round": r, "warmup": r == 0, "seconds": seconds,
                       "rollout_s": metrics["time/rollout"], "rollout_tokens_per_s": tokens / metrics["time/rollout"],
                       "reward": metrics["reward"], "logp_diff_mean": metrics.get("rollout/logp_diff_mean"),
                       "tis_weight_mean": metrics.get("tis/weight_mean")}
                out(rec)
                if r:
                    records[name].append(rec)
    finally:
        for run in runs.values():
            run.close()
    for name, recs in records.items():
        out({"bench": "engine_step_summary", "engine": name, "steps": len(recs),
             **{f"median_{k}": statistics.median(x[k] for x in recs) for k in ("seconds", "rollout_s",
                                                                                  "rollout_tokens_per_s")}})


def eval_throughput(questions: int) -> None:
    from exgrpo.evaluation import EvalProtocol, evaluate_questions
    from exgrpo.evaluation.benchmarks import BENCHMARKS, load_benchmarks
    from exgrpo.evaluation.run import build_eval_engine
    from exgrpo.models import load_policy
    from exgrpo.rewards import GradingPool

    data = load_benchmarks([BENCHMARKS["math500"]], BENCH_DATA)
    data[0].items = data[0].items[:questions]
    protocol = EvalProtocol(max_new_tokens=256)
    model, tok = load_policy("smollm2-135m-instruct")
    with GradingPool(num_workers=2) as pool:
        for name in ("hf", "vllm"):
            engine = build_eval_engine(name, model, tok, data, protocol, batch_size=64, dtype="float32")
            start = time.perf_counter()
            result = evaluate_questions(engine, tok, data[0].questions, name="math500", kind="math", samples=1,
                                        protocol=protocol, pool=pool, batch_size=64)
            seconds = time.perf_counter() - start
            engine.close()
            tokens = result.completion_tokens * questions
            out({"bench": "engine_eval", "engine": name, "questions": questions, "max_new_tokens": 256,
                 "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                 "accuracy": result.metrics()["avg@1"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after one discarded)")
    parser.add_argument("--eval-questions", type=int, default=16)
    args = parser.parse_args()
    step_times(args.rounds)
    if BENCH_DATA.is_dir():
        eval_throughput(args.eval_questions)


if __name__ == "__main__":
    main()
