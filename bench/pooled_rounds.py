"""Round six's registered pooled secondary: an arm − a reference arm in the late mean over the paired seeds of
several rounds' reports (each report's curves.json), one t-interval over all the pairs, the verdict by a rule.

    .venv/bin/python bench/pooled_rounds.py docs/results-round-five/curves.json docs/results-round-six/curves.json

A pair is one seed of one round with both arms; rounds share no runs, so their pairs are independent. Accuracies are
printed in points. Descriptive: the rounds' data sets differ (round five `seed=56`, round six `seed=66`).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from exgrpo.studies.statistics import t_interval, verdict
from exgrpo.studies.study import Registration


def late_mean_differences(curves: dict, arm: str, reference: str, late_evaluations: int = 3) -> list[float]:
    """Per seed that both arms ran, the arm's late mean − the reference's (accuracy units); `curves` maps
    "<arm>/seed-<s>" to [step, rollouts, accuracy] rows, step 0 first (a report's curves.json)."""
    def late(rows):
        return float(np.mean([accuracy for _, _, accuracy in rows[1:][-late_evaluations:]]))

    seeds = sorted({key.split("/seed-")[1] for key in curves if key.startswith(f"{arm}/seed-")}, key=int)
    return [late(curves[f"{arm}/seed-{s}"]) - late(curves[f"{reference}/seed-{s}"]) for s in seeds
            if f"{reference}/seed-{s}" in curves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("curves", nargs="+", help="each round's report curves.json")
    parser.add_argument("--arm", default="exgrpo")
    parser.add_argument("--reference", default="grpo")
    parser.add_argument("--equivalence", type=float, default=0.02, help="round six's registered margin")
    args = parser.parse_args()
    pairs = []
    for path in args.curves:
        with open(path) as f:
            differences = late_mean_differences(json.load(f), args.arm, args.reference)
        print(f"{path}: {len(differences)} pairs, mean {100 * np.mean(differences):+.2f} points")
        pairs += differences
    mean, low, high = t_interval(np.array(pairs))
    rule = Registration(verdict_rule="interval", equivalence=args.equivalence)
    print(f"pooled, {len(pairs)} pairs: {args.arm} − {args.reference} = {100 * mean:+.2f} points "
          f"[{100 * low:+.2f}, {100 * high:+.2f}]: {verdict(np.array(pairs), rule)}")


if __name__ == "__main__":
    main()
