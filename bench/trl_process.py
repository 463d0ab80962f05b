"""Whole processes, one after the other, on the demo's work: TRL's GRPOTrainer (`bench/step_time.py --trainers trl`
in .venv-bench) and `exgrpo train` at its fastest setting (in .venv-vllm); medians of steps 2-5 and their ratio.

    make bench-trl        # creates both venvs when missing; -> bench/results/trl_process.jsonl

The work is bench/step_time.py's SmolLM2 preset (configs/demo.yaml's: LoRA r32, 6 questions x 8 rollouts, <= 24
new tokens, math-verify in 2 workers, one optimizer step per step) with the same loss settings (Dr.GRPO sum / 24,
no std scaling, no KL, no entropy bonus, clip 0.2, constant lr 2e-4, weight decay 0, T = 1). TRL's step time is
its callback's (optimizer step to optimizer step); exgrpo's is `time/step` from metrics.jsonl. TRL runs twice: fp32
(its CPU default) and with `bf16=True`; exgrpo runs the setting given by --exgrpo (default: the vLLM bf16 engine with
a bf16 trainer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from engines import SETTINGS
from exgrpo.runtime.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
FASTEST = SETTINGS["vllm-bf16-bf16"]  # the fastest row of bench/engines.py
SAME_WORK = ["experience.ratio=0", "train.steps=5", "eval.every=0", "logging.progress=false",
             "logging.sample_every=0", "objective.scale_rewards=none", "objective.entropy_coef=0",
             "objective.epsilon_high=0.2", "train.weight_decay=0", "train.lr_scheduler=constant"]


def trl_seconds(python: str, bf16: bool) -> list[float]:
    lines = subprocess.run([python, str(ROOT / "bench" / "step_time.py"), "--model", "smollm2", "--trainers", "trl",
                            "--warmup", "1", "--steps", "4", *(["--trl-bf16"] if bf16 else [])], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    steps = [json.loads(line) for line in lines.stdout.splitlines() if '"bench": "step"' in line]
    return [s["seconds"] for s in steps if not s["warmup"]]


def exgrpo_seconds(python: str, setting: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="exgrpo-trl-process-") as run_dir:  # the run's 116 MB of checkpoints
        subprocess.run([python, "-m", "exgrpo", "train", "--config", str(ROOT / "configs" / "demo.yaml"), *SAME_WORK,
                        *setting, f"logging.output_dir={run_dir}", "--overwrite"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        return [m["time/step"] for m in read_metrics(Path(run_dir) / "metrics.jsonl") if m["step"] >= 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    parser.add_argument("--exgrpo-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--exgrpo", nargs="*", default=FASTEST, help="exgrpo's setting (config overrides)")
    args = parser.parse_args()
    for flag, python in (("--trl-python", args.trl_python), ("--exgrpo-python", args.exgrpo_python)):
        if shutil.which(python) is None:  # before the TRL runs, not a traceback after them
            parser.error(f"{flag} {python}: no such interpreter (make bench-trl creates both venvs)")
    trl, trl_bf16 = trl_seconds(args.trl_python, bf16=False), trl_seconds(args.trl_python, bf16=True)
    ours = exgrpo_seconds(args.exgrpo_python, args.exgrpo)
    record = {"bench": "trl_process", "exgrpo_setting": args.exgrpo, "trl_steps_s": trl, "trl_bf16_steps_s": trl_bf16,
              "exgrpo_steps_s": ours, "trl_median_s": statistics.median(trl),
              "trl_bf16_median_s": statistics.median(trl_bf16), "exgrpo_median_s": statistics.median(ours),
              "ratio": statistics.median(ours) / statistics.median(trl),
              "ratio_to_trl_bf16": statistics.median(ours) / statistics.median(trl_bf16)}
    print(json.dumps(record), flush=True)
    if record["ratio"] > 0.35:
        print(f"exgrpo takes {record['ratio']:.2f}x TRL's step time (target <= 0.35)", file=sys.stderr)


if __name__ == "__main__":
    main()
