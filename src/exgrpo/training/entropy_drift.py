"""Said out loud: a run whose optimizer steps follow the entropy bonus alone.

A step in which every group's K rewards are equal has every advantage 0, so its gradient is the entropy bonus
alone; while AdamW's moments have seen nothing else, it scales that small gradient into a full-size step, and a run
with no success from its start raises its entropy step after step towards uniform noise (round five: 2.0 to 10.4
nats in 60 steps). `train.zero_advantage_steps=skip` leaves such mini-batches' weights as they are.
"""

from __future__ import annotations

import warnings

from exgrpo.config import ExGRPOConfig
from exgrpo.errors import ExgrpoWarning

DRIFT_STEPS = 3  # the first steps of a run that, all without a reward spread, are warned about


class EntropyDriftWatch:
    """Warns when the first `DRIFT_STEPS` steps of a run all had no group with a reward spread, while the entropy
    bonus was on and such updates applied (`train.zero_advantage_steps` apply). Later runs of such steps are left
    alone: once AdamW's moments hold policy-gradient steps, a bonus-only gradient makes a small step (round five's
    study: runs of 3 such steps mid-run, entropy steady)."""

    def __init__(self, config: ExGRPOConfig):
        self.active = config.objective.entropy_coef != 0 and config.train.zero_advantage_steps == "apply"
        self._entropies: list[float] = []

    def observe(self, step: int, metrics: dict) -> None:
        """The metrics of training step `step` (1-based)."""
        if not self.active:
            return
        if metrics["frac_reward_zero_std"] < 1.0 or step != len(self._entropies) + 1:  # a spread, or resumed later
            self.active = False
            return
        self._entropies.append(metrics["entropy"])
        if step == DRIFT_STEPS:
            self.active = False
            warnings.warn(ExgrpoWarning(
                f"steps 1-{step} had no group with a reward spread (every advantage 0): their optimizer steps "
                f"followed the entropy bonus alone, which AdamW makes full-size while it has seen nothing else "
                f"(entropy {self._entropies[0]:.2f} -> {self._entropies[-1]:.2f} nats); a run with no success from "
                "its start drifts towards uniform noise this way. train.zero_advantage_steps=skip leaves such steps' "
                "weights as they are; rollout.zero_variance=backfill rolls out more questions to find a spread"),
                stacklevel=2)
