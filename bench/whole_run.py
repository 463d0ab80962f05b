"""A whole run of round five's study setting, an old commit's code against the working tree's, one whole process
after the other: GRPO (round five's `grpo` arm), seed 1, 60 steps with its seven held-out evaluations (160 questions
x 4 samples, step 0's included) and its checkpoints, with the overrides of experiments/round-five.yaml, as
`exgrpo train`. Prints one JSON line per code (wall time of the process, the steps' sum and median, the rest:
start, evaluations, checkpoints) and their ratios; appends them to bench/results/whole_run.jsonl.

    .venv-vllm/bin/python bench/whole_run.py --base 814198f      # ~45 min on 2 cores, nothing else running
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "whole_run.jsonl"


def study_overrides(arm: str = "grpo", seed: int = 1) -> list[str]:
    """The overrides of one run of round five, read from its study file."""
    study = yaml.safe_load((ROOT / "experiments" / "round-five.yaml").read_text())
    return [*study["overrides"], *study["arms"][arm]["overrides"], f"train.seed={seed}"]


def whole_run(label: str, source: Path) -> dict:
    """`exgrpo train` of the run with the code in `source`/src, as a whole process, timed."""
    run_dir = Path(tempfile.mkdtemp(prefix="exgrpo-whole-run-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(source / "src"), "HF_HUB_OFFLINE": "1"}
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "exgrpo", "train", "--config", "demo", *study_overrides(),
                        f"logging.output_dir={run_dir}", "--overwrite"], cwd=source, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - started
        steps = [json.loads(line)["time/step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    record = {"bench": "whole_run", "code": label, "steps": len(steps), "wall_min": round(wall / 60, 2),
              "steps_min": round(sum(steps) / 60, 2), "median_step_s": round(statistics.median(steps), 2),
              "rest_min": round((wall - sum(steps)) / 60, 2), "load": os.getloadavg()}
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the old commit, run first from a temporary worktree")
    args = parser.parse_args()
    base_dir = Path(tempfile.mkdtemp(prefix="exgrpo-whole-run-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(base_dir), args.base], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        old = whole_run(args.base, base_dir)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT, check=True)
    new = whole_run("working tree", ROOT)
    ratios = {"bench": "whole_run_ratio", "base": args.base, "wall": round(new["wall_min"] / old["wall_min"], 3),
              "median_step": round(new["median_step_s"] / old["median_step_s"], 3)}
    print(json.dumps(ratios))
    with RESULTS.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in (old, new, ratios))


if __name__ == "__main__":
    main()
