"""Reward health: what the rewards of each step say about the reward functions, said out loud.

An error where training cannot be meaningful (a non-finite reward; no reward function gave any reward), a warning
(`RewardWarning`) naming the function otherwise: values outside the declared range, a function with no opinion on a
whole step, a success threshold never or always reached over the first steps, grading timeouts and crashes.
"""

from __future__ import annotations

import warnings

import numpy as np

from exgrpo.errors import ExgrpoWarning, TrainingError
from exgrpo.rewards.pool import KINDS

PROBE_STEPS = 5  # the first steps over which "never / always correct" is judged


class RewardWarning(ExgrpoWarning):
    """A reward function behaves in a way that probably makes the run mean something other than intended."""


# What a kind of grading failure means, and what to do about it.
_HINTS = {
    "raised": "it raised or returned an unusable value",
    "exited": "it raised SystemExit or KeyboardInterrupt (sys.exit(), exit()); a reward function must return its "
              "rewards, never end the process",
    "timed out": "raise reward.timeout if correct answers are being timed out",
    "crashed": "its grading worker died (os._exit(), a crash in native code, or out of memory)",
}


def _counts(f) -> str:
    """`f`'s failed items by kind: "all 16 timed out", "3 raised, 1 crashed"."""
    if len(f.kinds) == 1 and f.failed == f.graded:
        return f"all {f.graded} {next(iter(f.kinds))}"
    return ", ".join(f"{n} {kind}" for kind, n in sorted(f.kinds.items()))


def _hints(f) -> str:
    return "; ".join(_HINTS[kind] for kind in sorted(f.kinds))


def _metrics(f) -> str:
    return " and ".join(sorted({f"grading/{KINDS[kind]}" for kind in f.kinds}))


class RewardHealth:
    @classmethod
    def from_config(cls, reward) -> "RewardHealth":
        """From the `reward` config section (its declared range and success threshold)."""
        return cls(reward.min_value, reward.max_value, reward.success_threshold)

    def __init__(self, min_value: float, max_value: float, success_threshold: float):
        self.min_value, self.max_value, self.threshold = min_value, max_value, success_threshold
        self._warned: set[tuple[str, str]] = set()
        self._seen = 0
        self._low, self._high = np.inf, -np.inf  # of the total reward over the probe steps

    def _warn_once(self, kind: str, name: str, message: str) -> None:
        if (kind, name) not in self._warned:
            self._warned.add((kind, name))
            warnings.warn(RewardWarning(message), stacklevel=3)

    def check(self, step: int, per_function: dict[str, np.ndarray], total: np.ndarray,
              grading: dict[str, int], failures: dict | None = None) -> None:
        """The rewards of training step `step` (1-based): each function's values (NaN where it returned None)
        and the weighted total; `grading` counts the items that timed out, crashed or raised (logged, not checked
        here); `failures` holds each grader's failed items by kind (`rewards.pool.Failures`): an error when all of a
        grader's items failed, a warning when some did."""
        self._check_failures(step, failures or {})
        for name, values in per_function.items():
            if np.isinf(values).any():
                raise TrainingError(f"step {step}: reward function {name!r} returned a non-finite reward "
                                    f"({values[np.isinf(values)].flat[0]}); rewards must be finite numbers")
            present = values[~np.isnan(values)]
            if present.size == 0:
                self._warn_once("missing", name, f"step {step}: reward function {name!r} returned None/NaN for every "
                                                 "completion (it has no opinion on any of them)")
            outside = present[(present < self.min_value) | (present > self.max_value)]
            if outside.size:
                self._warn_once("range", name, f"step {step}: reward function {name!r} returned {outside[0]:g}, "
                                               f"outside reward.min_value..max_value = [{self.min_value:g}, "
                                               f"{self.max_value:g}]; set them to the function's range")
        if per_function and all(np.isnan(v).all() for v in per_function.values()):
            raise TrainingError(f"step {step}: no reward function gave a reward for any completion "
                                f"({', '.join(map(repr, per_function))} returned only None/NaN)")
        self._probe(step, per_function, total)

    def _check_failures(self, step: int, failures: dict) -> None:
        """Stop when every item a grader (or reward function) graded failed, whatever the kinds (raised, exited,
        timed out, crashed); warn at each step where some did, showing a grader's first failure once."""
        for label, f in failures.items():
            if not f.failed:
                continue
            if f.failed == f.graded:
                raise TrainingError(f"step {step}: {label!r} failed on every one of the {f.graded} completions it "
                                    f"graded ({_counts(f)}: {_hints(f)}); the first failure:\n{f.first}")
            first = "" if ("failed", label) in self._warned else f"; the first failure:\n{f.first}"
            self._warned.add(("failed", label))
            warnings.warn(RewardWarning(f"step {step}: grading failed for some completions: {label!r} failed on "
                                        f"{f.failed} of {f.graded} ({_counts(f)}: {_hints(f)}); they scored 0, "
                                        f"counted in {_metrics(f)}{first}"), stacklevel=3)

    def _probe(self, step: int, per_function: dict[str, np.ndarray], total: np.ndarray) -> None:
        if self._seen >= PROBE_STEPS:
            return
        self._seen += 1
        self._low, self._high = min(self._low, float(total.min())), max(self._high, float(total.max()))
        if self._seen < PROBE_STEPS:
            return
        names = ", ".join(map(repr, per_function))
        if self._high < self.threshold:
            self._warn_once("never", "", f"no rollout of the first {PROBE_STEPS} steps reached reward."
                                         f"success_threshold {self.threshold:g} (highest total reward {self._high:g}, "
                                         f"from {names}): nothing counts as correct, so the run cannot leave the "
                                         "warm-up phase or retire questions")
        elif self._low >= self.threshold:
            self._warn_once("always", "", f"every rollout of the first {PROBE_STEPS} steps reached reward."
                                          f"success_threshold {self.threshold:g} (lowest total reward {self._low:g}, "
                                          f"from {names}): every group is K/K and retires its question")
