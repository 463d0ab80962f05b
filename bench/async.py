"""Sync vs async rollouts (`rollout.mode`) on the demo setting: step wall time, rollouts per second, how long the
learner waited for the engine and the engine for the learner, and held-out accuracy after the same steps.

    .venv-vllm/bin/python bench/async.py                       # 1 round: sync, then async s = 1 (~12 min on 2 cores)
    .venv-vllm/bin/python bench/async.py --rounds 2 --steps 15

Demo setting (configs/demo.yaml) on the vLLM engine in fp32 (rollout.engine=vllm; in async mode the engine runs in
processes of its own). Each mode runs as a whole `exgrpo train` process; the modes alternate within each round so
that a change of the machine's speed hits both. Per run: the median of `time/step` over steps 2.. (the first holds
vLLM's warm-up and, in async mode, the first two generations), rollouts per second over those steps, and the
learner's and engine's idle shares of the step: async mode logs them (`async/learner_idle`, `async/engine_idle`);
in sync mode the learner idles through `time/rollout` and the engine through the rest of the step. Held-out
accuracy: `eval/accuracy` after the last step (eval.every = steps). One JSON line per run, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from exgrpo.runtime.tracking import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM = ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48"]
MODES = {"sync": [], "async s=1": ["rollout.mode=async", "rollout.max_staleness=1"]}


def run(mode: str, steps: int, directory: str, overrides: list[str] | None = None,
        launcher: list[str] = (sys.executable, "-m")) -> dict:
    """One `exgrpo train` process (`launcher` runs the module: python -m, or torchrun ... -m) in `mode` (sync, or
    an async one), with `overrides` (default: the vLLM engine and the mode's), summarised."""
    overrides = [*(overrides if overrides is not None else [*VLLM, *MODES[mode]]), f"train.steps={steps}",
                 f"eval.every={steps}", "logging.progress=false", "logging.sample_every=0",
                 f"logging.output_dir={directory}", "--overwrite"]
    subprocess.run([*launcher, "exgrpo", "train", "--config", str(ROOT / "configs" / "demo.yaml"), *overrides],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = read_metrics(Path(directory) / "metrics.jsonl")
    later = metrics[1:]
    if mode == "sync":
        learner_idle = [m["time/rollout"] for m in later]
        engine_idle = [m["time/step"] - m["time/rollout"] for m in later]
    else:
        learner_idle = [m["async/learner_idle"] for m in later]
        engine_idle = [m["async/engine_idle"] for m in later]
    step_time = sum(m["time/step"] for m in later)
    return {"bench": "async", "mode": mode, "steps": steps,
            "median_step_s": round(statistics.median(m["time/step"] for m in later), 2),
            "rollouts_per_s": round(sum(m["generation/rollouts"] for m in later) / step_time, 2),
            "learner_idle_share": round(sum(learner_idle) / step_time, 3),
            "engine_idle_share": round(sum(engine_idle) / step_time, 3),
            "staleness_mean": round(statistics.mean(m.get("async/staleness_mean", 0.0) for m in later), 2),
            "heldout_accuracy": round(metrics[-1]["eval/accuracy"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for mode in MODES:
                records.append({**run(mode, args.steps, os.path.join(scratch, f"{round_}-{len(records)}")),
                                "round": round_})
                print(json.dumps(records[-1]), flush=True)
    print("\n| mode | round | median step (s) | rollouts/s | learner idle | engine idle | staleness | held-out |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['mode']} | {r['round']} | {r['median_step_s']} | {r['rollouts_per_s']} | "
              f"{100 * r['learner_idle_share']:.0f}% | {100 * r['engine_idle_share']:.0f}% | {r['staleness_mean']} | "
              f"{100 * r['heldout_accuracy']:.1f}% |")


if __name__ == "__main__":
    main()
