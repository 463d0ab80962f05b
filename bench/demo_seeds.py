"""The demo's held-out accuracy before and after training over several seeds, on a base commit and on the working
tree: what a change that alters numerics (bf16 storage of the LoRA base, packed rows) does to what training reaches.
A table, not a test.

    .venv/bin/python bench/demo_seeds.py BASE [--seeds 1,2,3] [override ...]   # e.g. train.dtype=bf16

Each (tree, seed) runs `exgrpo demo train.seed=<seed> <overrides>` as its own process, one after another, with
PYTHONPATH=<that tree>/src (BASE from a temporary `git worktree`, removed afterwards), and reads the accuracies from
the run's report.md. Prints a markdown table: per tree and seed, held-out accuracy before and after and the wall
time; per tree, the mean gain.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metrics_diff import ROOT, base_checkout, commit_of  # noqa: E402

ROW = re.compile(r"^\| held-out accuracy (before|after) \| ([\d.]+)% ")
WALL = re.compile(r"^\| wall time \| ([\d.]+) min \|")


def demo(tree: Path, run_dir: Path, seed: int, overrides: list[str]) -> dict[str, float]:
    """One `exgrpo demo` of `tree` at `seed`: {"before", "after"} in % and "minutes"."""
    command = [sys.executable, "-m", "exgrpo", "demo", f"train.seed={seed}", f"logging.output_dir={run_dir}",
               "logging.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} in {tree} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    found: dict[str, float] = {}
    for line in (run_dir / "report.md").read_text().splitlines():
        if m := ROW.match(line):
            found[m.group(1)] = float(m.group(2))
        elif m := WALL.match(line):
            found["minutes"] = float(m.group(1))
    return found


def seeds(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not all(p.isdecimal() for p in parts) or len({int(p) for p in parts}) != len(parts):  # "1,a" is not [1]
        raise argparse.ArgumentTypeError(f"distinct whole numbers, comma-separated (got {text!r})")
    return [int(p) for p in parts]


#: what each run sets itself: an override of it would make every run of a tree the same run, or the same directory
OWNED = {"train.seed": "--seeds gives the seeds", "logging.output_dir": "each run gets its own directory"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", metavar="BASE", help="the commit to compare the working tree with")
    parser.add_argument("--seeds", type=seeds, default=[1, 2, 3], help="train.seed values (default: 1,2,3)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (e.g. train.dtype=bf16)")
    args = parser.parse_args(argv)
    for key in (override.split("=", 1)[0] for override in args.overrides):
        if key in OWNED:
            parser.error(f"override {key}: the script sets it for each run itself ({OWNED[key]})")
    commit = commit_of(args.base)
    if commit is None:
        parser.error(f"{args.base!r} is not a commit of {ROOT}")
    print(f"exgrpo demo {' '.join(args.overrides)}: held-out accuracy (%) before and after training", flush=True)
    print("\n| tree | seed | before | after | gain | wall |\n|---|---:|---:|---:|---:|---:|", flush=True)
    gains: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="exgrpo-demo-seeds-") as scratch:
        with base_checkout(commit, Path(scratch) / "base-tree") as base_tree:
            for side, (name, tree) in enumerate(((f"{args.base} (base)", base_tree), ("working tree", ROOT))):
                for seed in args.seeds:
                    r = demo(tree, Path(scratch) / "runs" / f"{side}-{seed}", seed, args.overrides)
                    gains.setdefault(name, []).append(r["after"] - r["before"])
                    print(f"| {name} | {seed} | {r['before']:.1f} | {r['after']:.1f} | {gains[name][-1]:+.1f} | "
                          f"{r['minutes']:.1f} min |", flush=True)
    for name, values in gains.items():
        print(f"| {name} | mean | | | {sum(values) / len(values):+.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
