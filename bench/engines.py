"""Rollout engines and training precisions side by side on the demo setting: seconds per step, its stages, rollout
tokens/s, and the step's compute bound on this machine; then rollout throughput at a longer completion length.

    .venv-vllm/bin/python bench/engines.py                    # needs the vLLM venv (make test-vllm creates it)
    .venv-vllm/bin/python bench/engines.py --steps 5 --settings hf-fp32 vllm-bf16-bf16 --long-questions 16

Demo setting (configs/demo.yaml): SmolLM2-135M-Instruct + LoRA r32, 6 questions x 8 rollouts, <= 24 new tokens,
math-verify reward in 2 workers, one optimizer step per step, GRPO (experience.ratio=0). Settings: the engine (hf:
the trainer's own forward; vllm) x the engine's precision x the trainer's (`train.dtype`). Each setting runs as a
whole `exgrpo train` process, one after the other (in one process, five trainers' weights and KV caches evict each
other's from the CPU caches: steps measured that way took up to 2x longer); the first step (vLLM's kernel JIT)
is not counted, and the medians of `time/*` over steps 2-5 are reported.

The bound: the step's matmul FLOPs at this machine's measured matmul rate for the precision (a 1024^3 matmul,
timed here): rollout 2 P (prompt tokens once per group + completion tokens), update 4 P (the same tokens; LoRA:
the frozen weights need activation gradients only), P = the model's parameters; the selection forward of ExGRPO is
not in a GRPO step. Long: the first N MATH-500 questions, 1 sample each at T = 0.6 with up to 256 new tokens,
through `exgrpo.evaluation.evaluate_questions`, per engine and precision. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_DATA = ROOT.parent / "shared" / "data" / "benchmarks"
_VLLM = ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48"]
SETTINGS = {"hf-fp32": ["rollout.engine=hf"],
            "hf-bf16": ["rollout.engine=hf", "train.dtype=bf16"],
            "vllm-fp32": _VLLM,
            "vllm-bf16-fp32": _VLLM + ["rollout.engine_dtype=bfloat16"],  # a bf16 engine, an fp32 trainer (TIS)
            "vllm-bf16-bf16": _VLLM + ["train.dtype=bf16"]}  # engine_dtype auto follows the trainer: bf16


def out(record: dict) -> None:
    print(json.dumps(record), flush=True)


def matmul_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def mean_prompt_tokens() -> float:
    from exgrpo.config import load_config
    from exgrpo.data import PromptEncoder, load_questions
    from exgrpo.models import load_policy

    config = load_config(ROOT / "configs" / "demo.yaml", ["logging.output_dir=/tmp/unused"])
    encode = PromptEncoder.from_config(load_policy(config.model.name)[1], config.data)
    questions = list(load_questions(config.data.train, prompt_suffix=config.data.prompt_suffix))[:200]
    return statistics.mean(len(encode(q)) for q in questions)


def step_times(settings: list[str], steps: int, gflops: dict) -> None:
    """Each setting as a whole `exgrpo train` process, one after the other; medians of steps 2..steps."""
    from exgrpo.config import load_config
    from exgrpo.config.rules import compute_precision, engine_precision
    from exgrpo.runtime.tracking import read_metrics

    prompt_tokens = 6 * mean_prompt_tokens()  # a group's prompt runs once, in the rollout and in the update
    for name in settings:
        run_dir = tempfile.mkdtemp(prefix=f"exgrpo-engines-{name}-")
        overrides = SETTINGS[name] + ["experience.ratio=0", "eval.every=0", "logging.progress=false",
                                      f"train.steps={steps}", f"logging.output_dir={run_dir}", "--overwrite"]
        subprocess.run([sys.executable, "-m", "exgrpo", "train", "--config", str(ROOT / "configs" / "demo.yaml"),
                        *overrides], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        config = load_config(ROOT / "configs" / "demo.yaml", overrides[:-1])
        rate = {"bfloat16": gflops["bf16"] * 1e9, "float32": gflops["fp32"] * 1e9}
        params = 134_515_008 + 9_768_960  # SmolLM2-135M-Instruct + the demo's LoRA r32 (counted)
        records = []
        for m in read_metrics(Path(run_dir) / "metrics.jsonl")[1:]:
            tokens = prompt_tokens + m["tokens_per_second"] * m["time/step"]
            records.append({"bench": "engine_step", "setting": name, "step": m["step"],
                            **{k: v for k, v in m.items() if k.startswith("time/")},
                            "rollout_tokens_per_s": m["tokens_per_second"] * m["time/step"] / m["time/rollout"],
                            "reward": m["reward"], "logp_diff_mean": m.get("rollout/logp_diff_mean"),
                            "bound_rollout_s": 2 * params * tokens / rate[engine_precision(config)],
                            "bound_update_s": 4 * params * tokens / rate[compute_precision(config)]})
            out(records[-1])
        keys = [k for k in records[0] if k.startswith(("time/", "bound_")) or k == "rollout_tokens_per_s"]
        summary = {f"median_{k}": statistics.median(r[k] for r in records) for k in keys}
        bound = statistics.median(r["bound_rollout_s"] + r["bound_update_s"] for r in records)
        out({"bench": "engine_step_summary", "setting": name, "steps": len(records), **summary, "bound_s": bound,
             "step_over_bound": summary["median_time/step"] / bound})


def eval_throughput(questions: int) -> None:
    from exgrpo.evaluation import EvalProtocol, evaluate_questions
    from exgrpo.evaluation.benchmarks import BENCHMARKS, load_benchmarks
    from exgrpo.evaluation.evaluate import build_eval_engine
    from exgrpo.models import load_policy
    from exgrpo.rewards import GradingPool

    data = load_benchmarks([BENCHMARKS["math500"]], BENCH_DATA)
    data[0].items = data[0].items[:questions]
    protocol = EvalProtocol(max_new_tokens=256)
    with GradingPool(num_workers=2) as pool:
        for name, dtype in (("hf", "float32"), ("hf", "bfloat16"), ("vllm", "float32"), ("vllm", "bfloat16")):
            model, tok = load_policy("smollm2-135m-instruct", dtype=dtype)
            engine = build_eval_engine(name, model, tok, data, protocol, batch_size=64, dtype=dtype)
            start = time.perf_counter()
            result = evaluate_questions(engine, tok, data[0].questions, name="math500", kind="math", samples=1,
                                        protocol=protocol, pool=pool, batch_size=64)
            seconds = time.perf_counter() - start
            engine.close()
            tokens = result.completion_tokens * questions
            out({"bench": "engine_eval", "engine": name, "dtype": dtype, "questions": questions,
                 "max_new_tokens": 256, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                 "accuracy": result.metrics()["avg@1"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is not counted)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--long-questions", type=int, default=16, help="MATH-500 questions at 256 tokens (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    gflops = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    out({"bench": "matmul_gflops", **gflops})
    step_times(args.settings, args.steps, gflops)
    if args.long_questions and BENCH_DATA.is_dir():
        eval_throughput(args.long_questions)


if __name__ == "__main__":
    main()
