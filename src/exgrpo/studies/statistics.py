"""The pre-registered statistics of a study: paired differences of an arm to the baseline over seeds, at equal
steps and at equal rollouts, their 95% t-intervals, and the verdict rules fixed before the runs (docs/results.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exgrpo.studies.study import RunResult

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # Student t


def t_interval(values: np.ndarray) -> tuple[float, float, float]:
    """Mean and two-sided 95% t-interval of (n,) `values` (2 ≤ n ≤ 10)."""
    if not 2 <= len(values) <= 10:
        raise ValueError(f"a t-interval needs 2 to 10 paired seeds, got {len(values)}")
    mean, half = values.mean(), T_975[len(values) - 1] * values.std(ddof=1) / np.sqrt(len(values))
    return float(mean), float(mean - half), float(mean + half)


@dataclass
class PairedDifference:
    """An arm minus a reference arm (the baseline, or the arm an ablation changes) on the seeds both ran, in
    accuracy units."""

    seeds: list[int]
    at_equal_steps: np.ndarray  # (n,) final accuracy − the reference's final accuracy
    at_equal_rollouts: np.ndarray  # (n,) final accuracy − the reference's last evaluation within as many rollouts
    reference_steps: list[int]  # (n,) the step of that reference evaluation


def paired_difference(runs: list[RunResult], reference: list[RunResult]) -> PairedDifference:
    by_seed = {r.seed: r for r in reference}
    pairs = [(r, by_seed[r.seed]) for r in runs if r.seed in by_seed]
    within = [b.accuracy_within(r.fresh_rollouts()[-1]) for r, b in pairs]
    return PairedDifference([r.seed for r, _ in pairs],
                            np.array([r.final_accuracy - b.final_accuracy for r, b in pairs]),
                            np.array([r.final_accuracy - a for (r, _), (_, a) in zip(pairs, within)]),
                            [s for s, _ in within])


def verdict(differences: np.ndarray, effect: float = 0.03, equivalence: float = 0.05) -> str:
    """The rules pre-registered in docs/results.md on (n,) paired differences (accuracy units): "helps" when the
    mean is ≥ `effect` and the 95% interval's low end > 0, "hurts" mirrored, "no difference" when the interval lies
    within ±`equivalence`. (Round two's "hurts" also asked the equal-rollouts mean to be negative; round three
    registered one rule per difference, and round two's "no difference" does not depend on it.)"""
    mean, low, high = t_interval(differences)
    if mean >= effect and low > 0:
        return "helps"
    if mean <= -effect and high < 0:
        return "hurts"
    if -equivalence <= low and high <= equivalence:
        return "no difference"
    return "inconclusive at this power"
