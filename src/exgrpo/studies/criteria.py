"""A pilot's criteria, read from its runs. A pilot study lists what it registered under `registered.criteria`:

    registered:
      criteria:
        "2: late mean - step 0": {measure: late_gain, from_step: 40, at_least: 0.05}
        "4: entropy at step 30": {measure: entropy, step: 30, at_least: 0.3}

Each criterion is a measure of one run (`MEASURES`, accuracies in [0, 1]) and a bound (`at_least`, `at_most`, both,
or none for a figure read without one). `bench/pilot_criteria.py` prints them for every run of a study."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from exgrpo.errors import ConfigError


@dataclass(frozen=True)
class PilotRun:
    """What a criterion reads of one run: its logged rows by step (a step's rows merged), the held-out accuracy at
    step 0, the study's last step, K, the experiential questions a step asks, and whether the arm replays."""

    by_step: dict[int, dict]
    start: float
    last: int
    num_generations: int
    replay_slots: int
    replays: bool

    @property
    def evaluations(self) -> dict[int, float]:
        """Held-out accuracy by step, step 0 first."""
        return {0: self.start} | {s: r["eval/accuracy"] for s, r in sorted(self.by_step.items()) if "eval/accuracy" in r}

    def medium_questions(self, step: int) -> float:
        return medium_questions(self.by_step[step], self.num_generations)


def medium_questions(row: dict, num_generations: int) -> float:
    """The buffer questions in the medium buckets (k = 2..K-2) that a step's logged `row` counts."""
    return sum(row.get(f"experience/bucket_{k}", 0) for k in range(2, num_generations - 1))


def _late_gain(run: PilotRun, from_step: int) -> float | None:
    late = [a for s, a in run.evaluations.items() if s >= from_step]
    return float(np.mean(late)) - run.start if late else None


def _medium_share(run: PilotRun, step: int | None = None) -> float | None:
    step = run.last if step is None else step
    total = sum(v for key, v in run.by_step.get(step, {}).items() if key.startswith("experience/bucket_"))
    return run.medium_questions(step) / total if total else None  # None: nothing logged, or an empty buffer


def _medium_supply(run: PilotRun, from_step: int, to_step: int) -> int:
    steps = [s for s in range(from_step, to_step + 1) if s in run.by_step]
    return sum(run.medium_questions(s) >= run.replay_slots for s in steps)


def _replayed_steps(run: PilotRun, from_step: int) -> int | None:
    if not run.replays:
        return None
    return sum(run.by_step.get(s, {}).get("experience/replayed", 0) >= 1 for s in range(from_step, run.last + 1))


def _at(key: str) -> Callable[..., float | None]:
    def measure(run: PilotRun, step: int | None = None) -> float | None:
        row = run.by_step.get(run.last if step is None else step)
        return None if row is None or key not in row else float(row[key])
    return measure


#: name -> (measure(run, **params), its parameters); step parameters default to the last step where optional
MEASURES: dict[str, tuple[Callable[..., float | int | None], tuple[str, ...]]] = {
    "start": (lambda run: run.start, ()),
    "learning": (lambda run: run.evaluations.get(run.last, math.nan) - run.start, ()),  # last evaluation - step 0
    "late_gain": (_late_gain, ("from_step",)),  # mean of the evaluations from `from_step` - step 0
    "drop_from_best": (lambda run: run.evaluations.get(run.last, math.nan) - max(run.evaluations.values()), ()),
    "entropy": (_at("entropy"), ("step",)),
    "cut": (_at("completions/clipped_ratio"), ("step",)),  # share of the step's completions cut at the cap
    "buffer_questions": (_at("experience/questions"), ("step",)),
    "medium_share": (_medium_share, ("step",)),  # the buffer's share at k = 2..K-2
    "medium_supply": (_medium_supply, ("from_step", "to_step")),  # steps whose medium buckets fill every replay slot
    "replayed_steps": (_replayed_steps, ("from_step",)),  # steps from `from_step` to the last that replayed
    "max_pass_at_1": (lambda run, to_step: max((run.by_step[s]["batch/pass_at_1"] for s in range(1, to_step + 1)
                                                 if s in run.by_step), default=None), ("to_step",)),
}
_OPTIONAL = {"step"}


@dataclass(frozen=True)
class Criterion:
    name: str
    measure: str
    params: dict = field(default_factory=dict)
    at_least: float | None = None
    at_most: float | None = None

    def read(self, run: PilotRun) -> tuple[float | int | None, bool | None]:
        """The measure's value on `run` and whether it meets the bound (None: no value, or no bound)."""
        value = MEASURES[self.measure][0](run, **self.params)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None, None
        if self.at_least is None and self.at_most is None:
            return value, None
        return value, (self.at_least is None or value >= self.at_least) and (self.at_most is None
                                                                             or value <= self.at_most)


def criteria_from(value, where: str) -> tuple[Criterion, ...]:
    """`registered.criteria` of a study file: a mapping of names to {measure, its parameters, at_least, at_most}."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of criterion names to {{measure, ..., at_least, at_most}}")
    found = []
    for name, spec in value.items():
        here = f"{where}.{name}"
        if not isinstance(spec, dict) or spec.get("measure") not in MEASURES:
            raise ConfigError(f"{here}: expected a mapping with a measure among {sorted(MEASURES)}, got {spec!r}")
        params = {k: v for k, v in spec.items() if k not in ("measure", "at_least", "at_most")}
        wanted = set(MEASURES[spec["measure"]][1])
        if set(params) - wanted or wanted - _OPTIONAL - set(params):
            raise ConfigError(f"{here}: measure {spec['measure']} takes {sorted(wanted) or 'no parameters'}, "
                              f"got {sorted(params) or 'none'}")
        bounds = [spec.get("at_least"), spec.get("at_most")]
        if not all(b is None or isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds) \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in params.values()):
            raise ConfigError(f"{here}: steps are integers and at_least / at_most numbers, got {spec!r}")
        found.append(Criterion(str(name), spec["measure"], params, *bounds))
    return tuple(found)
