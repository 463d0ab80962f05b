"""Zero-variance groups and the rollout cost of informative ones, per arm of a study run (from metrics.jsonl).

    python bench/zero_variance.py runs/replay-policies         # one row per arm, seeds pooled

Columns: the share of rolled-out groups whose K rewards were all equal, rollouts sampled per informative group,
rollouts sampled per step, generation rounds per step, and the held-out accuracy at the end (mean over seeds).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def arm_row(arm: Path) -> dict:
    steps, evals = [], []
    for seed in sorted(arm.glob("seed-*")):
        lines = [json.loads(line) for line in (seed / "metrics.jsonl").read_text().splitlines()]
        steps += lines
        evals += [m["eval/accuracy"] for m in lines[-1:] if "eval/accuracy" in m]
    groups = sum(m["generation/rollouts"] for m in steps)
    informative = sum(m["generation/informative_groups"] for m in steps)
    zero = statistics.fmean(m["generation/zero_variance_fraction"] for m in steps)
    return {"arm": arm.name, "seeds": len(list(arm.glob("seed-*"))), "zero_variance_share": round(zero, 3),
            "rollouts_per_informative_group": round(groups / max(informative, 1), 2),
            "rollouts_per_step": round(groups / len(steps), 1),
            "rounds_per_step": round(statistics.fmean(m["generation/rounds"] for m in steps), 2),
            "final_heldout": round(statistics.fmean(evals), 3) if evals else None}


def main() -> None:
    root = Path(sys.argv[1])
    for arm in sorted(p for p in root.iterdir() if p.is_dir() and list(p.glob("seed-*/metrics.jsonl"))):
        print(json.dumps(arm_row(arm)))


if __name__ == "__main__":
    main()
