"""The behaviour check for refactors: the same short trainings on BASE and on the working tree, their
metrics.jsonl compared step by step without wall times.

    make metrics-diff BASE=<commit> [SETTINGS=tiny-sync,tiny-async]      # in .venv-vllm, every setting by default
    python bench/metrics_diff.py BASE [--settings demo-sync,tiny-sync] [--steps N]

BASE is checked out into a temporary `git worktree` (removed afterwards, also on failure); the working tree is this
checkout as it is (HEAD and uncommitted changes). Each side runs each setting as a whole process of this Python
with PYTHONPATH=<that side>/src, in a directory of its own. The settings:

    demo-sync   exgrpo train --config demo: SmolLM2-135M, whose reward is not always 0 (the hf engine)
    demo-async  the same on the vLLM engine with rollout.mode=async, s = 1 (needs vLLM: .venv-vllm)
    tiny-sync   exgrpo train --config tiny: the tiny random model, reward 0 (the loop's mechanics only)
    tiny-async  tests/training/async_ranks.py: the tiny model in async mode (s = 1) against an engine holding its
                own copy of the weights, with a toy reward that pays (the hf engine cannot run async, and vLLM
                cannot run the tiny model on CPU)

The demo settings set experience.start_threshold=0, so that the mixed phase starts after step 1 and replays run
from step 3 (sync) or 5 (async); each `exgrpo train` setting evaluates 8 held-out questions after its last step.
Every metric is compared exactly (NaN equals NaN) except wall times and throughputs: time, time/*,
tokens_per_second, async/engine_idle, async/learner_idle. Prints per setting "identical" or the first differing
step with each differing key's two values; exits 1 on any difference or failed run. A tiny setting takes ~30 s
per side on 2 cores; a demo setting ~2 min (estimated from `make demo`: 15 steps in 5 min 16 s) and more with the
machine shared. Run it alone: beside another job, demo-sync's entropy and grad_norm differed in the 7th digit from
step 2 (2026-12-06; identical when rerun alone), as if the CPU's math library split its sums by the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-C", str(ROOT)]
TIMINGS = ("time", "tokens_per_second", "async/engine_idle", "async/learner_idle")
VLLM_ASYNC = ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48",
              "rollout.mode=async", "rollout.max_staleness=1"]
ABSENT = "(absent)"


def exgrpo_train(preset: str, *overrides: str) -> Callable[[Path, Path, int], list[str]]:
    """The arguments of `python -m exgrpo train` on `preset`, for a side's tree, a run directory and steps."""
    def arguments(tree: Path, run_dir: Path, steps: int) -> list[str]:
        return ["-m", "exgrpo", "train", "--config", preset, *overrides, f"train.steps={steps}",
                f"eval.every={steps}", "eval.max_questions=8", "logging.progress=false",
                "logging.tensorboard=false", f"logging.output_dir={run_dir}"]
    return arguments


def async_ranks(tree: Path, run_dir: Path, steps: int) -> list[str]:
    return [str(tree / "tests" / "training" / "async_ranks.py"), str(run_dir), str(steps)]


@dataclass(frozen=True)
class Setting:
    arguments: Callable[[Path, Path, int], list[str]]
    """(a side's tree, run directory, steps) -> the arguments of this Python"""
    python_path: tuple[str, ...] = ("src",)
    """the side's folders the run imports from"""
    needs_vllm: bool = False


SETTINGS = {
    "demo-sync": Setting(exgrpo_train("demo", "experience.start_threshold=0")),
    "demo-async": Setting(exgrpo_train("demo", "experience.start_threshold=0", *VLLM_ASYNC), needs_vllm=True),
    "tiny-sync": Setting(exgrpo_train("tiny")),
    "tiny-async": Setting(async_ranks, python_path=("src", "tests/training")),
}


class RunFailed(Exception):
    pass


def run_setting(setting: Setting, tree: Path, run_dir: Path, steps: int) -> list[dict]:
    """One side's run of `setting` in `run_dir` (also its working directory); its metrics.jsonl lines."""
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / path) for path in setting.python_path),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, *setting.arguments(tree, run_dir, steps)], cwd=run_dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-20:])
        raise RunFailed(f"exited {result.returncode}; its last lines:\n{tail}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMINGS and not k.startswith("time/")}


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def first_difference(base: list[dict], work: list[dict]) -> str | None:
    """None when every line agrees but for timings; else the first differing line's step and each differing
    key with the base's and the working tree's value."""
    for number, (b, w) in enumerate(itertools.zip_longest(base, work), start=1):
        if b is None or w is None:
            side = "base" if w is None else "working tree"
            return f"line {number} (step {(b or w).get('step')}): only the {side} logged it"
        b, w = without_timings(b), without_timings(w)
        keys = [k for k in sorted(b.keys() | w.keys()) if not same(b.get(k, ABSENT), w.get(k, ABSENT))]
        if keys:
            rows = (f"    {k}: base {b.get(k, ABSENT)!r}, working tree {w.get(k, ABSENT)!r}" for k in keys)
            return "\n".join([f"first difference at step {w.get('step', b.get('step'))}:", *rows])
    return None


def compare_setting(name: str, trees: dict[str, Path], scratch: Path, steps: int) -> bool:
    """Runs `name` on both sides and prints its verdict; True when identical."""
    metrics = {}
    for side, tree in trees.items():
        start = time.monotonic()
        try:
            metrics[side] = run_setting(SETTINGS[name], tree, scratch / name / side, steps)
        except RunFailed as failure:
            print(f"{name}: the {side} run {failure}", flush=True)
            return False
        print(f"  ({name}: {side} ran in {time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    difference = first_difference(metrics["base"], metrics["working tree"])
    verdict = difference or f"identical ({len(metrics['base'])} lines)"
    print(f"{name}: {verdict}", flush=True)
    return difference is None


def commit_of(revision: str) -> str | None:
    found = subprocess.run([*GIT, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                           capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


@contextlib.contextmanager
def base_checkout(commit: str, path: Path) -> Iterator[Path]:
    """`commit` in a temporary git worktree at `path`, removed on the way out."""
    subprocess.run([*GIT, "worktree", "add", "--quiet", "--detach", str(path), commit], check=True)
    try:
        yield path
    finally:
        subprocess.run([*GIT, "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run([*GIT, "worktree", "prune"], check=False)


def chosen_settings(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"settings are a comma-separated subset of {', '.join(SETTINGS)} "
                                         f"(got {text!r})")
    return names


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1 (got {text!r})")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", metavar="BASE", help="the commit to compare the working tree with (e.g. HEAD)")
    parser.add_argument("--settings", type=chosen_settings, default=list(SETTINGS),
                        help=f"comma-separated, of {', '.join(SETTINGS)} (default: all)")
    parser.add_argument("--steps", type=positive, default=5, help="training steps of each run (default: 5)")
    args = parser.parse_args(argv)
    if any(SETTINGS[name].needs_vllm for name in args.settings) and importlib.util.find_spec("vllm") is None:
        parser.error("demo-async needs vLLM: run this with .venv-vllm/bin/python (make metrics-diff does)")
    commit = commit_of(args.base)
    if commit is None:
        parser.error(f"{args.base!r} is not a commit of {ROOT}")
    with tempfile.TemporaryDirectory(prefix="exgrpo-metrics-diff-") as scratch:
        with base_checkout(commit, Path(scratch) / "base-tree") as base_tree:
            trees = {"base": base_tree, "working tree": ROOT}
            differing = [name for name in args.settings
                         if not compare_setting(name, trees, Path(scratch) / "runs", args.steps)]
    print("identical on every setting" if not differing else f"not identical: {', '.join(differing)}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
