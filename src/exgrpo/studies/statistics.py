"""The pre-registered statistics of a study: paired differences of an arm to a reference arm over seeds, at equal
steps and at equal rollouts (by interpolation), their 95% t-intervals, the verdict rules, and the power of those
rules, all as registered in the study file (`exgrpo.studies.study.Registration`; docs/results.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exgrpo.studies.study import Registration, RunResult

#: Student t's 97.5% quantile by degrees of freedom (seeds − 1), for studies of 2 to 40 seeds
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 31: 2.040, 32: 2.037, 33: 2.035, 34: 2.032, 35: 2.030, 36: 2.028, 37: 2.026,
         38: 2.024, 39: 2.023}
MAX_SEEDS = max(T_975) + 1


def t_interval(values: np.ndarray) -> tuple[float, float, float]:
    """Mean and two-sided 95% t-interval of (n,) `values` (2 ≤ n ≤ MAX_SEEDS)."""
    if not 2 <= len(values) <= MAX_SEEDS:
        raise ValueError(f"a t-interval needs 2 to {MAX_SEEDS} paired seeds, got {len(values)}")
    mean, half = values.mean(), T_975[len(values) - 1] * values.std(ddof=1) / np.sqrt(len(values))
    return float(mean), float(mean - half), float(mean + half)


@dataclass
class PairedDifference:
    """An arm minus a reference arm (the baseline, or the arm an ablation changes) on the seeds both ran, in
    accuracy units, of the registered primary metric."""

    seeds: list[int]
    at_equal_steps: np.ndarray  # (n,) the arm's primary metric − the reference's
    at_equal_rollouts: np.ndarray  # (n,) ... − the reference's read at the arm's rollouts (interpolated; NaN: none)


def paired_difference(runs: list[RunResult], reference: list[RunResult],
                      registered: Registration) -> PairedDifference:
    by_seed = {r.seed: r for r in reference}
    pairs = [(r, by_seed[r.seed]) for r in runs if r.seed in by_seed]
    return PairedDifference(
        [r.seed for r, _ in pairs],
        np.array([r.primary(registered) - b.primary(registered) for r, b in pairs]),
        np.array([r.primary(registered) - b.primary_at_rollouts(registered, r.curve()[1]) for r, b in pairs]))


def verdict(differences: np.ndarray, registered: Registration) -> str:
    """The registered rules on (n,) paired differences (`Registration.verdict_rule`): "helps" when the 95%
    interval's low end is above 0 (under "effect" also the mean ≥ `effect`), "hurts" mirrored, "no difference"
    when the interval lies within ±`equivalence`, else "inconclusive at this power"."""
    mean, low, high = t_interval(differences)
    return str(_verdicts(np.array([mean]), np.array([high - mean]), registered)[0])


def _verdicts(mean: np.ndarray, half: np.ndarray, registered: Registration) -> np.ndarray:
    """The verdict of each study with (k,) means and 95% half-widths."""
    low, high = mean - half, mean + half
    needs = registered.effect if registered.verdict_rule == "effect" else 0.0
    return np.select([(mean >= needs) & (low > 0), (mean <= -needs) & (high < 0),
                      (low >= -registered.equivalence) & (high <= registered.equivalence)],
                     ["helps", "hurts", "no difference"], "inconclusive at this power")


def _simulated_intervals(true_effect: float, sd: float, seeds: int, trials: int) -> tuple[np.ndarray, np.ndarray]:
    """(trials,) means and 95% half-widths of studies whose paired differences are N(true_effect, sd²) over
    `seeds` seeds (a fixed random stream: the same figures every time)."""
    d = np.random.default_rng(0).normal(true_effect, sd, size=(trials, seeds))
    return d.mean(1), T_975[seeds - 1] * d.std(1, ddof=1) / np.sqrt(seeds)


def power(true_effect: float, sd: float, seeds: int, registered: Registration, trials: int = 20_000) -> float:
    """P(verdict "helps") when the paired differences are N(true_effect, sd²) over `seeds` seeds (simulated)."""
    return float(np.mean(_verdicts(*_simulated_intervals(true_effect, sd, seeds, trials), registered) == "helps"))


def no_difference_power(true_effect: float, sd: float, seeds: int, registered: Registration,
                        trials: int = 20_000) -> float:
    """P(verdict "no difference") (simulated as `power` is)."""
    verdicts = _verdicts(*_simulated_intervals(true_effect, sd, seeds, trials), registered)
    return float(np.mean(verdicts == "no difference"))


def detectable_effect(sd: float, seeds: int, registered: Registration, target: float = 0.8) -> float:
    """The smallest true effect the rules call "helps" with probability `target` (to 0.1 points)."""
    low, high = 0.0, 20 * sd + registered.effect
    while high - low > 0.001:
        middle = (low + high) / 2
        low, high = (low, middle) if power(middle, sd, seeds, registered) >= target else (middle, high)
    return high


def power_statement(registered: Registration, seeds: int) -> str:
    """The registered power, in words (empty when the study registered no SD)."""
    if registered.power_sd is None:
        return ""
    sd = registered.power_sd
    chances = ", ".join(f"{100 * power(e, sd, seeds, registered):.0f}% for a true {100 * e:+.1f}"
                        for e in registered.power_effects)
    return (f"With {seeds} paired seeds and the registered paired SD of {100 * sd:.1f} points, the rules say "
            f"\"helps\" with probability {chances}; 80% power needs a true effect of "
            f"{100 * detectable_effect(sd, seeds, registered):+.1f} points. With no true difference they say \"no "
            f"difference\" with probability {100 * no_difference_power(0.0, sd, seeds, registered):.0f}%.")
